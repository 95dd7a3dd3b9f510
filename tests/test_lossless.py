"""Exactness: DFlash greedy output equals plain mlx-lm greedy decoding, token for token."""

import random
import types
from functools import lru_cache

import pytest

from dflash_mlx import stream_generate
from dflash_mlx.engine import cycle as cycle_module
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.models.target.adapter import Target
import mlx.core as mx
from dflash_mlx.testing.targets import VOCAB, ScriptedDraft, clean_case, greedy_reference, tiny_target

ARCHS = ["llama", "qwen3", "gemma3_text", "qwen3_5", "gemma4_text"]
_MODELS = {}


def model_for(arch):
    if arch not in _MODELS:
        _MODELS[arch] = tiny_target(arch, seed=1)
    return _MODELS[arch]


@lru_cache(maxsize=None)
def greedy_of(arch, prompt, max_tokens):
    """mlx-lm's greedy continuation of `prompt` (a tuple) on model_for(arch), computed once:
    test_max_tokens_inside_a_block scripts its draft from the same 40 tokens at every budget."""
    return tuple(greedy_reference(model_for(arch)[0], list(prompt), max_tokens))


def run(model, draft, tok, prompt, block_size="draft", **kw):
    """Every token and response of one engine call; at the draft's own width unless told."""
    tokens, responses = [], []
    for r in stream_generate(model, draft, tok, prompt, block_size=block_size, **kw):
        tokens += r.tokens
        responses.append(r)
    return tokens, responses


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size,prompt_len", [(1, 1), (2, 37), (4, 5), (16, 70)])
def test_random_draft_matches_greedy(arch, block_size, prompt_len):
    model, tok = model_for(arch)
    prompt, ref = clean_case(model, prompt_len, 24, seed=prompt_len)
    draft = random_draft(model, num_layers=2, block_size=16, seed=block_size)
    out, _ = run(model, draft, tok, prompt, max_tokens=24, block_size=block_size, stop_token_ids=[])
    assert out == ref


@pytest.mark.parametrize("arch", ARCHS)
def test_partial_accepts_long_prompt_past_window(arch):
    """Scripted drafts that are right for a random number of tokens, then wrong:
    every cycle rolls back a different amount, the prompt is past every sliding window."""
    model, tok = model_for(arch)
    prompt, ref = clean_case(model, 300, 60, seed=7)
    rng = random.Random(arch)
    wrong = [rng.randrange(0, 17) for _ in range(200)]
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: wrong[c], block_size=16)
    out, responses = run(model, draft, tok, prompt, max_tokens=60, stop_token_ids=[])
    assert out == ref
    # the engine accepted exactly what the script made acceptable
    assert responses[-1].accept_lengths[:-1] == draft.expected_accepts[: len(responses[-1].accept_lengths) - 1]
    assert len(set(responses[-1].accept_lengths)) > 3


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_oracle_draft_accepts_every_block(arch, block_size):
    model, tok = model_for(arch)
    max_tokens = 1 + 3 * block_size  # first token from prefill, then 3 full blocks
    prompt, ref = clean_case(model, 20, max_tokens, seed=3)
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: 10**9, block_size=block_size)
    out, responses = run(model, draft, tok, prompt, max_tokens=max_tokens, stop_token_ids=[])
    assert out == ref
    assert responses[-1].accept_lengths == [block_size - 1] * 3
    assert responses[-1].tau == block_size
    assert [r.from_draft for r in responses[1:]] == [[True] * (block_size - 1) + [False]] * 3


@pytest.mark.parametrize("arch", ARCHS)
def test_always_wrong_draft_accepts_nothing(arch):
    model, tok = model_for(arch)
    prompt, ref = clean_case(model, 9, 12, seed=4)
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: 0, block_size=8)
    out, responses = run(model, draft, tok, prompt, max_tokens=12, stop_token_ids=[])
    assert out == ref
    assert responses[-1].accept_lengths == [0] * 11
    assert responses[-1].tau == 1.0


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "gemma3_text"])
def test_stop_token_mid_block(arch):
    """A stop id inside a fully accepted block ends generation there, nothing past it."""
    model, tok = model_for(arch)
    prompt, ref = clean_case(model, 15, 40, seed=5)
    # a token that first appears at position >= 3 (inside the first 16-token block)
    for stop_pos in range(3, 40):
        if ref[stop_pos] not in ref[:stop_pos]:
            break
    else:
        pytest.skip("greedy output has no fresh token to stop on")
    stop = ref[stop_pos]
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: 10**9, block_size=16)
    out, responses = run(model, draft, tok, prompt, max_tokens=40, stop_token_ids=[stop])
    assert out == ref[: stop_pos + 1]
    assert responses[-1].finish_reason == "stop"
    assert responses[-1].token == stop
    assert responses[-1].generation_tokens == stop_pos + 1


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "gemma4_text"])
@pytest.mark.parametrize("max_tokens", [1, 2, 7, 18])
def test_max_tokens_inside_a_block(arch, max_tokens):
    model, tok = model_for(arch)
    prompt, ref = clean_case(model, 11, max_tokens, seed=6)
    draft = ScriptedDraft(Target(model), prompt + list(greedy_of(arch, tuple(prompt), 40)), lambda c: 10**9)
    out, responses = run(model, draft, tok, prompt, max_tokens=max_tokens, stop_token_ids=[])
    assert out == ref and len(out) == max_tokens
    assert responses[-1].finish_reason == "length"
    assert responses[-1].generation_tokens == max_tokens


class SelectingDraft(ScriptedDraft):
    """A scripted draft with a candidate selector (DFlash 2's `select_tokens` hook)
    that proposes the token after its argmax: the selector, not the logits, decides."""

    def select_tokens(self, draft_logits):
        return (mx.argmax(draft_logits, axis=-1).astype(mx.int32) - self.shift + VOCAB) % VOCAB


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_draft_selector_proposes_and_greedy_stays_lossless(arch):
    model, tok = model_for(arch)
    prompt, ref = clean_case(model, 12, 1 + 3 * 8, seed=10)
    # logits always wrong (argmax = reference + 1), selector undoes it: every block accepted
    right = SelectingDraft(Target(model), prompt + ref, lambda c: 0, block_size=8)
    right.shift = 1
    out, responses = run(model, right, tok, prompt, max_tokens=len(ref), stop_token_ids=[])
    assert out == ref
    assert responses[-1].accept_lengths == [7, 7, 7]
    # logits always right, selector spoils them: nothing accepted, output unchanged
    wrong = SelectingDraft(Target(model), prompt + ref, lambda c: 10**9, block_size=8)
    wrong.shift = -1
    out, responses = run(model, wrong, tok, prompt, max_tokens=len(ref), stop_token_ids=[])
    assert out == ref
    assert set(responses[-1].accept_lengths) == {0}


def test_baseline_mode_matches_greedy():
    model, tok = model_for("gemma3_text")
    prompt, ref = clean_case(model, 40, 20, seed=8)
    draft = random_draft(model)
    out, responses = run(model, draft, tok, prompt, max_tokens=20, baseline=True, stop_token_ids=[])
    assert out == ref
    assert all(len(r.tokens) == 1 for r in responses)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "gemma4_text"])
def test_auto_block_size_is_lossless_and_adapts(arch, monkeypatch):
    model, tok = model_for(arch)
    prompt, ref = clean_case(model, 30, 80, seed=9)
    # Every cycle takes the same time, whatever its width: what a tiny model's cycles cost on an
    # idle CPU, but not on a loaded one (one slow wide verify once kept the oracle narrow, at tau
    # 2.8). The policy on other costs is tested in test_adaptive.py. Copy proposals off: this is
    # about the draft's widths (copies: test_copy_proposals.py).
    clock = iter(range(10**9))
    monkeypatch.setattr(cycle_module, "time", types.SimpleNamespace(perf_counter=lambda: next(clock) * 0.01))
    wrong = ScriptedDraft(Target(model), prompt + ref, lambda c: 0, block_size=16)
    out, responses = run(model, wrong, tok, prompt, max_tokens=80, block_size="auto", stop_token_ids=[],
                         copy_proposals=False)
    assert out == ref
    assert set(responses[-1].accept_lengths) == {0}
    oracle = ScriptedDraft(Target(model), prompt + ref, lambda c: 10**9, block_size=16)
    out, responses = run(model, oracle, tok, prompt, max_tokens=80, block_size="auto", stop_token_ids=[],
                         copy_proposals=False)
    assert out == ref
    # every drafted block of the oracle accepted whole, and it goes wide
    assert all(r.accept_length == r.verify_width - 1 for r in responses[1:-1])
    assert responses[-1].tau > 4


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_split_verify_head_is_exact(arch, monkeypatch):
    """On the CPU the verify's LM head of a big vocabulary runs on its first rows, then on the
    rest only when all of their drafts are accepted (`accept_in_pieces`; split_head=True here,
    the tiny target's head is below `HeadRows.SPLIT_FROM`): scripted drafts wrong inside the
    first piece, at the seam, inside the second piece, or never."""
    model, tok = model_for(arch)
    prompt, ref = clean_case(model, 30, 90, seed=11)
    wrong = [0, 3, 2, 4, 9, 10**9, 1, 5, 15, 0, 3, 12] * 4
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: wrong[c], block_size=16)
    rows = []
    real_logits = Target.logits

    def logits(self, h):
        if h.ndim == 3:
            rows.append(h.shape[1])
        return real_logits(self, h)

    monkeypatch.setattr(Target, "logits", logits)
    out, responses = run(model, draft, tok, prompt, max_tokens=90, block_size=16, stop_token_ids=[],
                         split_head=True)
    assert out == ref
    accepts = responses[-1].accept_lengths
    assert accepts[:8] == [0, 3, 2, 4, 9, 15, 1, 5]
    # cycle 1 stops in its first piece (4 rows); cycle 2 is right up to the seam: both pieces
    assert rows[:3] == [4, 4, 13]
    assert sum(rows) < 16 * len(accepts)  # rows past a rejection were left out
    # split_head=False: one piece of all rows per cycle, the same tokens
    rows.clear()
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: wrong[c], block_size=16)
    out, responses = run(model, draft, tok, prompt, max_tokens=90, block_size=16, stop_token_ids=[],
                         split_head=False)
    assert out == ref and responses[-1].accept_lengths == accepts
    assert rows[:3] == [16, 16, 16] and len(rows) == len(accepts)  # one head call per cycle
