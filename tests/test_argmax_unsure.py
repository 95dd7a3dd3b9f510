"""The greedy choice without log-probabilities (`kernels.argmax`): equal to mlx-lm's argmax of
log-probabilities wherever it is sure, flagged where a near-tie could part them, and every place
that accepts with it does the acceptance again the exact way where flagged."""

import mlx.core as mx
import numpy as np
import pytest

import dflash_mlx.engine.ahead as ahead_mod
from dflash_mlx import stream_generate
from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.engine.rows import BatchRequest
from dflash_mlx.kernels import argmax
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.options import GenerationOptions
from dflash_mlx.speculation.accept import GreedyAcceptor, Proposal, greedy_choice
from dflash_mlx.testing.targets import ScriptedDraft, greedy_reference, tiny_target


def _tie_row(vocab=32768, seed=0):
    """A float32 row whose argmax of log-probabilities is not its raw argmax: a logit one ulp
    below the largest, earlier in the row, rounds onto it when the logsumexp is subtracted."""
    rng = np.random.default_rng(seed)
    for _ in range(200):
        # small logits (a fine ulp) under a large logsumexp - logit (a coarse one)
        row = (rng.normal(0, 0.1, vocab) - 1.0).astype(np.float32)
        top = np.float32(rng.uniform(0.25, 0.5))
        row[3], row[7] = np.nextafter(top, np.float32(-np.inf)), top
        x = mx.array(row)[None]
        if greedy_choice(x).item() == 3:
            return x
    raise AssertionError("no tie found")


def test_a_near_tie_that_parts_the_two_argmaxes_is_flagged():
    x = _tie_row()
    choice, unsure = argmax.argmax_or_unsure(x)
    assert choice.item() == 7 and greedy_choice(x).item() == 3  # the case: raw and exact differ
    assert unsure.item()


def test_where_it_is_sure_it_equals_the_argmax_of_log_probabilities():
    mx.random.seed(0)
    for scale in (0.1, 1.0, 10.0, 1000.0):
        x = mx.random.normal((64, 49152)) * scale
        choice, unsure = argmax.argmax_or_unsure(x)
        sure = mx.logical_not(unsure)
        assert sure.sum().item() >= 60
        assert mx.all(mx.where(sure, choice == greedy_choice(x), True)).item()
    special = mx.array([[0.0, float("nan"), 1.0], [float("inf"), 0.0, 1.0], [2.0, 2.0, 1.0]])
    assert argmax.argmax_or_unsure(special)[1].tolist() == [True, True, True]


def test_the_raw_argmax_runs_only_on_large_float32_logits_on_the_cpu(monkeypatch):
    assert argmax.pays(mx.zeros((1, 49152)))  # SmolLM2's vocabulary, one row
    assert not argmax.pays(mx.zeros((1, 49152), dtype=mx.bfloat16))
    assert not argmax.pays(mx.zeros((16, 512)))  # the flag's ops would cost more than the exp
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "reference")
    assert not argmax.pays(mx.zeros((1, 49152)))


def test_a_flagged_acceptance_is_done_again_the_exact_way():
    x = _tie_row()
    logits = mx.concatenate([x, x], axis=0)[None]  # [1, 2, V]: rows for [last, d1]
    acceptor = GreedyAcceptor()
    a, committed = acceptor.accept(Proposal(mx.array([[3]], dtype=mx.int32)), logits)
    assert a.item() == 0 and acceptor.take_unsure().item()  # raw: rejects d1 = 3
    a, committed = acceptor.exact().accept(Proposal(mx.array([[3]], dtype=mx.int32)), logits)
    assert a.item() == 1 and committed.tolist() == [[3, 3]] and acceptor.take_unsure() is None


@pytest.fixture
def poisoned(monkeypatch):
    """The raw argmax made wrong everywhere and flagged everywhere: only the exact redo can give
    mlx-lm's tokens, so every acceptance that took it must have been done again."""
    calls = {"n": 0}

    def wrong(logits):
        calls["n"] += 1
        return mx.zeros(logits.shape[:-1], dtype=mx.int32), mx.ones(logits.shape[:-1], dtype=mx.bool_)

    monkeypatch.setattr(argmax, "argmax_or_unsure", wrong)
    monkeypatch.setattr(argmax, "MIN_LOGITS", 1)  # the tiny targets' small vocabularies too
    return calls


@pytest.mark.parametrize("width,split_head", [(1, False), (4, False), ("draft", True), ("auto", False)])
def test_lone_rows_redo_every_flagged_acceptance(poisoned, width, split_head, monkeypatch):
    monkeypatch.setattr(ahead_mod, "BEFORE_READING_ON_CPU", width == 1)  # the GPU's pipelined plain step too
    model, tok = tiny_target("llama", layer_types=["full_attention"] * 4, sliding_window=None)
    prompt = list(range(3, 23))
    ref = greedy_reference(model, prompt, 24)
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: (c * 5) % 9, block_size=8)
    responses = list(stream_generate(model, draft, tok, prompt, max_tokens=len(ref), block_size=width,
                                     stop_token_ids=[], split_head=split_head))
    out = [t for r in responses for t in r.tokens]
    # every cycle past the prefill's token that verified without a tree took the poisoned argmax at least
    # once (token trees take none; at `auto`, copies of this repetitive answer can cover it in three cycles)
    verified = sum(r.proposal not in ("tree", "copy_tree") for r in responses[1:])
    assert out == ref and poisoned["n"] >= verified and poisoned["n"] > (0 if width == "auto" else 3)


def test_a_batch_redoes_its_flagged_acceptance(poisoned):
    model, tok = tiny_target("llama", layer_types=["full_attention"] * 4, sliding_window=None)
    prompts = [list(range(3, 23)), list(range(40, 67))]
    refs = [greedy_reference(model, p, 16) for p in prompts]
    engine = BatchEngine(model, None, tok, max_batch=2, block_size=1)
    rows = {engine.add(BatchRequest(p, GenerationOptions(max_tokens=16), ())).uid: i for i, p in enumerate(prompts)}
    out = {i: [] for i in range(2)}
    while not engine.idle:
        for row, response in engine.step():
            out[rows[row.uid]] += response.tokens
    assert [out[0], out[1]] == refs and poisoned["n"] > 3


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5", "gemma3_text", "gemma4_text"])
def test_the_raw_argmax_keeps_mlx_lm_tokens_at_every_width(arch, monkeypatch):
    """Not poisoned: the raw argmax on the tiny targets' vocabularies too, against mlx-lm."""
    monkeypatch.setattr(argmax, "MIN_LOGITS", 1)
    model, tok = tiny_target(arch)
    prompt = list(range(5, 31))
    ref = greedy_reference(model, prompt, 20)
    for width in (1, 4, 16, "auto"):
        draft = ScriptedDraft(Target(model), prompt + ref, lambda c: (c * 7) % 11, block_size=16)
        out = [t for r in stream_generate(model, draft, tok, prompt, max_tokens=len(ref), stop_token_ids=[],
                                          block_size=width if width != 16 else "draft") for t in r.tokens]
        assert out == ref, width


def test_chains_queued_on_a_guess_redo_every_flagged_acceptance(poisoned, monkeypatch):
    """Every chain's successor queued on the guess that it is accepted whole (forced on), every raw
    argmax wrong and flagged: each redo parts the raw acceptance from the exact one, so each guess
    must be thrown away, and the tokens stay mlx-lm's."""
    from dflash_mlx.policy.lookahead import LookAhead

    monkeypatch.setattr(ahead_mod, "BEFORE_READING_ON_CPU", True)
    monkeypatch.setattr(LookAhead, "pays", lambda self, width: True)
    model, tok = tiny_target("llama", layer_types=["full_attention"] * 4, sliding_window=None)
    prompt = list(range(3, 23))
    ref = greedy_reference(model, prompt, 24)
    for wrong_from in (lambda c: (c * 5) % 9, lambda c: 10**9):
        draft = ScriptedDraft(Target(model), prompt + ref + [0] * 16, wrong_from, block_size=4)
        out = [t for r in stream_generate(model, draft, tok, prompt, max_tokens=len(ref), block_size=4,
                                          stop_token_ids=[]) for t in r.tokens]
        assert out == ref
