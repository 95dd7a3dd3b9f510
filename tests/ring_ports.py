"""Ports for two ranks of MLX's ring backend on localhost (tests that start ranks)."""

import pytest

from dflash_mlx.testing import ports


def free_starting_port() -> int:
    """A port P with P and P+1 free (rank r listens on P+r), or the test is skipped."""
    port = ports.free_starting_port()
    if port is None:
        pytest.skip("no two free consecutive ports")
    return port
