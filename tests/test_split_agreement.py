"""A split target's ranks hold different layers (a pipeline's middle rank may hold attention only),
so what each finds from its own layers can differ. Every choice made from it must be the same on
every rank, and a probe forward (a collective) may run only where every rank runs it. Checked in
one process, with another rank's answer stood in for by the all_sum (three real ranks:
`benchmarks/split_variants.py --ranks 3`)."""

import pytest

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
import mlx.core as mx

from dflash_mlx.engine import batch_caches
from dflash_mlx.models.target import sharding, tree_attention
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import tiny_target


def other_rank(monkeypatch, contributions):
    """Rank 0 of two in this process: the all_sum adds the other rank's part, `contributions`' entries
    in turn (None, or past its end: the same as this rank's, as where it holds the same layers)."""
    answers = iter(contributions)

    def all_sum(x, group=None, stream=None):
        other = next(answers, None)
        return x + (x if other is None else mx.array(other, dtype=x.dtype))

    monkeypatch.setattr(sharding.mx.distributed, "all_sum", all_sum)
    monkeypatch.setattr(sharding.mx.distributed, "all_gather",
                        lambda x, group=None, stream=None: mx.concatenate([x, x]))
    monkeypatch.setattr(sharding.Sharding, "size", property(lambda self: 2))


def found_there(line: str) -> list:
    """The other rank's parts of one `agreed_reason` where it found `line` (and this rank none)."""
    return [[0, len(line.encode()) + 1], list(line.encode())]


def split_target(monkeypatch, contributions):
    """A tiny attention-only target (trees and batches supported alone) as rank 0 of two."""
    model, _ = tiny_target("qwen3")
    target = Target(model)
    target.sharding = sharding.Sharding("pipeline", mx.distributed.init())
    other_rank(monkeypatch, contributions)
    return target


@pytest.mark.parametrize("check", [tree_attention._check, batch_caches._check])
def test_a_rank_refused_elsewhere_refuses_too_with_its_line_and_runs_no_probe_forward(monkeypatch, check):
    target = split_target(monkeypatch, found_there("layer 3's cache cannot take it"))
    forwards = []
    monkeypatch.setattr(target, "forward", lambda *a, **k: forwards.append(a))
    assert check(target) == "layer 3's cache cannot take it (found by process 1 of the split)"
    assert forwards == []  # alone, its probe's collectives would meet the other rank's next forward


@pytest.mark.parametrize("check", [tree_attention._check, batch_caches._check])
def test_ranks_that_all_agree_run_the_probe(monkeypatch, check):
    assert check(split_target(monkeypatch, [])) is None


def test_a_rank_keeps_its_own_line_and_sends_it(monkeypatch):
    """Rank 0 found one (the other none): its own line; the bytes it sends are its line's."""
    sent = []
    other_rank(monkeypatch, [[0, 0], [0] * 4])
    summed = sharding.mx.distributed.all_sum
    monkeypatch.setattr(sharding.mx.distributed, "all_sum", lambda x, **k: sent.append(x.tolist()) or summed(x, **k))
    split = sharding.Sharding("tensor", mx.distributed.init())
    assert sharding.agreed_reason(split, "mine") == "mine"
    assert sent == [[5, 0], list(b"mine")]


def test_on_every_rank_is_the_local_answer_in_one_process():
    assert sharding.on_every_rank(None, [True, False]) == [True, False]
    assert sharding.agreed_reason(None, "why") == "why"
    assert sharding.agreed_reason(None, None) is None


def split_built(monkeypatch, key: str, contributions):
    """`key`'s tiny model, its Target built as rank 0 of a two-rank tensor split, so the probe of
    `check_forward` runs as a split's (the other rank's parts: `other_rank`)."""
    from dflash_mlx.models.target import adapter
    from dflash_mlx.testing import arch_check

    model = arch_check.build(key)
    other_rank(monkeypatch, contributions)
    monkeypatch.setattr(adapter, "sharding_of", lambda *a: sharding.Sharding("tensor", mx.distributed.init()))
    return Target(model)


def test_a_split_target_is_probed_as_a_whole_one_is(monkeypatch):
    """IQuest-Loop-Coder runs its layers' parts itself (split, it once went unprobed and failed
    mid-decode): its layers are read at the next one's input norm where every rank can, and where
    another rank cannot, the split is refused with the line this rank found."""
    from dflash_mlx.models.target.rollback import UnsupportedTargetError

    assert split_built(monkeypatch, "iquestloopcoder", []).tap_inputs
    # the other rank: the flags, no mixers, cannot read the inputs, no line of its own
    with pytest.raises(UnsupportedTargetError, match="never called whole"):
        split_built(monkeypatch, "iquestloopcoder", [None, None, [0], [0, 0], 0])


def test_a_split_kimi_k3_replays_its_mixers(monkeypatch):
    """Its layers pass each other their block residuals, which a replay cannot cut: a split one, too,
    must re-run its delta-attention mixers on a rollback (it replayed whole layers, and raised)."""
    assert split_built(monkeypatch, "kimi_k3", []).replay_mixers


def test_mixers_another_rank_replays_are_probed_here_too(monkeypatch):
    """A rank whose own layers need no mixer replay runs the same probe forwards as the rank whose
    layers do (the all_sums: the target's flags, the mixers, then the two agreed reasons)."""
    from dflash_mlx.models.target import probe

    steps = []
    for name in ("_reason", "_mixers_replay"):
        step = getattr(probe, name)
        monkeypatch.setattr(probe, name, lambda target, step=step, name=name: steps.append(name) or step(target))
    target = split_built(monkeypatch, "qwen3", [None, [0]])
    assert target.replay_mixers and steps == ["_reason", "_reason", "_mixers_replay"]


def test_a_rope_that_takes_one_offset_refuses_batches_before_any_probe_forward(monkeypatch):
    """A 3-rank Qwen3-Next with dynamic NTK RoPE hung: the batch probe's forward raised on the ranks
    whose layers hold that RoPE (it takes one position offset per call) and not on the rank holding
    only Gated DeltaNet layers, which went on into the probe's next collective alone. The RoPE is
    found before any probe forward, and agreed."""
    from dflash_mlx.testing import variants

    v = next(v for v in variants.variants("qwen3") if v.kind == "rope:dynamic")
    target = Target(variants.build("qwen3", v.config(), 0))
    target.sharding = sharding.Sharding("pipeline", mx.distributed.init())
    other_rank(monkeypatch, [])
    forwards = []
    monkeypatch.setattr(target, "forward", lambda *a, **k: forwards.append(a))
    reason = batch_caches._check(target)
    assert reason.startswith("its rotary embedding (DynamicNTKScalingRoPE) takes one position offset per call")
    assert forwards == []
