"""Penalties, logit bias and the caller's own logits processors: DFlash's output under them is
mlx-lm's `generate_step` under the same processors, token for token (greedy) and in distribution
(sampling), on every path a verify row takes (chains, head in pieces, token trees, copies, batches)."""

import random
from functools import lru_cache

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from dflash_mlx import stream_generate
from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.engine.rows import BatchRequest
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.models.target.tree_attention import TokenTree
from dflash_mlx.options import GenerationOptions
from dflash_mlx.policy.sizer import forget_sizers
from dflash_mlx.speculation import processors as processors_module
from dflash_mlx.testing.serving import serve
from dflash_mlx.testing.targets import (EOS_ID, RankedDraft, RowScriptedDrafts, ScriptedDraft, byte_tokenizer,
                                        clean_case, greedy_reference, tiny_target)

PENALTIES = dict(repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.4, logit_bias={5: 3.0, 7: -2.0})


def mlx_lm_processors(repetition_penalty=None, presence_penalty=None, frequency_penalty=None, logit_bias=None,
                      repetition_context_size=20, presence_context_size=20, frequency_context_size=20):
    return make_logits_processors(logit_bias, repetition_penalty, repetition_context_size, presence_penalty,
                                  presence_context_size, frequency_penalty, frequency_context_size)


@lru_cache(maxsize=None)
def model_for(arch):
    if arch == "llama_global":  # no sliding window: plain steps are queued before the last is read
        return tiny_target("llama", seed=1, layer_types=None, sliding_window=None)
    return tiny_target(arch, seed=1)


def case(arch, length=30, max_tokens=40, seed=3, **penalties):
    """(model, tokenizer, prompt, mlx-lm's greedy answer under `penalties`, its answer without them)."""
    model, tok = model_for(arch)
    prompt, plain = clean_case(model, length, max_tokens, seed=seed)
    ref = greedy_reference(model, prompt, max_tokens, stop_ids=[EOS_ID],
                           logits_processors=mlx_lm_processors(**penalties))
    return model, tok, prompt, ref, plain


def run(model, draft, tok, prompt, **kw):
    tokens, responses = [], []
    for r in stream_generate(model, draft, tok, prompt, stop_token_ids=[], **kw):
        tokens += r.tokens
        responses.append(r)
    return tokens, responses


@pytest.mark.parametrize("arch", ["llama", "llama_global", "gemma3_text", "qwen3_5"])
@pytest.mark.parametrize("block_size", [1, 4, 16, "auto"])
def test_greedy_under_penalties_is_mlx_lms(arch, block_size):
    """A draft right for a random number of tokens a cycle: every accept length, every row's history."""
    forget_sizers()
    model, tok, prompt, ref, plain = case(arch, **PENALTIES)
    assert ref != plain  # the penalties change the answer
    wrong = [random.Random(arch).randrange(0, 17) for _ in range(200)]
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: wrong[c], block_size=16)
    tokens, responses = run(model, draft, tok, prompt, max_tokens=len(ref), block_size=block_size, **PENALTIES)
    assert tokens == ref
    if block_size != 1:
        assert max(responses[-1].accept_lengths) >= 3


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=1.5, repetition_context_size=3),
                                     dict(presence_penalty=5.0), dict(frequency_penalty=-1.5),
                                     dict(logit_bias={9: 4.0})])
def test_each_penalty_alone(penalty):
    forget_sizers()
    model, tok, prompt, ref, plain = case("llama", seed=8, **penalty)
    assert ref != plain
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: c % 9, block_size=8)
    assert run(model, draft, tok, prompt, max_tokens=len(ref), block_size=8, **penalty)[0] == ref


def test_head_in_pieces():
    """The verify's LM head in two pieces (the second starts at a row after the first's drafts)."""
    forget_sizers()
    model, tok, prompt, ref, _ = case("llama", seed=5, **PENALTIES)
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: [15, 2, 9, 15, 0][c % 5], block_size=16)
    tokens, responses = run(model, draft, tok, prompt, max_tokens=len(ref), block_size=16, split_head=True,
                            **PENALTIES)
    assert tokens == ref
    assert max(responses[-1].accept_lengths) >= 8  # rows of the second piece were accepted


def test_token_trees():
    """Each node processed after its own path: trees that commit past a runner-up stay exact."""
    forget_sizers()
    model, tok, prompt, ref, _ = case("qwen3", length=40, max_tokens=30, seed=11, **PENALTIES)
    draft = RankedDraft(Target(model), prompt + ref, lambda c, i: (c + 2 * i) % 5 if i < 6 else 0, block_size=8)
    tokens, responses = run(model, draft, tok, prompt, max_tokens=len(ref), copy_proposals=False, **PENALTIES)
    assert tokens == ref
    assert any(r.proposal == "tree" and r.accept_length > 0 for r in responses)


def test_copies(always_copy):
    """Copies of the context (which a repetition penalty makes the target leave sooner)."""
    forget_sizers()
    model, tok = model_for("llama")
    prompt = list(range(40, 60)) * 3
    penalties = dict(repetition_penalty=1.2, repetition_context_size=8)
    ref = greedy_reference(model, prompt, 30, logits_processors=mlx_lm_processors(**penalties))
    tokens, responses = run(model, None, tok, prompt, max_tokens=30, **penalties)
    assert tokens == ref
    assert "copy" in responses[-1].proposal_counts


def test_batch_rows_each_under_their_own():
    """Rows with other penalties (one with none) in one batched verify, each its own mlx-lm answer."""
    forget_sizers()
    model, _ = model_for("qwen3")
    settings = [{}, PENALTIES, dict(repetition_penalty=1.3, logit_bias={3: 2.0}), dict(frequency_penalty=0.9)]
    prompts = [clean_case(model, 6 + 11 * i, 20, seed=i)[0] for i in range(len(settings))]
    refs = [greedy_reference(model, p, 20, logits_processors=mlx_lm_processors(**s)) for p, s in zip(prompts, settings)]
    draft = RowScriptedDrafts(Target(model), list(zip(prompts, refs)), lambda c: (c * 3) % 7, block_size=6)
    engine = BatchEngine(model, draft, byte_tokenizer(), max_batch=4, prefill_chunk=8, block_size=6)
    requests = [BatchRequest(p, GenerationOptions(max_tokens=20, **s)) for p, s in zip(prompts, settings)]
    tokens, responses, _ = serve(engine, requests, 1, None)
    assert [tokens[i] for i in range(len(settings))] == refs
    assert len({len(r.tokens) for rs in responses.values() for r in rs}) > 2  # rows accepted other lengths


def test_batched_plain_steps_queued_before_their_read(monkeypatch):
    """Without a draft, at width 1, each batched step queued before the one before it is read: the
    rows' histories end with tokens not read yet (lazy), and every row is still its own mlx-lm answer."""
    from dflash_mlx.engine import ahead
    from dflash_mlx.policy.lookahead import LookAhead

    monkeypatch.setattr(ahead, "BEFORE_READING_ON_CPU", True)
    monkeypatch.setattr(LookAhead, "pays", lambda self, width: True)
    forget_sizers()
    model, _ = model_for("qwen3")
    settings = [PENALTIES, {}, dict(repetition_penalty=2.0, repetition_context_size=4, frequency_penalty=1.0)]
    prompts = [clean_case(model, 5 + 7 * i, 16, seed=20 + i)[0] for i in range(len(settings))]
    refs = [greedy_reference(model, p, 16, logits_processors=mlx_lm_processors(**s)) for p, s in zip(prompts, settings)]
    engine = BatchEngine(model, None, byte_tokenizer(), max_batch=3, prefill_chunk=8, block_size=1,
                         copy_proposals=False)
    requests = [BatchRequest(p, GenerationOptions(max_tokens=16, **s)) for p, s in zip(prompts, settings)]
    tokens, _, _ = serve(engine, requests, 1, None)
    assert [tokens[i] for i in range(len(settings))] == refs
    assert engine.stats()["batched_ahead"]["queued before a read"] > 5


def test_logprobs_are_mlx_lms_processed_ones():
    """mlx-lm's `generate_step` hands out the processed log-probabilities: so does each response."""
    forget_sizers()
    model, tok, prompt, ref, _ = case("llama", max_tokens=12, **PENALTIES)
    want = [lp for _, lp in generate_step(mx.array(prompt), model, max_tokens=12, sampler=lambda x: mx.argmax(x, -1),
                                          logits_processors=mlx_lm_processors(**PENALTIES))]
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: c % 4, block_size=8)
    _, responses = run(model, draft, tok, prompt, max_tokens=12, block_size=8, logprobs=0, **PENALTIES)
    got = [lp.logprob for r in responses for lp in r.logprobs]
    assert len(got) == len(want)
    for token, logprob, row in zip(ref, got, want):
        assert abs(logprob - row[token].item()) < 1e-4


def test_a_processor_of_the_callers_sees_mlx_lms_histories():
    """A processor of one's own, after the penalties: every history mlx-lm's steps give it, the
    engine gives it too (and a processor that bans a token is obeyed)."""
    forget_sizers()
    model, tok, prompt, _, _ = case("llama")
    seen = []

    def recorder(tokens, logits):
        seen.append(tuple(np.array(tokens).tolist()))
        return logits

    def ban_eleven(tokens, logits):
        return logits.at[:, 11].add(-1e9)

    ref = greedy_reference(model, prompt, 24, logits_processors=mlx_lm_processors(**PENALTIES) + [recorder, ban_eleven])
    # (mlx-lm's loop also runs the step after its last token: that history is not needed)
    wanted, seen[:] = {h for h in seen if len(h) < len(prompt) + len(ref)}, []
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: c % 6, block_size=8)
    tokens, _ = run(model, draft, tok, prompt, max_tokens=24, block_size=8, logits_processors=[recorder, ban_eleven],
                    **PENALTIES)
    assert tokens == ref and 11 not in tokens
    assert wanted <= set(seen)


def test_without_each_rows_own_history_it_fails(monkeypatch):
    """The greedy check is not vacuous: rows processed after the prior context alone part from mlx-lm."""
    forget_sizers()
    model, tok, prompt, ref, _ = case("llama", **PENALTIES)
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: 10**9, block_size=16)
    real = processors_module.process_chain

    def first_row_history(processors, prior, inputs, logits, start=0):
        rows = [real(processors, prior, inputs[:, :1], logits[:, r : r + 1]) for r in range(logits.shape[1])]
        return mx.concatenate(rows, axis=1)

    monkeypatch.setattr("dflash_mlx.engine.ahead.process_chain", first_row_history)
    assert run(model, draft, tok, prompt, max_tokens=len(ref), block_size=16, **PENALTIES)[0] != ref


# -- sampling ----------------------------------------------------------------------------------


def sampled_first_tokens(model, tok, penalties, n_runs=150, block_size="draft"):
    draft = random_draft(model, block_size=3 if block_size == "draft" else 4, seed=4)
    outs = []
    for seed in range(n_runs):
        forget_sizers()
        tokens, _ = run(model, draft, tok, PROMPT, max_tokens=3, seed=seed, block_size=block_size,
                        temperature=0.7, copy_proposals=False, **penalties)
        outs.append(tokens)
    return np.array(outs)


PROMPT = [1, 2, 3, 0, 2]


def exact_first_tokens(model, k, temperature, processors):
    """P(t1..tk) from the model under `processors`, each prefix's logits processed after prompt + prefix."""
    from test_sampling import ref_probs

    V = model.args.vocab_size
    joint = np.ones(())
    prefixes = [()]
    for depth in range(k):
        rows = []
        for prefix in prefixes:
            history = PROMPT + list(prefix)
            logits = model(mx.array([history]))[:, -1].astype(mx.float32)
            for p in processors:
                logits = p(mx.array(history), logits)
            rows.append(ref_probs(np.array(logits[0]), temperature))
        joint = joint[..., None] * np.array(rows).reshape(joint.shape + (V,))
        prefixes = [prefix + (t,) for prefix in prefixes for t in range(V)]
    return joint


def test_sampling_under_penalties_keeps_the_processed_distribution(monkeypatch):
    from test_sampling import chi_square, encode, tiny

    forget_sizers()
    model, tok = tiny("llama", vocab_size=4)
    penalties = dict(repetition_penalty=3.0, logit_bias={1: 1.5})
    exact = exact_first_tokens(model, 3, 0.7, mlx_lm_processors(**penalties))
    out = sampled_first_tokens(model, tok, penalties)
    _, pval = chi_square(encode(out, 4), exact)
    assert pval > 1e-3
    # the same test fails a verify whose rows skip the processors
    monkeypatch.setattr("dflash_mlx.engine.ahead.process_chain", lambda processors, prior, inputs, logits, start=0:
                        logits)
    _, pval = chi_square(encode(sampled_first_tokens(model, tok, penalties), 4), exact)
    assert pval < 1e-6


# -- bad values ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad,message", [
    (dict(repetition_penalty=-1.0), "repetition penalty must be >= 0"),
    (dict(presence_penalty=float("inf")), "presence penalty must be a number"),
    (dict(frequency_penalty="a lot"), "frequency penalty must be a number"),
    (dict(repetition_context_size=0), "repetition context size must be a whole number >= 1"),
    (dict(logit_bias={"x": 1.0}), "logit bias must map token ids"),
    (dict(logit_bias={300: 1.0}), "logit_bias names token id 300, outside"),
])
def test_bad_values_are_refused_in_one_line(bad, message):
    model, tok = model_for("llama")
    with pytest.raises(ValueError, match=message):
        run(model, None, tok, [1, 2, 3], max_tokens=4, **bad)


def test_sampling_down_token_trees_under_penalties_keeps_the_processed_distribution(monkeypatch):
    """Every drafted cycle a token tree (the policy forced), each node processed after its own path."""
    from test_sampling import chi_square, encode

    from dflash_mlx.policy import trees
    from dflash_mlx.testing.archs import build

    monkeypatch.setattr(trees.TreePolicy, "explore", lambda self, chosen, limit: max(4, min(chosen, limit)))
    model, tok = build("qwen3_moe", vocab_size=4), byte_tokenizer()
    penalties = dict(repetition_penalty=3.0, logit_bias={3: 2.0})
    exact = exact_first_tokens(model, 3, 0.7, mlx_lm_processors(**penalties))
    assert exact.max() < 0.5
    _, pval = chi_square(encode(sampled_first_tokens(model, tok, penalties, 300, "auto"), 4), exact)
    assert pval > 1e-3
    # the same test fails trees whose nodes skip the processors
    monkeypatch.setattr("dflash_mlx.speculation.tree_verify.process_tree", lambda processors, prior, tree, logits:
                        logits)
    _, pval = chi_square(encode(sampled_first_tokens(model, tok, penalties, 300, "auto"), 4), exact)
    assert pval < 1e-6


# -- many rows at once -------------------------------------------------------------------------


def mlx_lm_rows(processors, histories, logits):
    """mlx-lm's way: each row alone, each processor on (its whole history, its logits [1, V])."""
    out = []
    for history, row in zip(histories, logits):
        row = row[None]
        for p in processors:
            row = p(mx.array(history, dtype=mx.int32), row) if history else row
        out.append(row)
    return mx.concatenate(out)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("prior_length", [0, 3, 19, 20, 21, 300])
def test_penalties_on_a_chain_are_bit_for_bit_mlx_lms_row_by_row(prior_length, dtype):
    """Every penalty and a logit bias, context sizes below and past the history, many repeated tokens:
    `process_chain` over 12 rows at once equals mlx-lm's processors called row by row, to the bit."""
    rng = np.random.default_rng(prior_length)
    opts = GenerationOptions(repetition_penalty=1.3, repetition_context_size=20, presence_penalty=0.7,
                             presence_context_size=5, frequency_penalty=0.4, frequency_context_size=33,
                             logit_bias={3: -2.5, 40: 1.5})
    ours, theirs = processors_module.option_processors(opts), opts.processors()
    assert [p.kind for p in ours] == ["bias", "repetition", "presence", "frequency"] and len(theirs) == 4
    prior = [int(t) for t in rng.integers(0, 12, prior_length)]  # (few distinct tokens: many repeats)
    fed = mx.array(rng.integers(0, 12, (1, 12)), dtype=mx.int32)
    logits = mx.array(rng.standard_normal((1, 12, 64)) * 3).astype(dtype)
    for start in (0, 5):
        rows = logits[:, start:]
        got = processors_module.process_chain(ours, prior, fed, rows, start)
        histories = [prior + fed[0, : r + 1].tolist() for r in range(start, 12)]
        want = mlx_lm_rows(theirs, histories, rows[0])
        assert got.dtype == dtype and mx.array_equal(got[0], want).item()
    assert not mx.array_equal(got[0], rows[0]).item()  # (the processors did something)


def test_penalties_on_a_tree_and_a_callers_processor_between_them():
    """A token tree's nodes (each after its path) and a caller's processor between two penalties: the
    penalties take the rows at once, the caller's is called row by row with each row's whole history."""
    rng = np.random.default_rng(7)
    opts = GenerationOptions(repetition_penalty=0.8, frequency_penalty=-0.3, frequency_context_size=4)
    rep, freq = processors_module.option_processors(opts)
    seen = []

    def callers(tokens, logits):
        seen.append(tokens.tolist())
        return logits * 1.5 + mx.array(np.arange(logits.shape[-1]) % 3, dtype=logits.dtype)

    tree = TokenTree(tokens=[5, 6, 5, 7, 6, 5], parents=[-1, 0, 0, 1, 3, 2], depths=[0, 1, 1, 2, 3, 2])
    prior = [5, 9, 9, 6]
    logits = mx.array(rng.standard_normal((6, 32)).astype(np.float32))
    got = processors_module.process_tree([rep, callers, freq], prior, tree, logits)
    paths = [[5], [5, 6], [5, 5], [5, 6, 7], [5, 6, 7, 6], [5, 5, 5]]
    histories = [prior + path for path in paths]
    assert seen == histories
    want = mlx_lm_rows([rep.own, callers, freq.own], histories, logits)
    assert mx.array_equal(got, want).item()


def test_a_first_token_after_the_prompt_alone():
    opts = GenerationOptions(presence_penalty=2.0, presence_context_size=3, logit_bias={0: 4.0})
    logits = mx.array(np.linspace(-1, 1, 16, dtype=np.float32))[None]
    got = processors_module.process_first(processors_module.option_processors(opts), [1, 2, 2, 9, 1], logits)
    assert mx.array_equal(got, mlx_lm_rows(opts.processors(), [[1, 2, 2, 9, 1]], logits)).item()


def test_a_batchs_rows_under_shared_and_own_settings_are_each_mlx_lms():
    """`process_batch`: three rows under the same penalties (processed together), one under others, one
    under a caller's processor, one under none; priors of different lengths, one of them lazy with a
    cycle's unread tokens: every row bit for bit what mlx-lm's processors give it row by row."""
    rng = np.random.default_rng(3)
    shared = GenerationOptions(repetition_penalty=1.4, presence_penalty=0.6, presence_context_size=4,
                               logit_bias={2: 3.0})
    other = GenerationOptions(frequency_penalty=0.9, frequency_context_size=50)
    double = lambda tokens, logits: logits * 2  # noqa: E731  (a caller's own)
    settings = [shared, shared, other, None, shared, "caller"]
    procs = [processors_module.option_processors(s) if isinstance(s, GenerationOptions) else
             [double] if s == "caller" else [] for s in settings]
    priors = [[int(t) for t in rng.integers(0, 10, n)] for n in (30, 2, 7, 5, 12, 9)]
    unread = mx.array([4, 4, 1], dtype=mx.int32)
    arrays = [processors_module.process_prior(p, prior, unread if b == 4 else None)
              for b, (p, prior) in enumerate(zip(procs, priors))]
    width = 5
    inputs = mx.array(rng.integers(0, 10, (6, width)), dtype=mx.int32)
    logits = mx.array(rng.standard_normal((6, width, 40)).astype(np.float32))
    got = processors_module.process_batch(procs, arrays, inputs, logits)
    for b, setting in enumerate(settings):
        theirs = (setting.processors() if isinstance(setting, GenerationOptions) else
                  [double] if setting == "caller" else [])
        head = priors[b] + ([4, 4, 1] if b == 4 else [])
        histories = [head + inputs[b, : r + 1].tolist() for r in range(width)]
        assert mx.array_equal(got[b], mlx_lm_rows(theirs, histories, logits[b])).item(), b
    assert mx.array_equal(got[3], logits[3]).item() and not mx.array_equal(got[0], logits[0]).item()


def test_a_batch_all_under_the_same_settings_is_each_rows_own():
    """Every row under the same penalties (processed as one, without a gather): each row its own."""
    rng = np.random.default_rng(5)
    opts = GenerationOptions(repetition_penalty=0.7, frequency_penalty=0.2, frequency_context_size=6)
    procs = [processors_module.option_processors(opts) for _ in range(3)]
    priors = [[int(t) for t in rng.integers(0, 8, n)] for n in (1, 9, 25)]
    inputs = mx.array(rng.integers(0, 8, (3, 4)), dtype=mx.int32)
    logits = mx.array(rng.standard_normal((3, 4, 16)).astype(np.float32))
    got = processors_module.process_batch(procs, [processors_module.process_prior(p, prior)
                                                  for p, prior in zip(procs, priors)], inputs, logits)
    for b in range(3):
        histories = [priors[b] + inputs[b, : r + 1].tolist() for r in range(4)]
        assert mx.array_equal(got[b], mlx_lm_rows(opts.processors(), histories, logits[b])).item(), b
