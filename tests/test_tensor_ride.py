"""Rank 0's cycle times ride on a tensor split's own layer sum (models/target/tensor_ride.py), and
the width policy takes what a cycle accepted at once while its time arrives later (BlockSizer.count).

In one process: a model split by mlx-lm's own `shard` over a group of one process (its sums add
nothing) runs every swap of a riding forward; its hidden states and features must equal the plain
forward's exactly. The two-rank runs, and the count of all_sums an answer builds, are in
tests/test_distributed.py's one launch."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from dflash_mlx.engine import distributed
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.models.target.sharding import Sharding
from dflash_mlx.models.target.tensor_ride import capacity, ride_slot, riding
from dflash_mlx.policy.sizer import BlockSizer
from dflash_mlx.testing import archs
from dflash_mlx.testing.targets import TINY_CONFIGS, tiny_target


def _split_in_one(arch: str) -> Target:
    """A tiny target split by mlx-lm's `shard` over a group of one, as a tensor split."""
    model = tiny_target(arch, seed=1)[0] if arch in TINY_CONFIGS else archs.build(arch)
    group = mx.distributed.init()
    model.shard(group)
    target = Target(model)
    target.sharding = Sharding("tensor", group)
    target._ride_slot = ride_slot(target.layers)
    return target


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_a_riding_forward_equals_the_plain_forward_and_brings_rank0s_values(arch):
    target = _split_in_one(arch)
    parent, key = target._ride_slot
    last = target.layers[-1]
    assert isinstance(parent[key], (nn.ShardedToAllLinear, nn.QuantizedShardedToAllLinear))
    assert any(module is parent[key] for _, module in last.named_modules())  # the last layer's
    tokens = mx.array([[3, 5, 7, 11], [2, 4, 6, 8]])
    h0, f0, _ = target.forward(tokens, target.make_cache(), [0, 1], record=True)
    rider = target.sharding.rider
    rider.outbox.extend([0.125, 3.5])
    h1, f1, _ = target.forward(tokens, target.make_cache(), [0, 1], record=True)
    assert mx.array_equal(h0, h1) and mx.array_equal(f0, f1)
    assert rider.outbox == [] and [x.tolist() for x in rider.inbox] == [[0.125, 3.5]]
    assert type(parent[key]) in (nn.ShardedToAllLinear, nn.QuantizedShardedToAllLinear)  # put back


def test_a_riding_forward_keeps_the_caches_the_plain_forward_keeps():
    target = _split_in_one("llama")
    c0, c1 = target.make_cache(), target.make_cache()
    for chunk in ([[3, 5, 7]], [[9, 1]]):  # a prefill, then a step on what it cached
        h0, _, _ = target.forward(mx.array(chunk), c0)
        target.sharding.rider.outbox.append(0.5)
        h1, _, _ = target.forward(mx.array(chunk), c1)
        assert mx.array_equal(h0, h1)
    for a, b in zip(c0, c1):
        assert all(mx.array_equal(x, y) for x, y in zip(a.state, b.state))


@pytest.mark.parametrize("bias", [False, True])
def test_a_quantized_summed_linear_with_a_bias_rides_exactly(bias):
    """The stand-in computes the same partial product as mlx's class, and adds the bias after the sum."""
    group = mx.distributed.init()
    quantized = nn.QuantizedLinear.from_linear(nn.Linear(64, 32, bias=bias))
    if bias:
        quantized.bias = mx.random.normal((32,))
    summed = nn.QuantizedShardedToAllLinear.from_quantized_linear(quantized, group=group)
    holder = [summed]
    x = mx.random.normal((2, 3, 64))
    with riding((holder, 0), [0.25, 7.0, 1.5], rank=0) as stand_in:
        out = holder[0](x)
    assert mx.array_equal(out, summed(x)) and stand_in.arrived.tolist() == [0.25, 7.0, 1.5]
    assert holder[0] is summed and capacity((holder, 0)) == 32


def test_a_tensor_split_with_a_riding_sum_learns_each_time_one_cycle_late():
    target, learned = _split_in_one("llama"), []
    cache = target.make_cache()
    target.forward(mx.array([[3, 5, 7]]), cache)
    distributed.share_seconds(target, 0.25, learned.append)
    assert learned == [] and target.sharding.rider.outbox == [0.25]
    target.forward(mx.array([[9]]), cache)  # the next cycle's verify carries it
    distributed.share_seconds(target, 0.75, learned.append)
    assert learned == [0.25] and target.sharding.rider.outbox == [0.75]


def test_a_model_with_no_summed_linear_has_no_ride_and_its_times_wait_for_an_all_sum():
    target = Target(tiny_target("llama", seed=1)[0])  # whole: plain Linear layers
    assert ride_slot(target.layers) is None


def _drive(sizer: BlockSizer, late: int, cycles: int = 60):
    """Widths chosen when each cycle's time reaches the sizer `late` cycles after it ran."""
    waiting, widths = [], []
    for c in range(cycles):
        width = sizer.choose(10**6)
        widths.append(width)
        waiting.append((sizer.count(width, 0), 1.0 if width == 1 else 1.3))  # a draft never right
        while len(waiting) > late:
            learn, seconds = waiting.pop(0)
            learn(seconds)
    return widths.count(2)


def test_count_then_the_time_at_once_is_update():
    a, b = BlockSizer(16), BlockSizer(16)
    for c in range(40):
        wa, wb = a.choose(10**6), b.choose(10**6)
        assert wa == wb
        accept = min(wa - 1, c % 3)
        a.update(wa, accept, 1.0 + 0.1 * wa)
        b.count(wb, accept)(1.0 + 0.1 * wb)
    assert a.times == b.times and a.hits == b.hits and a.probe_every == b.probe_every


def test_a_late_time_still_tells_a_probe_what_it_found():
    """A poor draft: width 1 wins and probes come ever more rarely. The probe's outcome is taken
    when the cycle ends, not when its time arrives (by then the next choice is no probe)."""
    at_once, late = BlockSizer(16), BlockSizer(16)
    assert _drive(at_once, late=0, cycles=200) >= 3 and _drive(late, late=1, cycles=200) >= 3
    assert at_once.probe_every == late.probe_every == at_once.max_probe_every
