"""Ports on localhost for two ranks of MLX's ring backend (tests and benchmarks that start ranks)."""

import socket
from typing import Optional


def free_port_pair(tries: int = 50) -> Optional[int]:
    """A port P with P and P+1 free (rank r listens on P+r, as mlx.launch's --starting-port gives),
    or None when `tries` picks found none."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    return None
