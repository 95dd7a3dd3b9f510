"""The ranks of a split target end together however they were started (dflash_mlx/models/peers.py):
two ranks started directly (MLX_RANK and MLX_HOSTFILE, ring backend on localhost, no mlx.launch to
end them); a rank that ends ends the other with one line within the grace, a run that ends well
alarms nobody. Skips where MLX's ring backend is missing."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from dflash_mlx.models import peers
from ring_ports import free_starting_port

DRIVER = Path(__file__).with_name("peers_driver.py")
GRACE = 1.0


def _start(case: str, tmp_path: Path):
    if not mx.distributed.is_available("ring"):
        pytest.skip("MLX's ring backend is not available")
    port = free_starting_port()
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    env = dict(os.environ, MLX_HOSTFILE=str(hosts), OPENBLAS_NUM_THREADS="1")
    return [subprocess.Popen([sys.executable, str(DRIVER), case, str(GRACE)], env=dict(env, MLX_RANK=str(r)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]


def _ended(procs, timeout=60):
    """[(exit code, stderr lines, seconds after the first rank ended)] of both ranks."""
    out, first = [None, None], None
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and any(o is None for o in out):
        for r, p in enumerate(procs):
            if out[r] is None and p.poll() is not None:
                first = first or time.monotonic()
                out[r] = (p.returncode, p.stderr.read().splitlines(), time.monotonic() - first)
        time.sleep(0.05)
    for p in procs:
        p.kill()
    assert all(o is not None for o in out), "a rank did not end"
    return out


@pytest.mark.parametrize("dies", [0, 1])
def test_a_rank_that_ends_ends_the_other_with_one_line(dies, tmp_path):
    out = _ended(_start(f"die{dies}", tmp_path))
    code, lines, after = out[1 - dies]
    assert out[dies][0] == 3
    gone = [line for line in lines if "is gone" in line]
    assert code == 1 and gone == [f"rank {1 - dies}: rank {dies} is gone (it ended without ending the run); stopping"], lines
    assert not any("alive" in line for line in lines)
    assert GRACE - 0.2 < after < GRACE + 5, after  # the grace, then at once (not the 30 s it waited)


def test_a_run_that_ends_well_alarms_nobody(tmp_path):
    out = _ended(_start("done", tmp_path))
    for rank, (code, lines, _) in enumerate(out):
        assert code == 0 and lines[-1] == f"rank {rank}: alive" and not any("gone" in line for line in lines), lines


def test_only_a_rank_that_knows_the_token_is_watched():
    watch = peers.PeerWatch(0, grace_s=60)
    watch._server = socket.create_server(("127.0.0.1", 0))
    port = watch._server.getsockname()[1]
    import threading

    accepting = threading.Thread(target=peers._accept, args=(watch, 5, 1))
    accepting.start()
    stranger = socket.create_connection(("127.0.0.1", port))
    stranger.sendall(b"4 1\n")
    stranger.close()
    time.sleep(0.3)
    assert watch.gone is None and watch._conns == []
    rank1 = socket.create_connection(("127.0.0.1", port))
    rank1.sendall(b"5 1\n")
    accepting.join(10)
    assert len(watch._conns) == 1
    rank1.sendall(peers.BYE)  # a goodbye, then closed: not a loss
    rank1.close()
    time.sleep(0.3)
    assert len(watch._conns) == 1 and watch.gone is None
    watch.close(well=False)


def test_rank0s_address_comes_from_mlxs_own_configuration(tmp_path):
    ring = tmp_path / "ring.json"
    ring.write_text(json.dumps([["10.0.0.1:47000"], ["10.0.0.2:47000"]]))
    assert peers.rank0_host({"MLX_HOSTFILE": str(ring)}) == "10.0.0.1"
    assert peers.rank0_host({"MLX_JACCL_COORDINATOR": "10.0.0.9:5000"}) == "10.0.0.9"
    assert peers.rank0_host({}) is None
    assert peers.rank0_host({"MLX_HOSTFILE": str(tmp_path / "missing.json")}) is None
