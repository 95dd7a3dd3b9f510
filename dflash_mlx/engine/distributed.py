"""Every rank of a target split over processes runs the same engine step.

A split target's forward is a collective: every rank must verify the same width, the same
kind of proposal (chain, tree or copy) and the same tokens, or the ranks' collectives stop
matching and the run hangs or goes wrong. The proposals and accept lengths already agree
(every rank computes the same logits, and the draft is loaded whole on every rank); what
does not is what each rank measures. So the engine's two sources of difference pass here:

  cycle times    `shared_seconds`: rank 0's measured time, given to every rank, so every
                 policy (`policy/`: width, copy or draft, tree or chain, a batch's width)
                 learns the same numbers and makes the same choice
  the random stream   `shared_seed`: a sampled answer with no seed gets rank 0's, so every
                 rank draws the same acceptance coins

Both are one small all-sum, and nothing at all for a target whole in one process.
"""

import random
from typing import Optional

import mlx.core as mx


def _group(target) -> Optional[object]:
    sharding = getattr(target, "sharding", None)
    return sharding.group if sharding is not None else None


def _from_rank0(group, value: float, dtype) -> mx.array:
    local = mx.array([value if group.rank() == 0 else 0], dtype=dtype)
    return mx.distributed.all_sum(local, group=group, stream=mx.cpu)


def shared_seconds(target, seconds: float) -> float:
    """`seconds` as rank 0 measured it, on every rank of a split target (itself otherwise)."""
    group = _group(target)
    if group is None:
        return seconds
    return _from_rank0(group, seconds, mx.float32).item()


def shared_seed(target, seed: Optional[int]) -> Optional[int]:
    """The seed every rank of a split target samples with: `seed`, or one rank 0 draws when
    it is None (each process's own random stream starts elsewhere); `seed` otherwise."""
    group = _group(target)
    if group is None or seed is not None:
        return seed
    return int(_from_rank0(group, random.getrandbits(31), mx.int32).item())
