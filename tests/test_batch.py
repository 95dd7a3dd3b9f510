"""The batch engine: every row's answer equals the same request served alone (greedy), at batch
sizes 1-8 with requests joining and leaving mid-stream, ragged accepts and rollbacks, chunked
prefill, stops, cancels, prompt-cache reuse, logprobs; the width policy per batch size."""

import itertools
import random
from functools import lru_cache

import dflash_mlx  # noqa: F401,I001  (before mlx.core: BLAS routing)
import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from dflash_mlx import stream_generate
from dflash_mlx.policy.sizer import forget_sizers
from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.engine.rows import BatchRequest
from dflash_mlx.policy.batch_widths import BatchWidths
from dflash_mlx.engine.batch_caches import batch_support, mask_head_axis, merge_rows
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.options import GenerationOptions
from dflash_mlx.models.target.rollback import UnsupportedTargetError, replay_layer_rows, rollback_batch_rows
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import (EOS_ID, RowScriptedDrafts, ScriptedDraft, byte_tokenizer, chain_target, clean_case,
                                greedy_reference, tiny_target)
from dflash_mlx.testing.archs import build
from dflash_mlx.testing.serving import serve


@lru_cache(maxsize=None)
def target(arch="qwen3", seed=1):
    return tiny_target(arch, seed=seed)[0] if arch in ("qwen3", "qwen3_5") else build(arch)


@lru_cache(maxsize=None)
def cases(arch, n, seed=0):
    model = target(arch)
    return [clean_case(model, 5 + 9 * i, 12 + 3 * i, seed=seed + i) for i in range(n)]


def run(engine, requests, join_every=1, cancel=None):
    """Each request's tokens and responses (`testing.serving.serve`)."""
    tokens, responses, _ = serve(engine, requests, join_every, cancel)
    return tokens, responses


def request(prompt, max_tokens, **kw):
    return BatchRequest(prompt, GenerationOptions(max_tokens=max_tokens, **kw))


@pytest.mark.parametrize("max_batch", [1, 3, 8])  # alone, rows queued for a slot, all at once
@pytest.mark.parametrize("block_size", [2, 8, "auto"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_every_row_is_the_targets_own_greedy_with_ragged_accepts(max_batch, block_size, arch):
    """An attention target and a Gated DeltaNet hybrid, every batch size with rows joining
    and leaving mid-stream (prompts and answers of different lengths)."""
    forget_sizers()
    model = target(arch)
    cs = cases(arch, 8)
    rng = random.Random(max_batch)
    draft = RowScriptedDrafts(Target(model), cs, lambda c: rng.randrange(0, 9),
                              block_size=8)
    engine = BatchEngine(model, draft, byte_tokenizer(), max_batch=max_batch, prefill_chunk=16,
                         block_size=block_size)
    tokens, responses = run(engine, [request(p, len(ref)) for p, ref in cs], join_every=2)
    for i, (p, ref) in enumerate(cs):
        assert tokens[i] == ref, i
        assert responses[i][-1].finish_reason == "length"
    accepted = [a for rs in responses.values() for r in rs[1:] for a in [r.accept_length]]
    if block_size != 2:
        assert len(set(accepted)) > 2  # rows accepted different lengths in the same cycles


@pytest.mark.parametrize("arch", ["llama", "minimax", "deepseek_v3", "gemma", "phi3", "olmoe", "qwen3_5",
                                  "qwen3_5_moe"])
def test_batches_on_other_architectures(arch):
    forget_sizers()
    if arch == "llama":
        model = tiny_target("llama", seed=2, layer_types=None, sliding_window=None)[0]
    elif arch == "qwen3_5":  # a Gated DeltaNet hybrid: per-row rewinds of the recurrent state
        model = tiny_target("qwen3_5", seed=2)[0]
    else:
        model = target(arch)
    cs = [clean_case(model, 6 + 11 * i, 14, seed=i) for i in range(4)]
    draft = RowScriptedDrafts(Target(model), cs, lambda c: (c * 3) % 7, block_size=6)
    engine = BatchEngine(model, draft, byte_tokenizer(), max_batch=4, prefill_chunk=8, block_size=6)
    tokens, _ = run(engine, [request(p, len(ref)) for p, ref in cs])
    assert [tokens[i] for i in range(4)] == [ref for _, ref in cs]


class Schedule:
    """Widths in a fixed cycle: one-token cycles (a window's ring wraps in place) between
    wider verifies (which need its buffer in temporal order) and rollbacks."""

    def __init__(self, widths):
        self.widths = itertools.cycle(widths)

    def at_context(self, tokens):
        pass

    def choose(self, remaining):
        return min(next(self.widths), max(1, remaining))

    def count(self, *args, **kwargs):
        return lambda seconds: None


WINDOWED = ["gpt_oss", "gemma4_text_moe", "cohere2", "exaone4", "ministral3", "mimo_v2_flash",
            "glm_moe_dsa",  # (its caches: a CacheList of attention caches per layer)
            "gemma2"]  # (grouped query heads split before the mask: `HeadAxisMask`)
RECURRENT = ["qwen3_next", "nemotron_h", "granitemoehybrid", "lfm2", "jamba", "plamo2", "kimi_linear",
             "olmo_hybrid", "bailing_hybrid", "recurrent_gemma", "mamba2", "rwkv7",
             "falcon_h1"]  # (Mamba state beside attention in one CacheList: the mixer re-run alone)


@pytest.mark.parametrize("arch", WINDOWED + RECURRENT)
def test_sliding_windows_and_recurrent_states_batch_exactly(arch):
    """Sliding windows of 16 (rows past it, so rings wrap), lists of attention caches, and
    recurrent states re-run per row
    (Mamba, RWKV, short convs, Qwen3-Next's DeltaNet...): every row equals the target's own
    greedy output, with widths 1-5 mixed cycle by cycle and rows joining and leaving."""
    model = build(arch)
    assert batch_support(Target(model)) is None
    cs = [clean_case(model, 6 + 11 * i, 22, seed=i) for i in range(4)]  # 4 rows through 3 slots, past the windows
    draft = RowScriptedDrafts(Target(model), cs, lambda c: (c * 3) % 5, block_size=8)
    engine = BatchEngine(model, draft, byte_tokenizer(), max_batch=3, prefill_chunk=8, block_size=4)
    engine.fixed = Schedule([1, 1, 1, 4, 1, 3, 2, 1, 1, 5])
    tokens, _ = run(engine, [request(p, len(ref)) for p, ref in cs], join_every=3)
    assert [tokens[i] for i in range(len(cs))] == [ref for _, ref in cs]


@pytest.mark.parametrize("arch", ["gpt_oss", "cohere2", "gemma2"])
def test_a_row_joins_one_that_decoded_alone_past_its_window_with_rollbacks(arch):
    """A lone row verifies past its window and rolls back, which leaves its window holding one
    entry fewer than mlx-lm's `size()` counts (the rejected tail goes, and the oldest key a
    one-token step no longer needs with it); a second request then joins and the lone row's
    caches become the batch's. Until 2026-12-05 mlx-lm's merge raised there (broadcast_shapes)."""
    model = build(arch)
    cs = [clean_case(model, 20, 30, seed=0), clean_case(model, 5, 10, seed=1)]
    draft = RowScriptedDrafts(Target(model), cs, lambda c: c % 3, block_size=6)  # partial accepts
    engine = BatchEngine(model, draft, byte_tokenizer(), max_batch=2, prefill_chunk=16, block_size=6)
    tokens, _ = run(engine, [request(p, len(ref)) for p, ref in cs], join_every=6)
    assert [tokens[i] for i in range(len(cs))] == [ref for _, ref in cs]


@pytest.mark.parametrize("arch", ["mamba2", "rwkv7", "lfm2"])
def test_replay_of_batch_rows_is_each_rows_own_forward(arch):
    """Each row's recurrent state after `replay_layer_rows` equals a forward of that row's kept
    tokens alone (rows keeping 1, all, 2 and 3 of 4 verify tokens)."""
    model = build(arch)
    t = Target(model)
    prompts = [[3 + i, 40, 7 * i + 1, 9][: 2 + i % 3] for i in range(4)]
    verify = mx.array([[11 + i, 12, 13 + i, 14] for i in range(4)])
    keep = [1, 4, 2, 3]
    singles = []
    for p in prompts:
        c = t.make_cache()
        t.forward(mx.array([p]), c)
        singles.append(c)
    merged = merge_rows(singles)
    _, _, record = t.forward(verify, merged, record=True)
    recurrent = [i for i, c in enumerate(merged) if isinstance(c, ArraysCache)]
    assert recurrent and all(id(merged[i]) in record.replay for i in recurrent)
    for i in recurrent:
        replay_layer_rows(record.replay[id(merged[i])], 4, keep)
    for b, (c, k) in enumerate(zip(singles, keep)):
        t.forward(verify[b : b + 1, :k], c)
        for i in recurrent:
            for got, want in zip(merged[i].cache, c[i].cache):
                assert mx.allclose(got[b : b + 1], want, atol=1e-5).item(), (b, i)


def test_stops_cancels_and_leaving_rows_do_not_disturb_the_others():
    forget_sizers()
    model = target()
    cs = cases("qwen3", 6, seed=20)
    draft = RowScriptedDrafts(Target(model), cs, lambda c: c % 5, block_size=8)
    engine = BatchEngine(model, draft, byte_tokenizer(), max_batch=4, prefill_chunk=8, block_size=8)
    reqs = [request(p, len(ref)) for p, ref in cs]
    stop = cs[1][1][9]
    reqs[1] = BatchRequest(cs[1][0], GenerationOptions(max_tokens=len(cs[1][1])), stop_token_ids=[stop])
    tokens, responses = run(engine, reqs, cancel={3: 3})
    assert tokens[1] == greedy_reference(model, cs[1][0], len(cs[1][1]), stop_ids={stop, EOS_ID})
    assert responses[1][-1].finish_reason == "stop"
    assert tokens[3] == cs[3][1][: len(tokens[3])] and len(tokens[3]) < len(cs[3][1])  # cancelled
    for i in (0, 2, 4, 5):
        assert tokens[i] == cs[i][1], i


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss", "mamba2"])
def test_a_finished_rows_caches_serve_the_next_turns_prefix(arch):
    """Attention KV, a sliding window past its size, a recurrent state: what a row leaves in its
    `PromptCache` is a prefix the next turn does not prefill again."""
    forget_sizers()
    model = target() if arch == "qwen3" else build(arch)
    (p, ref), = cases("qwen3", 1, seed=30) if arch == "qwen3" else [clean_case(model, 12, 20, seed=30)]
    draft = RowScriptedDrafts(Target(model), [(p, ref)], lambda c: 3, block_size=8)
    engine = BatchEngine(model, draft, byte_tokenizer(), max_batch=2, prefill_chunk=8, block_size=4)
    first = engine.add(request(p, len(ref)))
    draft.register(first.state, p)
    tokens, _ = [], None
    while not engine.idle:
        for _, r in engine.step():
            tokens += r.tokens
    assert tokens == ref
    turn2 = p + ref + p[:5]
    want = greedy_reference(model, turn2, 10, stop_ids={EOS_ID})
    draft.add_case(turn2, want)
    second = BatchRequest(turn2, GenerationOptions(max_tokens=10), prompt_cache=first.state)
    out, responses = run(engine, [second])
    assert out[0] == want
    assert responses[0][0].prefill_tokens < len(turn2) - len(ref)  # the first turn's caches were reused


def test_logprobs_and_sampling_rows_beside_greedy_rows():
    forget_sizers()
    model = target()
    cs = cases("qwen3", 3, seed=40)
    draft = random_draft(model, num_layers=1, block_size=4, seed=0)
    engine = BatchEngine(model, draft, byte_tokenizer(), max_batch=3, block_size=4)
    reqs = [BatchRequest(cs[0][0], GenerationOptions(max_tokens=len(cs[0][1])), logprobs=2),
            request(cs[1][0], 20, temperature=0.9, top_k=5),
            request(cs[2][0], len(cs[2][1]), temperature=0.7, top_k=1)]  # top-k 1: greedy
    tokens, responses = run(engine, reqs)
    assert tokens[0] == cs[0][1] and tokens[2] == cs[2][1]
    assert len(tokens[1]) == 20
    alone = [lp for r in stream_generate(model, None, byte_tokenizer(), cs[0][0], max_tokens=len(cs[0][1]),
                                          logprobs=2) for lp in r.logprobs]
    batched = [lp for r in responses[0] for lp in r.logprobs]
    assert [x.token for x in batched] == [x.token for x in alone]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(batched, alone)) < 1e-4


def test_rollback_of_batch_rows_is_each_rows_own_trim():
    singles = [KVCache() for _ in range(3)]
    lengths = [6, 8, 3]
    for b, n in enumerate(lengths):
        k = mx.random.normal((1, 2, n, 4), key=mx.random.key(b))
        singles[b].update_and_fetch(k, k * 2)
    merged = BatchKVCache.merge(singles)
    for step in range(4):
        k = mx.random.normal((3, 2, 5, 4), key=mx.random.key(10 + step))
        merged.update_and_fetch(k, k * 2)
        rejected = [(step + b) % 5 for b in range(3)]
        for b in range(3):
            singles[b].update_and_fetch(k[b : b + 1], k[b : b + 1] * 2)
            singles[b].trim(rejected[b])
        rollback_batch_rows(merged, rejected)
        for b in range(3):
            got = merged.extract(b)
            assert got.offset == singles[b].offset == merged.offset[b].item()
            assert mx.array_equal(got.keys, singles[b].keys[..., : singles[b].offset, :]).item()
            assert mx.array_equal(got.values, singles[b].values[..., : singles[b].offset, :]).item()


def test_width_policy_is_keyed_on_rows_with_hysteresis():
    model = target()
    draft = random_draft(model, num_layers=1, block_size=8, seed=0)
    widths = BatchWidths(model, draft, hold=3)
    widths.choose(1, 100, 0)
    assert widths.key == 1
    for _ in range(2):
        widths.choose(5, 100, 0)
    assert widths.key == 1  # not yet
    widths.choose(1, 100, 0)
    widths.choose(5, 100, 0)
    assert widths.key == 1  # the count starts over
    for _ in range(3):
        widths.choose(6, 100, 0)
    assert widths.key == 8 and widths.bucket(3) == 4 and widths.bucket(9) == 16


def inline_mixer_falcon_h1():
    """Falcon-H1 whose layers run their Mamba mixer through a bound method instead of the child
    module: its state beside attention in one CacheList is no longer handed to a module of its own."""
    from mlx_lm.models.falcon_h1 import FalconH1DecoderLayer

    class InlineMixer(FalconH1DecoderLayer):
        def __call__(self, h, cache, attn_mask, mamba_mask):
            x = self.input_layernorm(h)
            h = h + self._mixer(input_states=x, cache=cache[0], mask=mamba_mask) + self.self_attn(
                x, mask=attn_mask, cache=cache[1])
            return h + self.feed_forward(self.pre_ff_layernorm(h))

    model = build("falcon_h1")
    for layer in model.layers:
        object.__setattr__(layer, "_mixer", layer.mamba.__call__)
        layer.__class__ = InlineMixer
    return model


def test_targets_that_cannot_be_batched_are_refused_naming_why():
    hybrid = inline_mixer_falcon_h1()
    assert "not handed to a module of its own" in batch_support(Target(hybrid))
    # served alone, the whole layer runs again on the kept tokens: still the target's own output
    (prompt, ref), = [clean_case(hybrid, 9, 30, seed=3)]
    draft = ScriptedDraft(Target(hybrid), prompt + ref, lambda c: (c * 3) % 5, block_size=6)
    got = [t for r in stream_generate(hybrid, draft, byte_tokenizer(), prompt, max_tokens=len(ref), block_size=6)
           for t in r.tokens]
    assert got == ref
    assert batch_support(Target(build("falcon_h1"))) is None  # the mixer re-run alone, per row
    # mlx-lm's Gemma 2 reshapes its queries for grouped heads so that a batch's per-row mask
    # no longer lines up with them: found by the check (three rows against each alone), which
    # then passes with the mask's extra axis
    gemma2 = Target(build("gemma2"))
    assert batch_support(gemma2) is None and mask_head_axis(gemma2)
    assert not mask_head_axis(Target(target()))
    assert batch_support(Target(target("qwen3_5"))) is None
    with pytest.raises(UnsupportedTargetError, match="cannot be batched"):
        BatchEngine(hybrid, random_draft(hybrid, num_layers=1, block_size=4, seed=0), byte_tokenizer())
    assert batch_support(Target(target())) is None


def test_a_lone_row_runs_the_single_sequence_cycle_before_and_after_a_batch():
    """One engine: a row decoding alone verifies copies and trees (as `stream_generate` does),
    copies but no trees while a second row shares the batch (the batch's copy policy, from what
    the lone row's copies taught it), and copies alone again once that row has left (its
    caches extracted back from the batch's); both answers are the target's own."""
    forget_sizers()
    model, tok = chain_target("Quick-brown,fx")  # greedy repeats a 14-token text
    draft = random_draft(model, num_layers=1, block_size=8, seed=0)  # all but never right: copies pay
    long = tok.encode("Quick", add_special_tokens=False)
    short = tok.encode("brown,", add_special_tokens=False)
    refs = [greedy_reference(model, long, 90), greedy_reference(model, short, 12)]
    engine = BatchEngine(model, draft, tok, max_batch=4, prefill_chunk=8)
    rows = [engine.add(request(long, 90))]
    out = {0: [], 1: []}
    phases = {0: [], 1: []}  # (batched?, proposal) per response of each row
    steps = 0
    while not engine.idle:
        if steps == 12:  # the first row has been decoding alone for a while
            rows.append(engine.add(request(short, 12)))
        for row, r in engine.step():
            i = rows.index(row)
            out[i] += r.tokens
            phases[i].append((engine.batched, r.proposal))
        steps += 1
    assert out[0] == refs[0] and out[1] == refs[1]
    together = [p for b, p in phases[0] if b]
    assert "copy" in together and "tree" not in together  # batched cycles copy, trees are the lone row's
    i_first = next(i for i, (b, _) in enumerate(phases[0]) if b)
    i_last = max(i for i, (b, _) in enumerate(phases[0]) if b)
    assert {p for _, p in phases[0][:i_first]} & {"copy", "tree"}
    assert "copy" in [p for _, p in phases[0][i_last + 1 :]]  # alone again: copies again
    assert not engine.batched and engine.cache is None


def test_a_seeded_row_alone_samples_what_stream_generate_samples():
    """At a fixed width, a row alone in the engine runs what `stream_generate` runs, so it
    draws the same randoms in the same order."""
    model = target()
    draft = random_draft(model, num_layers=1, block_size=4, seed=0)
    prompt, _ = clean_case(model, 12, 20, seed=3)

    def alone(seed):
        return [t for r in stream_generate(model, draft, byte_tokenizer(), prompt, max_tokens=20, block_size=4,
                                           temperature=3.0, seed=seed) for t in r.tokens]

    def batched(seed):
        engine = BatchEngine(model, draft, byte_tokenizer(), block_size=4)
        tokens, _ = run(engine, [request(prompt, 20, temperature=3.0, seed=seed)])
        return tokens[0]

    assert batched(5) == alone(5) != alone(6)


# -- copies in batched cycles


@pytest.fixture
def batch_always_copies(monkeypatch):
    """Every batched cycle verifies each row's copy as far as its match and budget go, at the
    width of the longest (rows without a match draft at that width)."""
    from dflash_mlx.policy.copies import BatchCopyPolicy

    def plan(self, matches, budgets, width, chain_tokens):
        usable = [min(self.max_length, len(m.continuation), b - 1) if m is not None else 0
                  for m, b in zip(matches, budgets)]
        if max(usable) < 1:
            return width, [0] * len(matches)
        return max(usable) + 1, usable

    monkeypatch.setattr(BatchCopyPolicy, "plan", plan)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "gpt_oss", "falcon_h1", "mamba2", "glm_moe_dsa"])
def test_copies_in_batched_cycles_stay_exact_on_every_cache_kind(batch_always_copies, monkeypatch, arch):
    """Rows copying in every batched cycle, each copy right for a random number of tokens (the
    index's match replaced by the row's known answer, spoilt after k tokens), rows joining and
    leaving: every row is the target's own greedy output, a stop id and budgets inside copies."""
    from dflash_mlx.speculation.copies import MAX_NGRAM, ContextIndex, CopyMatch

    forget_sizers()
    model = target(arch) if arch in ("qwen3", "qwen3_5") else build(arch)
    cs = [clean_case(model, 6 + 11 * i, 24 + 6 * i, seed=40 + i) for i in range(4)]  # 4 rows, 3 slots
    rng = random.Random(arch)

    def match(index, max_tokens):
        answer = next(p + ref for p, ref in cs if index.tokens[: len(p)] == p)
        start, k = len(index.tokens), rng.randrange(0, 9)
        continuation = [t if j < k else (t + 1) % 256
                        for j, t in enumerate((answer + [0] * max_tokens)[start : start + max_tokens])]
        return CopyMatch(MAX_NGRAM, start, continuation)

    monkeypatch.setattr(ContextIndex, "match", match)
    draft = RowScriptedDrafts(Target(model), cs, lambda c: (c * 3) % 5, block_size=16)
    engine = BatchEngine(model, draft, byte_tokenizer(), max_batch=3, prefill_chunk=8)
    reqs = [request(p, len(ref)) for p, ref in cs]
    stop = cs[2][1][17]
    reqs[2] = BatchRequest(cs[2][0], GenerationOptions(max_tokens=len(cs[2][1])), stop_token_ids=[stop])
    tokens, responses = run(engine, reqs, join_every=2)
    for i, (p, ref) in enumerate(cs):
        want = ref[: ref.index(stop) + 1] if i == 2 else ref
        assert tokens[i] == want, i
    copies = [r for rs in responses.values() for r in rs if r.proposal == "copy"]
    assert len(copies) > 10 and len({r.accept_length for r in copies}) > 3


def test_copies_in_batched_cycles_keep_the_targets_distribution(batch_always_copies):
    """At temperature > 0 each row's copy is a one-hot proposal against its own sampling: two
    rows decoding together, one copying from the first cycle on, sample their first three
    tokens from the target's exact joint distribution (chi-square, vocabulary 4)."""
    import sys
    from pathlib import Path

    import numpy as np

    sys.path.insert(0, str(Path(__file__).parent))
    from test_sampling import chi_square, encode, exact_first_tokens

    model, tok = tiny_target("llama", seed=1, vocab_size=4)
    draft = random_draft(model, block_size=4, seed=4)
    prompt = [1, 2, 3, 0, 1, 2, 3, 0, 1]  # the suffix [.., 0, 1] occurred: copies from cycle one
    other = [2, 2, 1]
    outs, kinds = [], set()
    for seed in range(150):
        forget_sizers()
        mx.random.seed(seed)
        engine = BatchEngine(model, draft, tok, max_batch=2)
        tokens, responses = run(engine, [request(other, 6, temperature=0.8),
                                         request(prompt, 3, temperature=0.8)], join_every=1)
        outs.append(tokens[1][:3])
        kinds |= {r.proposal for r in responses[1][1:]}
    assert "copy" in kinds
    exact = exact_first_tokens(model, prompt, 3, temperature=0.8)
    _, pval = chi_square(encode(np.array(outs), 4), exact)
    assert pval > 1e-3


def test_batch_copy_policy_widens_only_where_copies_pay():
    """The plan: no copies without a match or with a record of failed copies; a batch-wide
    copy width when rows' copies are right and a wider verify costs little more."""
    from dflash_mlx.policy.copies import BatchCopyPolicy
    from dflash_mlx.speculation.copies import CopyMatch, CopyRecord

    record = CopyRecord(15)
    policy = BatchCopyPolicy(record, 15)
    policy.seed({n: 0.1 + 0.005 * n for n in range(1, 65)})  # cost grows slowly with rows
    match = CopyMatch(4, 0, list(range(15)))
    draft_chain = lambda w: 1.0 + 0.1 * min(w - 1, 3)  # noqa: E731  (a poor draft)
    assert policy.plan([None, None], [50, 50], 1, draft_chain) == (1, [0, 0])
    for _ in range(30):
        record.update(4, 15, 15)  # copies of matches of 4 tokens: always right
    width, copies = policy.plan([match, None, match], [50, 50, 50], 1, draft_chain)
    assert width > 4 and copies[0] == copies[2] == width - 1 and copies[1] == 0
    assert policy.plan([match], [3], 1, draft_chain)[1][0] <= 2  # never past the budget
    for _ in range(60):
        record.update(4, 15, 0)  # now always wrong
    assert policy.plan([match, match], [50, 50], 1, draft_chain) == (1, [0, 0])
    expensive = BatchCopyPolicy(CopyRecord(15), 15)
    for _ in range(30):
        expensive.record.update(4, 15, 15)
    expensive.seed({8: 0.1})  # one point: more rows priced in proportion (copies start underrated)
    assert expensive.cost(64) == pytest.approx(0.8)


def test_a_batch_times_its_cycles_in_the_range_of_its_longest_row():
    """Every row's verify attends as far as the longest row's context (left padding), so a
    batched cycle is timed in that context's range, not the shortest row's."""
    forget_sizers()
    model = target("qwen3")
    short, long = clean_case(model, 30, 24, seed=1), clean_case(model, 600, 24, seed=2)
    draft = RowScriptedDrafts(Target(model), [short, long], lambda c: c % 4, block_size=8)
    engine = BatchEngine(model, draft, byte_tokenizer(), max_batch=2, prefill_chunk=64, block_size="auto")
    tokens, _ = run(engine, [request(p, len(ref)) for p, ref in (short, long)])
    assert [tokens[0], tokens[1]] == [short[1], long[1]]
    batched = engine.widths.sizers[2]
    assert set(batched.context.ranges) == {1} and sum(batched.samples.values()) > 0


def test_a_leaving_row_takes_its_caches_even_of_layers_never_filled_here():
    """A pipeline rank's caches include those of the layers other ranks run, never filled: a row
    leaving the batch takes empty ones of the same kind for them (mlx-lm's extract raised on them,
    measured on split Kimi-VL and Qwen2-VL batches), and its own rows of the others."""
    from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

    from dflash_mlx.engine.batch_caches import extract_row

    filled = KVCache()
    keys = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(1, 2, 3, 4)
    filled.update_and_fetch(keys, keys + 1)
    rows = [[filled, KVCache(), RotatingKVCache(max_size=8)] for _ in range(2)]
    batch = merge_rows(rows)
    assert isinstance(batch[2], BatchRotatingKVCache) and batch[1].keys is None
    own = extract_row(batch, 1)
    assert [type(c) for c in own] == [KVCache, KVCache, RotatingKVCache]
    assert own[1].keys is None and own[2].keys is None and own[2].max_size == 8
    assert own[0].offset == 3 and mx.array_equal(own[0].keys[..., :3, :], keys).item()
