"""The server's processes when its target is split over them (`mlx.launch`): one serves, all step.

A split target's forward is a collective, so every rank's `BatchEngine` must run the same
step with the same rows joining and leaving at the same step. Only rank 0 serves HTTP, so
only it knows when a request comes, is cancelled or is over: its worker decides each step's
events (`steps.StepEvents`: rows that leave, requests that join with their token ids and
options, its cached conversations' keys when they changed, or stop) and `Ranks.share` hands
them to every rank: one all-sum of their pickled size, then, when there are any, one of
their bytes. While rank 0 has nothing to run it shares an empty step every `HEARTBEAT_S`, so
a rank that is gone is found then too. A request with no seed gets one rank 0 draws
(`Ranks.with_seed`), carried in its event as `engine.distributed.shared_seed` would share
it, so deciding a step runs no collective of its own.

Ending: a collective that fails ends the worker with one line (`lost`). `follow` is the main
thread of a rank other than 0: Ctrl-C (which reaches every rank on one machine) waits for
rank 0's stop; SIGTERM, which mlx.launch sends every rank when one exits with an error, ends
it at once; so does the launcher's being gone, or another rank's (`models.peers`, which also
covers ranks started without mlx.launch). A rank stuck in a collective whose peer died
mid-forward (MLX's ring backend does not always fail it) is ended by `end_within` or `exit_now`:
Python's own exit would abort on that thread.
"""

import os
import random
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import Any, Optional

from dflash_mlx.models import peers
from dflash_mlx.models.peers import exit_now
from dflash_mlx.models.sharded import share
from dflash_mlx.options import GenerationOptions

HEARTBEAT_S = 1.0  # rank 0's empty step while it has nothing to run
GRACE_S = 10.0  # after Ctrl-C, how long a rank other than 0 waits for rank 0's stop
STOP_S = 5.0  # after a signal to stop, how long rank 0's engine thread has to end the run


class Ranks:
    """The processes a target is split over, as the server's worker sees them (one, when the
    target is whole: nothing is shared)."""

    def __init__(self, target):
        sharding = getattr(target, "sharding", None)
        self.group = sharding.group if sharding is not None else None
        self.size = self.group.size() if self.group is not None else 1
        self.rank = self.group.rank() if self.group is not None else 0
        self.parent = os.getppid()

    @property
    def speaks(self) -> bool:
        """Whether this rank serves HTTP and decides the steps (rank 0)."""
        return self.rank == 0

    def with_seed(self, options: GenerationOptions) -> GenerationOptions:
        """`options` with a seed every rank samples alike: its own, or one rank 0 draws now."""
        if self.size < 2 or options.seed is not None:
            return options
        return replace(options, seed=random.getrandbits(31))

    def share(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (`obj` elsewhere is ignored): one all-sum of its pickled
        size, then, unless `obj` is empty (falsy: None on the others), one of its bytes
        (`models.sharded.share`)."""
        if self.size < 2:
            return obj
        shared = share(obj if obj else None, self.group)
        return obj if self.speaks else shared

    def gone(self) -> Optional[str]:
        """Why this rank must stop though no rank stopped the run, in one line, or None: the
        process that started it (mlx.launch) is gone, or another rank is (`models.peers`)."""
        if self.size < 2:
            return None
        if os.getppid() != self.parent:
            return f"rank {self.rank}: the process that launched it is gone; stopping"
        return peers.gone()


def lost(e: BaseException, ranks: Ranks) -> str:
    """One line for an engine thread that failed: on a split target, most often a rank that is gone."""
    text = f"{type(e).__name__}: {' '.join(str(e).split())}"
    if ranks.size < 2:
        return f"the engine stopped ({text})"
    return (f"rank {ranks.rank}: the split target's ranks are no longer in step ({text}): another rank is gone "
            "or failed; stopping")


def follow(worker) -> Optional[str]:
    """The main thread of a rank other than 0 while its worker runs rank 0's steps: None once
    rank 0 stopped them, else the one line that says why this rank stops. Ctrl-C waits up to
    `GRACE_S` for rank 0's stop (it reaches every rank on one machine); a second one does not.
    SIGTERM or SIGHUP (mlx.launch ending the ranks when one failed) ends this rank at once."""
    rank, interrupts = worker.ranks.rank, []

    def on_signal(n, _):
        if n == signal.SIGINT:
            interrupts.append(time.monotonic())  # noted, not raised: the worker's thread goes on
        else:
            exit_now(f"dflash-mlx serve: rank {rank}: stopped by {signal.Signals(n).name} (another rank ended)",
                     128 + n)

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {n: signal.signal(n, on_signal) for n in handled}
    try:
        while not worker.ended.wait(0.25):
            if len(interrupts) > 1:
                return f"rank {rank}: interrupted"
            if interrupts and time.monotonic() - interrupts[0] > GRACE_S:
                return f"rank {rank}: interrupted, and rank 0 did not stop the run within {GRACE_S:.0f} s"
            gone = worker.ranks.gone()
            if gone:
                return gone
        return worker.failed
    finally:
        for n, handler in before.items():
            signal.signal(n, handler)


def end_within(worker, seconds: float, said: Optional[str], stuck: str):
    """Wait up to `seconds` for `worker`'s engine thread to end, then print `said` (None: nothing);
    past them print `stuck` and end this process: a thread waiting in a collective on a rank that
    died mid-forward may never return (MLX's ring backend does not always fail it)."""
    def watch():
        if not worker.ended.wait(seconds):
            exit_now(stuck)
        if said:
            print(said, file=sys.stderr, flush=True)

    threading.Thread(target=watch, name="dflash-stop-watch", daemon=True).start()
