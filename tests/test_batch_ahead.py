"""Batched cycles launched ahead (`BatchEngine._ahead`): the next cycle is queued before a step's
responses are built, lands on the next step, and is rolled back whole where rows join or leave
first. Every row's answer stays the target's own greedy answer."""

import random
from unittest import mock

import dflash_mlx  # noqa: F401,I001  (before mlx.core: BLAS routing)
import pytest

from dflash_mlx.engine import engine as engine_module
from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.engine.rows import BatchRequest
from dflash_mlx.engine.timing import PhaseTimer
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.options import GenerationOptions
from dflash_mlx.policy.sizer import forget_sizers
from dflash_mlx.testing.archs import build
from dflash_mlx.testing.serving import serve
from dflash_mlx.testing.targets import RowScriptedDrafts, byte_tokenizer, clean_case, tiny_target


def request(prompt, max_tokens):
    return BatchRequest(prompt, GenerationOptions(max_tokens=max_tokens))


def model_of(arch):
    return tiny_target(arch, seed=1)[0] if arch in ("qwen3", "qwen3_5") else build(arch)


def cases(model, n):
    """Prompts and answers of different lengths, long enough for rows to overlap."""
    return [clean_case(model, 6 + 7 * i, 30 + 6 * i, seed=50 + i) for i in range(n)]


def counted(arch, cs, block_size, join_every, cancel=None, max_batch=3):
    """Serve `cs` (prompt, reference) through a batch engine; (tokens, landed ahead, discarded)."""
    forget_sizers()
    model = model_of(arch)
    rng = random.Random(len(cs))
    draft = RowScriptedDrafts(Target(model), cs, lambda c: rng.randrange(0, 7), block_size=8)
    engine = BatchEngine(model, draft, byte_tokenizer(), max_batch=max_batch, prefill_chunk=8,
                         block_size=block_size)
    landed, discarded = [], []
    land, discard = engine_module.land_batch, engine_module.discard_batch  # (as patched, if so)

    def land_counted(launched, *args):
        landed.append(launched.landing is not None)
        return land(launched, *args)

    def discard_counted(launched, *args):
        discarded.append(launched.width)
        return discard(launched, *args)

    with mock.patch.object(engine_module, "land_batch", land_counted), \
            mock.patch.object(engine_module, "discard_batch", discard_counted):
        tokens, _, _ = serve(engine, [request(p, len(ref)) for p, ref in cs], join_every, cancel)
    return tokens, landed, discarded


@pytest.mark.parametrize("arch,block_size", [("qwen3", 8), ("qwen3", "auto"), ("deepseek_v3", 8), ("gpt_oss", 4),
                                                    ("gemma2", 4)])
def test_cycles_launched_ahead_land_or_roll_back_exactly(arch, block_size):
    """Attention KV and sliding windows past their size: rows join every few steps (each join and
    each leaving row rolls the cycle launched ahead back whole); every row is its own greedy answer."""
    model = model_of(arch)
    cs = cases(model, 5)
    tokens, landed, discarded = counted(arch, cs, block_size, join_every=2)
    assert [tokens[i] for i in range(len(cs))] == [ref for _, ref in cs]
    assert sum(landed) > len(landed) // 2  # most batched cycles were launched a step ahead
    assert discarded  # and some were rolled back as rows joined and left


def test_a_row_cancelled_while_a_cycle_is_launched_ahead_leaves_the_others_exact():
    model = model_of("qwen3")
    cs = [clean_case(model, 5 + 9 * i, 20, seed=60 + i) for i in range(3)]
    tokens, landed, discarded = counted("qwen3", cs, 4, join_every=1, cancel={1: 4})
    assert tokens[0] == cs[0][1] and tokens[2] == cs[2][1]
    assert tokens[1] == cs[1][1][: len(tokens[1])] and len(tokens[1]) < len(cs[1][1])
    assert any(landed) and discarded


def test_a_cycle_launched_ahead_and_kept_through_a_join_would_part_from_the_target():
    """The negative control: the rollback of a discard left out, the rows' caches keep a cycle's
    rows nobody accepted, and the answers part from the target's (on this model; the tiny Qwen3's
    greedy answers happen to survive it)."""
    model = model_of("deepseek_v3")
    cs = cases(model, 5)
    with mock.patch.object(engine_module, "discard_batch", lambda *args: None):
        tokens, _, _ = counted("deepseek_v3", cs, 8, join_every=2)
    assert [tokens[i] for i in range(len(cs))] != [ref for _, ref in cs]


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2"])
def test_nothing_is_launched_ahead_on_recurrent_state_or_while_profiling(arch):
    """A recurrent state cannot give a whole cycle's rows back (no batched cycle launched ahead);
    nor is one while the phases are timed (each phase syncs)."""
    forget_sizers()
    for model, timer in [(model_of(arch), None), (model_of("qwen3"), PhaseTimer())]:
        cs = [clean_case(model, 6 + 5 * i, 12, seed=70 + i) for i in range(2)]
        draft = RowScriptedDrafts(Target(model), cs, lambda c: 2, block_size=4)
        engine = BatchEngine(model, draft, byte_tokenizer(), max_batch=2, prefill_chunk=8, block_size=4)
        if timer is not None:
            engine.timer = timer
        for i, (p, ref) in enumerate(cs):
            draft.register(engine.add(request(p, len(ref))).state, p)
        seen = []
        while not engine.idle:
            engine.step()
            seen.append(engine.ahead)
        assert engine.batched is False and not any(seen)
