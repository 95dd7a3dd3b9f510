"""A pipeline's taps and rank 0's cycle times ride on the model's own hops (models/target/pipeline_carry.py),
and a split target's ranks learn rank 0's times without a collective a cycle (engine/distributed.py).

In one process: a whole model whose target believes it is a pipeline's only stage (a group of one
process: no hop, no gather) runs every swap of a carried forward; its hidden states and features
must equal the plain forward's exactly. The two-rank runs, and the count of collectives a cycle
builds, are in tests/test_distributed.py's one launch."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from dflash_mlx.engine import distributed
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.models.target.pipeline_carry import Carry, CarryRefused, _HeldLayer
from dflash_mlx.models.target.sharding import Sharding
from dflash_mlx.testing.targets import tiny_target

TAPS = [0, 1, 1]  # a layer tapped twice (small targets repeat ids)


def _one_stage(target: Target) -> Target:
    target.sharding = Sharding("pipeline", mx.distributed.init(), 0, len(target.layers))
    return target


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_a_carried_forward_equals_the_plain_forward_and_brings_the_rider(arch):
    model = tiny_target(arch, seed=1)[0]
    plain, carried = Target(model), _one_stage(Target(model))
    tokens = mx.array([[3, 5, 7, 11], [2, 4, 6, 8]])
    h0, f0, _ = plain.forward(tokens, plain.make_cache(), TAPS, record=True)
    carried.sharding.rider.outbox.extend([0.125, 3.5])
    h1, f1, _ = carried.forward(tokens, carried.make_cache(), TAPS, record=True)
    assert carried._carries
    assert mx.array_equal(h0, h1) and mx.array_equal(f0, f1) and f1.shape == (2, 4, 3 * plain.hidden_size)
    assert carried.sharding.rider.outbox == []
    assert [x.tolist() for x in carried.sharding.rider.inbox] == [[0.125, 3.5]]


def test_a_carried_forward_keeps_the_caches_the_plain_forward_keeps():
    model = tiny_target("qwen3_5", seed=1)[0]
    plain, carried = Target(model), _one_stage(Target(model))
    c0, c1 = plain.make_cache(), carried.make_cache()
    for chunk in ([[3, 5, 7]], [[9, 1]]):  # a prefill, then a step on what it cached
        h0, _, _ = plain.forward(mx.array(chunk), c0, TAPS)
        h1, _, _ = carried.forward(mx.array(chunk), c1, TAPS)
        assert mx.array_equal(h0, h1)
    s0, s1 = tree_flatten([c.state for c in c0]), tree_flatten([c.state for c in c1])
    assert len(s0) == len(s1) > len(c0) and all(x is y is None or mx.array_equal(x, y) for (_, x), (_, y) in zip(s0, s1))


def test_a_pipeline_that_hands_its_layers_two_states_is_refused_before_its_first_layer_runs():
    calls = []
    layer = _HeldLayer(lambda *a, **k: calls.append(a), Carry(1, [None], [], 0), first=True, last=False)
    with pytest.raises(CarryRefused):
        layer(mx.zeros((2, 3, 4, 8)))  # DeepSeek V4's streams [B, S, hc, H]
    with pytest.raises(CarryRefused):
        layer(mx.zeros((2, 3, 8)), blocks=object())  # Kimi K3's residual blocks
    assert calls == []


def test_a_refused_carry_gathers_the_taps_instead(monkeypatch):
    model = tiny_target("llama", seed=1)[0]
    plain, target = Target(model), _one_stage(Target(model))

    def refuse(self, x):
        raise CarryRefused

    monkeypatch.setattr(Carry, "set_aside", refuse)
    tokens = mx.array([[3, 5, 7]])
    h0, f0, _ = plain.forward(tokens, plain.make_cache(), TAPS)
    target.sharding.rider.outbox.append(0.5)
    h1, f1, _ = target.forward(tokens, target.make_cache(), TAPS)
    assert not target._carries and mx.array_equal(h0, h1) and mx.array_equal(f0, f1)
    assert target.sharding.rider.outbox == [0.5]  # nothing carried it: it waits for an all_sum


def _draft_for(target: Target):
    from dflash_mlx.models.draft.checkpoints import random_draft

    draft = random_draft(target.model, num_layers=1, block_size=4, target_layer_ids=TAPS)
    assert draft.fused_taps() is draft.fc
    return draft


@pytest.mark.parametrize("refused", [False, True])
def test_a_pipeline_sends_the_taps_share_of_the_drafts_fc_and_the_draft_takes_it_as_fused(refused, monkeypatch):
    """With the draft's fc handed in, a carried (or, refused, all_sum-gathered) forward returns
    fc(features) [B, S, H]: in one stage exactly the plain forward's features through fc, and the
    draft's `fuse` of it equals its `fuse` of the plain taps."""
    model = tiny_target("qwen3_5", seed=1)[0]
    plain, carried = Target(model), _one_stage(Target(model))
    draft = _draft_for(plain)
    if refused:
        monkeypatch.setattr(Carry, "set_aside", lambda self, x: (_ for _ in ()).throw(CarryRefused))
    tokens = mx.array([[3, 5, 7, 11], [2, 4, 6, 8]])
    h0, f0, _ = plain.forward(tokens, plain.make_cache(), TAPS, record=True)
    h1, f1, _ = carried.forward(tokens, carried.make_cache(), TAPS, record=True, fuse=draft.fused_taps())
    assert carried._carries is not refused
    assert mx.array_equal(h0, h1) and f1.shape == (2, 4, plain.hidden_size)
    assert mx.array_equal(f1, draft.fc(f0)) and mx.array_equal(draft.fuse(f1), draft.fuse(f0))


def test_fcs_share_is_carried_in_two_rows_a_token_whatever_the_taps():
    features = [None] * 5
    assert Carry(3, features, [], 0).rows == 3 * 6
    assert Carry(3, features, [0.5], 0, fuse=lambda x: x).rows == 3 * 2 + 1
    assert Carry(3, [], [0.5], 0, fuse=lambda x: x).rows == 3 + 1  # no taps: nothing to fuse


def test_a_rank_without_a_tapped_layer_passes_the_share_on_unchanged():
    carry = Carry(1, [None, None], [], 1, fuse=lambda x: 1 / 0)  # never called: nothing to add
    carry.aside = mx.arange(2 * 8, dtype=mx.float32).reshape(2, 1, 8)[:1]
    out = carry.append(mx.ones((1, 1, 8)))
    assert out.shape == (2, 1, 8) and mx.array_equal(out[1], carry.aside[0])


def test_one_tap_is_not_fused_on_the_way():
    from dflash_mlx.models.draft.checkpoints import random_draft

    model = tiny_target("llama", seed=1)[0]
    draft = random_draft(model, num_layers=1, block_size=4, target_layer_ids=[1])
    assert draft.fused_taps() is None
    features = mx.ones((1, 2, Target(model).hidden_size))  # as wide as fused: still through fc
    assert mx.array_equal(draft.fuse(features), draft.hidden_norm(draft.fc(features)))


class _Split:
    def __init__(self, kind):
        self.sharding = Sharding(kind, mx.distributed.init())


def test_a_split_whose_forwards_carry_nothing_learns_rank0s_times_every_few_cycles_in_order():
    target, learned = _Split("tensor"), []
    for i in range(distributed.EVERY - 1):
        distributed.share_seconds(target, 0.5 + i, learned.append)
    assert learned == [] and len(target.sharding.rider.outbox) == distributed.EVERY - 1
    distributed.share_seconds(target, 9.0, learned.append)  # one all_sum sends them all
    assert learned == [0.5 + i for i in range(distributed.EVERY - 1)] + [9.0]
    assert target.sharding.rider.outbox == []


def test_a_pipeline_learns_each_time_when_the_next_forward_has_carried_it():
    target, learned = _Split("pipeline"), []
    distributed.share_seconds(target, 0.25, learned.append)
    assert learned == [] and target.sharding.rider.outbox == [0.25]
    rider = target.sharding.rider  # what a carried forward does (pipeline_carry)
    rider.inbox.append(mx.array(rider.outbox))
    rider.outbox.clear()
    distributed.share_seconds(target, 0.75, learned.append)
    assert learned == [0.25] and rider.outbox == [0.75] and rider.inbox == []


def test_a_whole_target_learns_at_once():
    learned = []
    distributed.share_seconds(object(), 0.5, learned.append)
    assert learned == [0.5]
