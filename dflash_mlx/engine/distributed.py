"""Every rank of a target split over processes runs the same engine step.

A split target's forward is a collective: every rank must verify the same width, the same
kind of proposal (chain, tree or copy) and the same tokens, or the ranks' collectives stop
matching and the run hangs or goes wrong. The proposals and accept lengths already agree
(every rank computes the same logits, and the draft is loaded whole on every rank); what
does not is what each rank measures. So the engine's two sources of difference pass here:

  cycle times    `share_seconds`: every policy (`policy/`: width, copy or draft, tree or
                 chain, a batch's width) learns rank 0's measured times, so every rank makes
                 the same choice. They cost no collective of their own: they ride on the next
                 forward's own collectives (a pipeline's hops, `models.target.pipeline_carry`;
                 one of a tensor split's layer sums, `models.target.tensor_ride`), so a policy
                 learns a cycle's time one cycle late. What a cycle accepted is learned at once
                 (`BlockSizer.count`: only the time waits). Where nothing can carry them (a
                 model whose split has no such sum), one all_sum sends `EVERY` at a time.
                 Every rank hands each time to its policy at the same point of its run, so
                 the choices stay identical
  the random stream   `shared_seed`: a sampled answer with no seed gets rank 0's, so every
                 rank draws the same acceptance coins (one small all_sum a request)

Nothing changes for a target whole in one process: a time is handed over at once. Those
all_sums run on the CPU's stream, after the split forwards queued on the generation stream
(`sharding.settle`: two streams' collectives must never be in flight at once).
"""

import random
from typing import Callable, Optional

import mlx.core as mx

from dflash_mlx.models.target.sharding import settle

# Cycle times sent in one all_sum where no forward carries them: one collective per EVERY cycles on
# top of the verify forwards' own (60 a forward on a 30-layer llama), and a policy that learns EVERY late.
EVERY = 8


def _group(target) -> Optional[object]:
    sharding = getattr(target, "sharding", None)
    return sharding.group if sharding is not None else None


def _from_rank0(group, value: float, dtype) -> mx.array:
    settle()
    local = mx.array([value if group.rank() == 0 else 0], dtype=dtype)
    return mx.distributed.all_sum(local, group=group, stream=mx.cpu)


def share_seconds(target, seconds: float, learn: Callable[[float], None]) -> None:
    """`learn(rank 0's seconds)` on every rank of a split target, at the same point of every
    rank's run (`learn(seconds)` at once for a target whole in one process). Called after a
    cycle's host sync, when the forward that carried the earlier times has run."""
    sharding = getattr(target, "sharding", None)
    if sharding is None:
        learn(seconds)
        return
    rider = sharding.rider
    rider.waiting.append(learn)
    rider.outbox.append(seconds if sharding.rank == 0 else 0.0)
    for arrived in rider.inbox:  # rode on forwards since the last call (pipeline_carry, tensor_ride)
        for value in arrived.tolist():
            rider.waiting.popleft()(value)
    rider.inbox.clear()
    if len(rider.outbox) >= EVERY:  # nothing carried them: one all_sum sends them all
        local = mx.array(rider.outbox if sharding.rank == 0 else [0.0] * len(rider.outbox), dtype=mx.float32)
        rider.outbox.clear()
        settle()
        for value in mx.distributed.all_sum(local, group=sharding.group, stream=mx.cpu).tolist():
            rider.waiting.popleft()(value)


def shared_seed(target, seed: Optional[int]) -> Optional[int]:
    """The seed every rank of a split target samples with: `seed`, or one rank 0 draws when
    it is None (each process's own random stream starts elsewhere); `seed` otherwise."""
    group = _group(target)
    if group is None or seed is not None:
        return seed
    return int(_from_rank0(group, random.getrandbits(31), mx.int32).item())
