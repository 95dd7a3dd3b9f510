"""Ports for two ranks of MLX's ring backend on localhost (tests that start ranks)."""

import socket

import pytest


def free_port_pair() -> int:
    """A port P with P and P+1 free (rank r listens on P+r, as mlx.launch's --starting-port gives)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    pytest.skip("no two free consecutive ports")
