"""A quantized KV cache (`kv_bits`, `models/target/kv_quantization.py`): greedy DFlash is mlx-lm's greedy
decode under the same `kv_bits`, `kv_group_size` and `quantized_kv_start`, token for token, wherever the
conversion falls (before the prompt's last token, at it, inside a verify's rows, inside a prompt chunk),
with scripted, random and no drafts, copies, deterministic mode and a real model; targets and settings
mlx-lm cannot quantize are refused in one line.
"""

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.engine.rows import BatchRequest
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.models.target.kv_quantization import KVQuantization
from dflash_mlx.models.target.rollback import UnsupportedTargetError
from dflash_mlx.options import GenerationOptions
from dflash_mlx.testing.targets import EOS_ID, ScriptedDraft, decoded, greedy_reference, tiny_target

# head dimensions the group size 32 divides (the tiny configs' own are 16)
TARGETS = {
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),  # (tied, its greedy answers repeat one token)
    "llama": ("llama", dict(hidden_size=128, layer_types=["full_attention"] * 4, sliding_window=None)),
    "qwen3_5": ("qwen3_5", dict(head_dim=32)),  # Gated DeltaNet layers beside attention: only those quantized
}
GROUP = 32


def _target(name):
    arch, overrides = TARGETS[name]
    return tiny_target(arch, **overrides)


def _kv(bits, start):
    return dict(kv_bits=bits, kv_group_size=GROUP, quantized_kv_start=start)


def _case(model, length, max_tokens, seed, **kv):
    """(prompt, mlx-lm's greedy decode under `kv`) with no EOS in it (the engine would stop there)."""
    for s in range(seed, seed + 50):
        rng = random.Random(s)
        prompt = [rng.randrange(0, 256) for _ in range(length)]
        ref = greedy_reference(model, prompt, max_tokens, **kv)
        if EOS_ID not in ref:
            return prompt, ref
    raise AssertionError("no EOS-free case found")


@pytest.mark.parametrize("name", list(TARGETS))
@pytest.mark.parametrize("bits", [2, 8])
def test_greedy_is_mlx_lm_greedy_with_a_quantized_kv_cache(name, bits):
    model, tok = _target(name)
    length, max_tokens = 20, 40
    # the conversion: before the prompt's last token, after it, and inside the decode (where a verify's
    # rows would straddle it), and never (past the answer)
    for start in (0, length - 1, length, length + 7, length + 100):
        prompt, ref = _case(model, length, max_tokens, seed=bits + start, **_kv(bits, start))
        if bits == 2 and start < length + max_tokens:  # (2 bits change these answers: the cases can fail)
            assert ref != greedy_reference(model, prompt, max_tokens), (name, start)
        target = Target(model)
        rng = random.Random(start)
        right = [rng.randrange(0, 10) for _ in range(200)]
        for width in (1, 4, 16, "auto"):
            draft = ScriptedDraft(target, prompt + ref, lambda c: right[c], block_size=16)
            out, _ = decoded(model, draft, tok, prompt, max_tokens, width, **_kv(bits, start))
            assert out == ref, (name, bits, start, width)
        # no draft (copies where they pay), plain decoding, a random draft
        assert decoded(model, None, tok, prompt, max_tokens, **_kv(bits, start))[0] == ref, (name, start)
        assert decoded(model, None, tok, prompt, max_tokens, baseline=True, **_kv(bits, start))[0] == ref
        draft = random_draft(model, block_size=8, num_layers=1)
        assert decoded(model, draft, tok, prompt, max_tokens, **_kv(bits, start))[0] == ref, (name, start)


def test_the_conversion_changes_the_answer_and_is_where_mlx_lm_makes_it():
    """Guards the tests above: quantizing changes these tokens, and converting a row early or late
    (the line moved by one) gives other tokens than mlx-lm's, so agreeing means converting where it does."""
    model, tok = _target("llama")
    prompt, ref = _case(model, 20, 40, seed=1, **_kv(2, 26))
    assert ref != greedy_reference(model, prompt, 40)
    assert ref != greedy_reference(model, prompt, 40, **_kv(2, 25))
    assert ref != greedy_reference(model, prompt, 40, **_kv(2, 27))
    target = Target(model)
    draft = ScriptedDraft(target, prompt + ref, lambda c: 10**9, block_size=16)  # every block accepted
    out, _ = decoded(model, draft, tok, prompt, 40, 16, **_kv(2, 26))
    assert out == ref


def test_a_long_prompt_converts_after_mlx_lm_s_chunk():
    """mlx-lm runs a long prompt in chunks of 2048 and converts after the first chunk that reaches the
    start: rows of that chunk past the start attend in full precision. The engine runs its chunks then,
    whatever `prefill_step_size` it was given."""
    model, tok = _target("qwen3")
    length, start = 2100, 600  # mlx-lm: rows 600-2047 in full precision (in chunks of 512: from 1024 on quantized)
    prompt, ref = _case(model, length, 24, seed=2, **_kv(2, start))
    assert ref != greedy_reference(model, prompt, 24, **_kv(2, start), prefill_step_size=512)
    target = Target(model)
    draft = ScriptedDraft(target, prompt + ref, lambda c: c % 5, block_size=8)
    out, _ = decoded(model, draft, tok, prompt, 24, prefill_step_size=512, **_kv(2, start))
    assert out == ref


def test_deterministic_mode_with_a_quantized_kv_cache():
    model, tok = _target("qwen3")
    prompt, ref = _case(model, 20, 40, seed=5, **_kv(4, 27))
    target = Target(model)
    draft = ScriptedDraft(target, prompt + ref, lambda c: c % 7, block_size=8)
    out, _ = decoded(model, draft, tok, prompt, 40, 8, deterministic=True, **_kv(4, 27))
    assert out == ref


def test_copies_and_no_token_trees_with_a_quantized_kv_cache(always_copy):
    """A repeated text: copies verify it, and no cycle spends its rows on a token tree (whose verify
    moves rows within the caches: full-precision caches only)."""
    model, tok = _target("qwen3")
    rng = random.Random(9)
    text = [rng.randrange(0, 256) for _ in range(30)]
    prompt = text + text + text[:5]
    ref = greedy_reference(model, prompt, 40, **_kv(4, 70))
    draft = random_draft(model, block_size=8, num_layers=1)
    out, kinds = decoded(model, draft, tok, prompt, len(ref), **_kv(4, 70))
    assert out == ref
    assert "tree" not in kinds and "copy_tree" not in kinds


def test_the_caches_are_quantized_past_the_start():
    model, tok = _target("qwen3")
    cache = make_prompt_cache(model)
    prompt = list(range(40, 60))
    decoded(model, None, tok, prompt, 8, baseline=True, prompt_cache=cache, **_kv(4, 10_000))
    assert all(type(c) is KVCache for c in cache.target_cache)
    cache = make_prompt_cache(model)
    decoded(model, None, tok, prompt, 8, baseline=True, prompt_cache=cache, **_kv(4, 24))
    assert all(type(c) is QuantizedKVCache and c.bits == 4 and c.group_size == GROUP for c in cache.target_cache)
    assert cache.target_cache[0].offset == len(prompt) + 7


def test_refusals_name_what_is_wrong():
    model, tok = tiny_target("gemma3_text")  # sliding windows: mlx-lm cannot quantize them either
    with pytest.raises(UnsupportedTargetError, match="RotatingKVCache caches cannot be quantized"):
        decoded(model, None, tok, [1, 2, 3], 4, kv_bits=4, kv_group_size=32)
    model, tok = tiny_target("qwen3")  # head dimension 16: groups of 64 do not fit
    with pytest.raises(UnsupportedTargetError, match="cannot be quantized to 4 bits in groups of 64"):
        decoded(model, None, tok, [1, 2, 3], 4, kv_bits=4)
    with pytest.raises(ValueError, match="kv_bits takes one of"):
        decoded(model, None, tok, [1, 2, 3], 4, kv_bits=7)
    with pytest.raises(ValueError, match="kv_group_size takes one of"):
        decoded(model, None, tok, [1, 2, 3], 4, kv_bits=4, kv_group_size=48)
    with pytest.raises(ValueError, match="quantized_kv_start must be"):
        decoded(model, None, tok, [1, 2, 3], 4, kv_bits=4, quantized_kv_start=-1)
    engine = BatchEngine(model, None, tok, max_batch=2)
    with pytest.raises(UnsupportedTargetError, match="one sequence at a time"):
        engine.add(BatchRequest([1, 2, 3], GenerationOptions(max_tokens=4), kv_quantization=KVQuantization(4, 32)))


def test_the_packaged_target_with_a_quantized_kv_cache(smollm2):
    """SmolLM2-135M (float32, heads of 64) with its shipped draft at width 16 and an 8-bit cache: mlx-lm's
    greedy decode. A 16-row verify's keys differ from one-row steps' in their last bits (OpenBLAS sums 4 rows
    or more in another order), which puts some on the other side of a quantization level: with every verify
    16 rows wide this GSM8K answer parts from mlx-lm's at its 41st token. The verify rows are held to those
    that round as one-row steps do (`row_invariant_width`: 3 here), and the answer is mlx-lm's."""
    from dflash_mlx import load_draft
    from dflash_mlx.bench.suites import format_prompt, load_suite
    from dflash_mlx.engine.responses import wrap_tokenizer
    from dflash_mlx.generate import encode_prompt
    from dflash_mlx.models.target import kv_quantization
    from dflash_mlx.models.target.adapter import target_for

    model, tok = smollm2
    draft = load_draft("smollm2-135m", model)
    assert 1 <= kv_quantization.row_invariant_width(target_for(model, draft), 8, 64) < 16
    ids = encode_prompt(wrap_tokenizer(tok), format_prompt(tok, load_suite("gsm8k", 2)[1]))
    kv = dict(kv_bits=8, kv_group_size=64, quantized_kv_start=0)
    ref = greedy_reference(model, ids, 48, **kv)
    out = []
    for r in stream_generate(model, draft, tok, ids, max_tokens=len(ref), block_size=16, **kv):
        out += r.tokens
    assert out == ref
    prompt = tok.encode("The three primary colours are")  # converted inside the answer
    kv = dict(kv_bits=4, kv_group_size=64, quantized_kv_start=len(prompt) + 3)
    ref = greedy_reference(model, prompt, 24, **kv)
    out = []
    for r in stream_generate(model, draft, tok, prompt, max_tokens=len(ref), **kv):
        out += r.tokens
    assert out == ref


def test_a_prompt_cache_quantized_before_stays_exact_without_kv_bits():
    """A second call on a prompt cache the first quantized, without `kv_bits`: mlx-lm decodes on with the
    caches as they are (quantized), and so does the engine, with no token tree (whose compaction moves
    rows of full-precision caches only); a batch engine refuses that prompt cache in one line."""
    from mlx_lm.generate import generate_step

    model, tok = _target("llama")
    draft = random_draft(model, block_size=8, num_layers=1)
    prompt, _ = _case(model, 20, 8, seed=4, **_kv(2, 22))
    cache = make_prompt_cache(model, draft)
    first, _ = decoded(model, draft, tok, prompt, 8, prompt_cache=cache, **_kv(2, 22))
    assert all(type(c) is QuantizedKVCache for c in cache.target_cache)
    follow = prompt + first + [65, 66, 67]
    second, kinds = decoded(model, draft, tok, follow, 24, prompt_cache=cache)
    assert "tree" not in kinds and "copy_tree" not in kinds
    # mlx-lm: its own caches after the first call (the prompt and the answer but its last token), then the rest
    ref_cache = make_prompt_cache(model).target_cache
    ref_first = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=8, prompt_cache=ref_cache,
                                                  sampler=lambda x: mx.argmax(x, axis=-1), **_kv(2, 22))]
    assert ref_first == first
    for c in ref_cache:
        c.trim(c.offset - (len(prompt) + len(first) - 1))
    ref = [int(t) for t, _ in generate_step(mx.array(follow[len(prompt) + len(first) - 1:]), model, max_tokens=24,
                                            prompt_cache=ref_cache, sampler=lambda x: mx.argmax(x, axis=-1))]
    assert second == ref
    engine = BatchEngine(model, draft, tok, max_batch=2)
    with pytest.raises(UnsupportedTargetError, match="one sequence at a time"):
        engine.add(BatchRequest(follow, GenerationOptions(max_tokens=4), prompt_cache=cache))


def test_no_cycle_is_queued_on_a_guess_across_the_line(monkeypatch):
    """Every chain's successor queued before its read, on the guess that it is accepted whole: a guess whose
    forward would start where the caches must be quantized first is not made (a thrown-away guess would
    leave them quantized where plain decoding's are not), and the answer stays mlx-lm's."""
    from dflash_mlx.engine import ahead
    from dflash_mlx.policy.lookahead import LookAhead

    monkeypatch.setattr(LookAhead, "pays", lambda self, width: True)
    monkeypatch.setattr(ahead, "BEFORE_READING_ON_CPU", True)
    model, tok = _target("llama")
    for start in (24, 26, 45, 48):  # (26, 45, 48: a guess kept whose successor reaches the line)
        prompt, ref = _case(model, 20, 40, seed=start, **_kv(2, start))
        target = Target(model)
        rng = random.Random(start)
        right = [rng.choice([1, 2, 10**9]) for _ in range(200)]  # often whole, often not
        draft = ScriptedDraft(target, prompt + ref, lambda c: right[c], block_size=4)
        # (3 rows: the most that round as one-row steps do on this CPU, `row_invariant_width`)
        out, _ = decoded(model, draft, tok, prompt, 40, 3, **_kv(2, start))
        assert out == ref, start


def test_the_server_serves_a_quantized_kv_cache_one_request_at_a_time():
    """`dflash-mlx serve --kv-bits`: every request decodes with mlx-lm's quantized KV cache, one at a time (as
    mlx-lm's server serves `--kv-bits`), and answers mlx-lm's greedy decode under it; a target whose caches
    cannot be quantized so is refused when the server starts."""
    from dflash_mlx.serve.worker import Worker
    from test_server import serving

    model, tok = _target("llama")
    kv = _kv(2, 24)
    with serving(model, random_draft(model, block_size=8), tok, max_batch=4, kv_cache=kv) as s:
        assert s.worker.max_batch == 1 and "one request at a time" in s.worker.scheduling
        prompt = "tell me something new"
        ids = s.worker.encode_text(prompt)
        ref = greedy_reference(model, ids, 24, **kv)
        assert ref != greedy_reference(model, ids, 24) and EOS_ID not in ref
        r = s.client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0.0)
        assert r.usage.completion_tokens == 24 and r.choices[0].text == tok.decode(ref)
    model, tok = tiny_target("gemma3_text")
    with pytest.raises(UnsupportedTargetError, match="RotatingKVCache caches cannot be quantized"):
        Worker(model, None, tok, model_name="tiny", kv_cache=dict(kv_bits=4, kv_group_size=32))
