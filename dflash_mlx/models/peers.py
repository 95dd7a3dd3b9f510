"""The processes of a split target end together, however they were started.

A collective whose peer died does not always fail on MLX's ring backend: the survivor can wait
in it for good. `mlx.launch` covers that by sending every rank SIGTERM when one exits with an
error, but ranks started another way (each machine running the command itself with `MLX_RANK`
and `MLX_HOSTFILE`, as docs/distributed.md suggests where the launcher's busy loop costs a core)
have no such guard. So each rank other than 0 holds one TCP connection to rank 0, beside MLX's
own: a process that ends for any reason has its connections closed by its operating system, so
the others see it at once (TCP keep-alive finds a machine that went away within about 10 s).

`watch(group)` sets the connections up: rank 0 listens on a free port and shares the port and a
random token in one all-sum; the others connect to rank 0's address as MLX's own configuration
names it (`MLX_HOSTFILE` for the ring backend, `MLX_JACCL_COORDINATOR` for JACCL) and say who
they are. From then on `gone()` is the one line that says which rank is gone, and a process still
alive `GRACE_S` later (its front end did not stop on its own: a thread waits in a collective)
prints it and ends. A run that ends well says so first (`done()`): its connections then close
without alarming the others. Front ends start it under `--distributed` (`cli.common.launched`).
"""

import atexit
import json
import os
import secrets
import socket
import sys
import threading
import time
from typing import List, Optional

GRACE_S = 8.0  # after a rank is gone, how long this process has to stop on its own
BYE = b"bye\n"


def rank0_host(env=os.environ) -> Optional[str]:
    """Rank 0's address as MLX's launch configuration gives it, or None where it names none."""
    coordinator = env.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return coordinator.rsplit(":", 1)[0]
    path = env.get("MLX_HOSTFILE")
    if not path:
        return None
    try:
        with open(path) as f:
            first = json.load(f)[0]
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return None
    first = first[0] if isinstance(first, list) and first else first
    return first.rsplit(":", 1)[0] if isinstance(first, str) and ":" in first else None


def _keep_alive(conn: socket.socket):
    """Probe an idle connection every 2 s after 4 s, and give up after 3 missed answers."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = getattr(socket, "TCP_KEEPIDLE", None) or getattr(socket, "TCP_KEEPALIVE", None)  # Linux | macOS
    for option, value in ((idle, 4), (getattr(socket, "TCP_KEEPINTVL", None), 2),
                          (getattr(socket, "TCP_KEEPCNT", None), 3)):
        if option is not None:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, option, value)
            except OSError:
                pass


class PeerWatch:
    """This rank's connections to the others (rank 0: one from each; the others: one to rank 0)."""

    def __init__(self, rank: int, grace_s: float = GRACE_S):
        self.rank, self.grace_s = rank, grace_s
        self.gone: Optional[str] = None
        self.ended = False
        self._conns: List[socket.socket] = []
        self._server: Optional[socket.socket] = None
        self._lock = threading.Lock()

    def lose(self, peer: str):
        """A connection closed without a goodbye: note the line, and end this process if it is
        still alive `grace_s` later."""
        with self._lock:
            if self.ended or self.gone is not None:
                return
            self.gone = f"rank {self.rank}: {peer} is gone (it ended without ending the run); stopping"
        timer = threading.Timer(self.grace_s, exit_now, args=(self.gone,))
        timer.daemon = True
        timer.start()

    def follow(self, conn: socket.socket, peer: str):
        """Wait on `conn` until it says goodbye or closes (a reader thread)."""
        def read():
            data = b""
            while BYE not in data:
                try:
                    chunk = conn.recv(64)
                except OSError:
                    chunk = b""
                if not chunk:
                    return self.lose(peer)
                data = (data + chunk)[-64:]

        threading.Thread(target=read, name=f"dflash-peer-{peer}", daemon=True).start()

    def close(self, well: bool):
        """Stop watching; `well`: the run ended as it should, so tell the others first."""
        with self._lock:
            self.ended = True
        for conn in self._conns:
            try:
                if well:
                    conn.sendall(BYE)
                conn.close()
            except OSError:
                pass
        if self._server is not None:
            self._server.close()


_current: Optional[PeerWatch] = None


def watch(group, grace_s: float = GRACE_S) -> Optional[PeerWatch]:
    """Start watching the other ranks of `group` (a collective: every rank calls it at the same
    point); a watch started before is closed first. None for a group of one, or where MLX's
    configuration names no address for rank 0 on some rank (then nothing is watched anywhere)."""
    import mlx.core as mx

    global _current
    if _current is not None:
        _current.close(well=True)
        _current = None
    if group.size() < 2:
        return None
    rank, host = group.rank(), rank0_host()
    ours = PeerWatch(rank, grace_s)
    port, token = 0, 0
    if rank == 0 and host is not None:
        ours._server = socket.create_server(("", 0))
        port, token = ours._server.getsockname()[1], secrets.randbits(30) + 1
    shared = mx.distributed.all_sum(mx.array([port, token, int(host is not None)]), group=group, stream=mx.cpu)
    port, token, able = shared.tolist()
    if able < group.size():
        if ours._server is not None:
            ours._server.close()
        return None
    if rank == 0:
        _accept(ours, token, group.size() - 1)
    else:
        try:
            conn = socket.create_connection((host, port), timeout=10)
            conn.settimeout(None)
            _keep_alive(conn)
            conn.sendall(f"{token} {rank}\n".encode())
        except OSError as e:
            print(f"rank {rank}: could not reach rank 0 at {host}:{port} to watch it ({e}); if rank 0 dies "
                  "this rank may wait for it", file=sys.stderr, flush=True)
            return None
        ours._conns.append(conn)
        ours.follow(conn, "rank 0")
    _current = ours
    return ours


def _accept(ours: PeerWatch, token: int, expected: int, timeout: float = 10.0):
    """Rank 0: take one connection from each other rank that knows the token (others are closed),
    before anything else runs: a rank that ends at once must find its goodbye heard."""
    server, seen = ours._server, set()
    deadline = time.monotonic() + timeout
    while len(seen) < expected and time.monotonic() < deadline:
        server.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            conn, _ = server.accept()
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            said = conn.recv(64).decode("ascii", "replace").split()
            peer = int(said[1]) if len(said) == 2 and said[0] == str(token) else None
        except (OSError, ValueError):
            continue
        if peer is None or peer in seen:
            conn.close()
            continue
        conn.settimeout(None)
        _keep_alive(conn)
        seen.add(peer)
        ours._conns.append(conn)
        ours.follow(conn, f"rank {peer}")
    server.close()
    if len(seen) < expected:
        print(f"rank 0: {expected - len(seen)} rank(s) did not connect to watch it within {timeout:.0f} s; "
              "if one dies this rank may wait for it", file=sys.stderr, flush=True)


def gone() -> Optional[str]:
    """The one line saying which rank is gone, once the current watch saw one go; else None."""
    return _current.gone if _current is not None else None


def done():
    """The run ended as it should: close the watch and tell the other ranks so."""
    global _current
    if _current is not None:
        _current.close(well=True)
        _current = None


def exit_now(line: str, code: int = 1):
    """Print `line` and end this process at once. For a process whose threads may still be inside
    an MLX collective: Python's own exit would stop such a thread inside MLX, which aborts."""
    try:
        print(line, file=sys.stderr, flush=True)
        sys.stdout.flush()
    finally:
        os._exit(code)


atexit.register(lambda: _current is not None and _current.close(well=False))
