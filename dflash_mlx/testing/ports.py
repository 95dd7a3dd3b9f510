"""Ports on localhost for the ranks of MLX's ring backend (tests and benchmarks that start ranks)."""

import socket
from typing import Optional


def free_starting_port(tries: int = 50, ranks: int = 2) -> Optional[int]:
    """A port P with P .. P+ranks-1 free (rank r listens on P+r, as mlx.launch's --starting-port
    gives), or None when `tries` picks found none."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for r in range(1, ranks):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + r))
            return port
        except OSError:
            continue
    return None
