"""Batched cycles launched ahead (`BatchEngine._ahead`): the next cycle is queued before a step's
responses are built, lands on the next step, and is rolled back whole where rows join or leave
first. Every row's answer stays the target's own greedy answer."""

import random
from unittest import mock

import dflash_mlx  # noqa: F401,I001  (before mlx.core: BLAS routing)
import mlx.core as mx
import pytest

from dflash_mlx.engine import batch_ahead, engine as engine_module
from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.engine.rows import BatchRequest
from dflash_mlx.engine.timing import PhaseTimer
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.options import GenerationOptions
from dflash_mlx.policy.sizer import forget_sizers
from dflash_mlx.testing.archs import build
from dflash_mlx.testing.serving import serve
from dflash_mlx.testing.targets import RowScriptedDrafts, byte_tokenizer, clean_case, tiny_target
from test_batch import Schedule


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
    land, discard = engine_module.land_batch, batch_ahead.discard_batch  # (as patched, if so)

    def land_counted(launched, *args):
        landed.append(launched.landing is not None)
        return land(launched, *args)

    def discard_counted(launched, *args):
        discarded.append(launched.width)
        return discard(launched, *args)

    with mock.patch.object(engine_module, "land_batch", land_counted), \
            mock.patch.object(batch_ahead, "discard_batch", discard_counted):
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
    with mock.patch.object(batch_ahead, "discard_batch", lambda *args: None):
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


@pytest.fixture
def queued_first(monkeypatch):
    """Plain batched steps queued before their read wherever allowed (the look-ahead's rule forced),
    and how many were queued, and discarded."""
    from dflash_mlx.engine import ahead
    from dflash_mlx.policy.lookahead import LookAhead

    monkeypatch.setattr(ahead, "BEFORE_READING_ON_CPU", True)
    monkeypatch.setattr(LookAhead, "pays", lambda self, width: True)
    counts = {"queued": 0, "discarded": 0}
    queue, discard = batch_ahead.queue_behind, batch_ahead.discard_batch

    def queue_counted(*args):
        counts["queued"] += 1
        return queue(*args)

    def discard_counted(launched, *args):
        counts["discarded"] += launched.width == 1
        return discard(launched, *args)

    monkeypatch.setattr(batch_ahead, "queue_behind", queue_counted)
    monkeypatch.setattr(batch_ahead, "discard_batch", discard_counted)
    return counts


def plain_batch(model, cs, copies=False, stops=(), join_every=2, max_batch=3, poisoned=False):
    engine = BatchEngine(model, None, byte_tokenizer(), max_batch=max_batch, prefill_chunk=8,
                         block_size="auto" if copies else 1, copy_proposals=copies)
    reqs = [BatchRequest(p, GenerationOptions(max_tokens=len(ref)), stop_token_ids=list(stops)) for p, ref in cs]
    tokens, responses, _ = serve(engine, reqs, join_every)
    return engine, tokens, responses


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3", "phi3"])
def test_plain_steps_queued_before_their_read_are_the_targets_own(queued_first, arch):
    """Without a draft, at width 1: each batched step's successor queued before the step is read (its
    tokens lazy), rows joining and leaving, one row ending on a stop token: every row is the target's."""
    forget_sizers()
    model = model_of(arch)
    cs = cases(model, 5)
    stop = cs[2][1][11]
    engine, tokens, responses = plain_batch(model, cs, stops=[stop])
    for i, (p, ref) in enumerate(cs):
        want = ref[: ref.index(stop) + 1] if stop in ref else ref
        assert tokens[i] == want, i
    assert queued_first["queued"] > 3 * queued_first["discarded"] > 0  # most kept; a join or a stop drops one
    assert engine.lookahead.kept_rate(1) > 0.5  # it learnt that the guess holds (no copies here)
    ahead = engine.stats()["batched_ahead"]  # (what /health shows)
    assert ahead["queued before a read"] == queued_first["queued"] and ahead["discarded"] > 0


@pytest.fixture
def copies_by_the_plan(monkeypatch):
    """Copies decided by the plan's count, not by measured cycle times (which move with the machine's
    load): every third batched plan copies each row's match as far as its continuation and the budget
    allow, the others are plain steps (a lone row never copies)."""
    from dflash_mlx.policy.copies import BatchCopyPolicy, CopyPolicy
    from dflash_mlx.policy.copy_trees import CopyTreePolicy

    plans = {"n": 0}

    def batch_plan(self, matches, budgets, width, chain_tokens):
        plans["n"] += 1
        copied = [min(self.max_length, len(m.continuation), b - 1) if m is not None and plans["n"] % 3 == 0 else 0
                  for m, b in zip(matches, budgets)]
        return (max(copied) + 1, copied) if any(copied) else (width, copied)

    monkeypatch.setattr(BatchCopyPolicy, "plan", batch_plan)
    monkeypatch.setattr(CopyPolicy, "choose", lambda self, match, remaining, draft_width: 0)
    monkeypatch.setattr(CopyTreePolicy, "plan", lambda self, *args: None)


def test_a_copy_in_sight_drops_the_plain_step_queued_before_it(queued_first, copies_by_the_plan):
    """No draft, copies on, answers that repeat: where the plan made once a step is read is a copy, the
    plain step queued behind it goes and the copy runs; every row is the target's."""
    forget_sizers()
    model = model_of("qwen3")
    cs = [clean_case(model, 6 + 7 * i, 40, seed=80 + i) for i in range(3)]
    repeat = [(p + ref[:20] + p, None) for p, ref in cs]  # prompts that hold their own continuations
    from dflash_mlx.testing.targets import greedy_reference
    repeat = [(p, greedy_reference(model, p, 40)) for p, _ in repeat]
    dropped = []  # a plain step queued behind the step read, and the plan made once it was read
    after_reading = batch_ahead.after_reading

    def after_reading_seen(engine, *args):
        queued = engine.ahead if isinstance(engine.ahead, batch_ahead.BatchLaunched) else None
        chosen = after_reading(engine, *args)
        if queued is not None and chosen is not None and any(chosen.copied):
            dropped.append(engine.ahead is None and queued.width == 1)
        return chosen

    with mock.patch.object(batch_ahead, "after_reading", after_reading_seen):
        engine, tokens, responses = plain_batch(model, repeat, copies=True, join_every=1)
    assert [tokens[i] for i in range(3)] == [ref for _, ref in repeat]
    assert any(r.proposal == "copy" for rs in responses.values() for r in rs)
    assert queued_first["queued"] and dropped and all(dropped)  # each copy in sight dropped the queued step


@pytest.fixture
def poisoned(monkeypatch):
    """Every raw argmax wrong and flagged (as `test_argmax_unsure.poisoned`): only the exact redo gives
    the target's tokens, so every plain step queued behind a raw one must go."""
    from dflash_mlx.kernels import argmax

    calls = {"n": 0}

    def wrong(logits):
        calls["n"] += 1
        return mx.zeros(logits.shape[:-1], dtype=mx.int32), mx.ones(logits.shape[:-1], dtype=mx.bool_)

    monkeypatch.setattr(argmax, "argmax_or_unsure", wrong)
    monkeypatch.setattr(argmax, "MIN_LOGITS", 1)
    return calls


@pytest.mark.parametrize("keep_redone", [False, True])
def test_a_plain_step_queued_behind_a_redone_acceptance_goes(queued_first, poisoned, keep_redone, monkeypatch):
    """Every acceptance done again the exact way: the step queued behind it took the raw token and is
    discarded, and the rows stay the target's. The control: kept anyway, the rows part from it."""
    forget_sizers()
    model = model_of("qwen3")
    cs = cases(model, 3)
    if keep_redone:
        land = engine_module.land_batch

        def land_forgetting(launched, *args):
            out = land(launched, *args)
            launched.redone = False
            return out
        monkeypatch.setattr(engine_module, "land_batch", land_forgetting)
    _, tokens, _ = plain_batch(model, cs)
    exact = [tokens[i] for i in range(len(cs))] == [ref for _, ref in cs]
    assert exact != keep_redone and poisoned["n"] > 10 and queued_first["queued"] > 5
    if not keep_redone:
        assert queued_first["discarded"] >= queued_first["queued"] - 1  # (the last may land: all rows ended)


def test_the_engines_look_ahead_learns_when_queuing_plain_steps_first_pays(monkeypatch):
    """Not forced: with G and D fixed (a guess pays from P > 1/2), the batch's own `LookAhead` starts
    from "never", sees plain steps followed by plain steps, and queues them before their read; a guess
    seen never to hold is never made."""
    from dflash_mlx.engine import ahead
    from dflash_mlx.policy.lookahead import LookAhead

    observe = LookAhead.observe
    monkeypatch.setattr(ahead, "BEFORE_READING_ON_CPU", True)
    monkeypatch.setattr(LookAhead, "timed_gap", lambda self, seconds: setattr(self, "gap", 0.001))
    monkeypatch.setattr(LookAhead, "timed_cycle", lambda self, width, seconds: self.device.__setitem__(width, 0.002))
    queued = []
    queue = batch_ahead.queue_behind
    monkeypatch.setattr(batch_ahead, "queue_behind",
                        lambda engine, launched: queued.append(1) or queue(engine, launched))
    forget_sizers()
    model = model_of("deepseek_v3")
    cs = cases(model, 3)
    engine, tokens, _ = plain_batch(model, cs, join_every=1)
    assert [tokens[i] for i in range(len(cs))] == [ref for _, ref in cs]
    assert engine.lookahead.trials[1] > 10 and len(queued) > engine.lookahead.trials[1] / 2
    queued.clear()
    # the same steps, seen as if each plan after a read had been a copy: the guess never pays
    monkeypatch.setattr(LookAhead, "observe", lambda self, width, kept: observe(self, width, False))
    engine, tokens, _ = plain_batch(model, cs, join_every=1)
    assert [tokens[i] for i in range(len(cs))] == [ref for _, ref in cs]
    assert engine.lookahead.trials[1] > 10 and not queued


class Widths(Schedule):
    """`test_batch.Schedule`'s fixed cycle of widths, with a one-token step first after each discard
    (`one_next`)."""

    one_next = False

    def choose(self, remaining):
        width = super().choose(remaining)
        if self.one_next:
            self.one_next = False
            return 1
        return width


@pytest.mark.parametrize("arch", ["gpt_oss", "cohere2", "ministral3"])
def test_a_window_a_discarded_cycle_wrote_to_takes_one_token_steps_after(arch):
    """Sliding windows past their size: a wide cycle launched ahead and discarded as a row joins or
    leaves, then one-token steps. Trimmed whole, the window held one entry fewer than its size and
    mlx-lm's next one-token update raised (found by the option fuzz, seed 150463); it is put back as
    it was (`models.target.windows`)."""
    forget_sizers()
    model = model_of(arch)
    # rows past their windows, joined by rows of short prompts (a window shorter than the batch's)
    cs = [clean_case(model, n, 30, seed=90 + i) for i, n in enumerate([20, 27, 3, 5])]
    draft = RowScriptedDrafts(Target(model), cs, lambda c: c % 3, block_size=6)
    engine = BatchEngine(model, draft, byte_tokenizer(), max_batch=3, prefill_chunk=8, block_size=4)
    engine.fixed = Widths([4, 1, 1, 3, 1])
    discarded = []
    discard = batch_ahead.discard_batch

    def discard_then_one(launched, *args):
        discarded.append(launched.width)
        engine.fixed.one_next = True
        return discard(launched, *args)
    with mock.patch.object(batch_ahead, "discard_batch", discard_then_one):
        tokens, _, _ = serve(engine, [request(p, len(ref)) for p, ref in cs], join_every=3)
    assert [tokens[i] for i in range(len(cs))] == [ref for _, ref in cs]
    assert any(w > 1 for w in discarded)
