"""Rank 0's numbers carried on a tensor split's own sum over the ranks.

A tensor-parallel forward sums layer outputs over the ranks: mlx-lm's `shard` makes each
layer's output projections `ShardedToAllLinear` (each rank multiplies its slice, then an
all_sum). Rank 0's cycle times (`Rider.outbox`, see `engine.distributed`) ride on one of those
sums for one forward instead of a collective of their own: a stand-in for the sum's linear
computes the same partial product, appends one row along the sequence axis (rank 0's values,
zeros on the others), sums, and keeps the row for `Rider.inbox`. The token rows get the same
product and the same sum (an all_sum adds element by element), so the forward's output does
not change; a policy learns each time one cycle late, on every rank at once.
"""

from contextlib import contextmanager
from typing import Any, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from dflash_mlx.models.target.stand_ins import StandIn, swaps
from dflash_mlx.models.target.taps import modules_of

SUMMED = (nn.ShardedToAllLinear, nn.QuantizedShardedToAllLinear)


def ride_slot(layers: List[Any]) -> Optional[Tuple[Any, Any]]:
    """(parent, key) of the summed linear the rider takes: the first of the last layer that
    has one (every forward runs it, every rank finds the same), or None."""
    for layer in reversed([layer for layer in layers if layer is not None]):
        found = modules_of(layer, SUMMED)
        if found:
            return found[0][:2]
    return None


def _partial_product(linear, x: mx.array) -> mx.array:
    """This rank's share of `linear(x)`: its product before the sum and the bias."""
    if isinstance(linear, nn.QuantizedShardedToAllLinear):
        return mx.quantized_matmul(x, linear["weight"], scales=linear["scales"], biases=linear.get("biases"),
                                   transpose=True, group_size=linear.group_size, bits=linear.bits, mode=linear.mode)
    return x @ linear["weight"].T


class _RidingSum(StandIn):
    """The summed linear for one forward, with one more row in its sum."""

    def __init__(self, linear, values: List[float], rank: int):
        self._wrapped, self._values, self._rank = linear, values, rank
        self.arrived: Optional[mx.array] = None  # rank 0's values [n], once the forward ran it

    def __call__(self, x: mx.array) -> mx.array:
        partial = _partial_product(self._wrapped, x)  # [..., S, D]
        *lead, _, width = partial.shape
        rows = 1
        for n in lead:
            rows *= n
        sent = self._values if self._rank == 0 else []  # one rider row per batch row, the first holds them
        ride = mx.array(sent + [0.0] * (rows * width - len(sent)), partial.dtype).reshape(*lead, 1, width)
        summed = mx.distributed.all_sum(mx.concatenate([partial, ride], axis=-2), group=self._wrapped.group)
        self.arrived = summed[..., -1:, :].reshape(-1)[: len(self._values)]
        out = summed[..., :-1, :]
        return out + self._wrapped["bias"] if "bias" in self._wrapped else out


def capacity(slot: Tuple[Any, Any]) -> int:
    """How many values one ride carries (one row of the linear's output)."""
    parent, key = slot
    return parent[key]["weight"].shape[0]


@contextmanager
def riding(slot: Tuple[Any, Any], values: List[float], rank: int):
    """The swap of one forward whose sum carries `values` (rank 0's; the same count on every
    rank); yields the stand-in, whose `arrived` holds them after the forward."""
    parent, key = slot
    with swaps() as put:
        stand_in = _RidingSum(parent[key], values, rank)
        put(parent, key, stand_in)
        yield stand_in
