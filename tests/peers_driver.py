"""Run by tests/test_peers.py as two ranks started directly (MLX_RANK, MLX_HOSTFILE; no launcher).

argv[1], the case: "die1" (rank 1 ends at once; rank 0 waits as if stuck in a collective),
"die0" (the other way round), "done" (both end well, rank 1 a while after rank 0). argv[2]: the
grace in seconds. A rank that is still alive at the end prints "alive" and exits 0."""

import os
import sys
import time

import dflash_mlx  # noqa: F401  (before mlx.core)
import mlx.core as mx

from dflash_mlx.models import peers

case, grace = sys.argv[1], float(sys.argv[2])
group = mx.distributed.init()
rank = group.rank()
assert peers.watch(group, grace_s=grace) is not None
print(f"rank {rank}: watching", file=sys.stderr, flush=True)
if case == f"die{rank}":
    os._exit(3)
if case == "done":
    time.sleep(0.5 * rank)
    peers.done()
    time.sleep(2 * grace * rank)  # rank 1 outlives rank 0 by more than the grace
    assert peers.gone() is None
else:
    time.sleep(30)  # stuck: only the watch ends this rank
print(f"rank {rank}: alive", file=sys.stderr, flush=True)
