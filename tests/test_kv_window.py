"""A bounded KV cache (`max_kv_size`, `models/target/kv_window.py`): greedy DFlash is mlx-lm's greedy decode
under the same `max_kv_size`, token for token, wherever the window fills (in the prompt, in the answer, in a
prompt chunk), with scripted, random and no drafts, copies, deterministic mode and a second turn on the same
prompt cache; what cannot be exact is refused in one line.
"""

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_cache

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.engine.rows import BatchRequest
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.models.target import kv_window
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.models.target.kv_window import StepsWindowCache
from dflash_mlx.models.target.rollback import UnsupportedTargetError
from dflash_mlx.options import GenerationOptions
from dflash_mlx.testing.targets import EOS_ID, ScriptedDraft, decoded, greedy_reference, tiny_target


def _target():
    # (untied: the tiny tied qwen3's greedy answers repeat one token, whatever the window)
    return tiny_target("qwen3", head_dim=32, tie_word_embeddings=False)


def _case(model, length, max_tokens, seed, size):
    """(prompt, mlx-lm's greedy decode on a bounded cache), with no EOS in it (the engine would stop there),
    where the bound changes mlx-lm's answer (else a verify's mask could not show)."""
    for s in range(seed, seed + 100):
        rng = random.Random(s)
        prompt = [rng.randrange(0, 256) for _ in range(length)]
        ref = greedy_reference(model, prompt, max_tokens, max_kv_size=size)
        if EOS_ID not in ref and ref != greedy_reference(model, prompt, max_tokens):
            return prompt, ref
    raise AssertionError("no case found")


@pytest.mark.parametrize("size", [6, 8, 16])
@pytest.mark.parametrize("length", [3, 20])
def test_greedy_is_mlx_lm_greedy_on_a_bounded_kv_cache(size, length):
    """The window fills in the answer (a prompt of 3) or in the prompt (20), at every width."""
    model, tok = _target()
    prompt, ref = _case(model, length, 48, seed=size + length, size=size)
    target = Target(model)
    rng = random.Random(size)
    right = [rng.randrange(0, 10) for _ in range(200)]
    for width in (1, 4, 16, "auto"):
        draft = ScriptedDraft(target, prompt + ref, lambda c: right[c], block_size=16)
        assert decoded(model, draft, tok, prompt, 48, width, max_kv_size=size)[0] == ref, (size, length, width)
    assert decoded(model, None, tok, prompt, 48, max_kv_size=size)[0] == ref
    assert decoded(model, None, tok, prompt, 48, baseline=True, max_kv_size=size)[0] == ref
    draft = random_draft(model, block_size=8, num_layers=1)
    assert decoded(model, draft, tok, prompt, 48, max_kv_size=size)[0] == ref
    draft = ScriptedDraft(target, prompt + ref, lambda c: right[c], block_size=8)
    assert decoded(model, draft, tok, prompt, 48, 8, max_kv_size=size, deterministic=True)[0] == ref


def test_mlx_lm_s_own_mask_on_a_verify_gives_other_tokens(monkeypatch):
    """Guards the test above: with mlx-lm's mask on the verify's rows (a plain sliding window over the buffer,
    which drops the kept tokens from the second row on) the answer parts from mlx-lm's plain decode; the
    probe refuses such a model, and without the probe the tokens differ."""
    model, tok = _target()
    prompt, ref = _case(model, 20, 48, seed=1, size=8)
    target = Target(model)
    draft = ScriptedDraft(target, prompt + ref, lambda c: 10**9, block_size=16)  # every block accepted
    assert decoded(model, draft, tok, prompt, 48, 16, max_kv_size=8)[0] == ref
    monkeypatch.setattr(StepsWindowCache, "make_mask", RotatingKVCache.make_mask)  # (mlx-lm's, for every forward)
    fresh, tok = _target()
    with pytest.raises(UnsupportedTargetError, match="does not take its cache's masks"):
        decoded(fresh, None, tok, prompt, 4, max_kv_size=8)
    monkeypatch.setattr(kv_window, "check", lambda target, quantized=False: None)
    draft = ScriptedDraft(Target(fresh), prompt + ref, lambda c: 10**9, block_size=16)
    assert decoded(fresh, draft, tok, prompt, 48, 16, max_kv_size=8)[0] != ref


def test_a_long_prompt_runs_in_mlx_lm_s_chunks():
    """mlx-lm runs a prompt in chunks of 2048 under its own mask, whose first rows in a chunk see the kept
    tokens and the others do not: the chunking changes its answer (here the rows just past 2048, which start
    a chunk of mlx-lm's and not one of 500), and the engine runs mlx-lm's chunks whatever `prefill_step_size`
    it was given."""
    model, tok = _target()
    length, size = 2053, 8
    for seed in range(2, 40):
        prompt, ref = _case(model, length, 24, seed=seed, size=size)
        if ref != greedy_reference(model, prompt, 24, max_kv_size=size, prefill_step_size=500):
            break
    else:
        raise AssertionError("no case whose answer depends on the chunking")
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: c % 5, block_size=8)
    assert decoded(model, draft, tok, prompt, 24, prefill_step_size=500, max_kv_size=size)[0] == ref


def test_a_second_turn_on_the_same_prompt_cache(always_copy):
    """Two calls on one prompt cache (the first closed with its cycle launched ahead), against mlx-lm's decode
    on its own cache across the two; copies of a repeated text verify through the window, no token tree."""
    model, tok = _target()
    rng = random.Random(3)
    text = [rng.randrange(0, 256) for _ in range(12)]
    prompt = text + text + text[:3]
    draft = random_draft(model, block_size=8, num_layers=1)
    cache = make_prompt_cache(model, draft, max_kv_size=16)
    first = []
    for r in stream_generate(model, draft, tok, prompt, max_tokens=40, stop_token_ids=[], prompt_cache=cache):
        first += r.tokens
        if len(first) >= 12:
            break  # (a cycle may be launched ahead: closed here, it is discarded)
    follow = prompt + first + text[:6]
    second, kinds = decoded(model, draft, tok, follow, 30, prompt_cache=cache)
    assert "tree" not in kinds and "copy_tree" not in kinds
    # mlx-lm on its own bounded cache: the first answer but its last token, then the rest
    ref_cache = mlx_lm_cache(model, max_kv_size=16)
    sampler = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    ref_first = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=len(first) - 1,
                                                  prompt_cache=ref_cache, sampler=sampler)]
    assert ref_first == first[:-1]
    ref = [int(t) for t, _ in generate_step(mx.array(follow[len(prompt) + len(first) - 1:]), model, max_tokens=30,
                                            prompt_cache=ref_cache, sampler=sampler)]
    assert second == ref
    assert ref != greedy_reference(model, follow, 30)


def test_a_model_with_caches_of_its_own_keeps_them():
    """mlx-lm's `make_prompt_cache` ignores `max_kv_size` for a model that makes its own caches (Llama, Gemma 3,
    Qwen3.5, ...): so does the engine, and the answer is mlx-lm's under the same argument."""
    model, tok = tiny_target("llama")
    assert hasattr(model, "make_cache")
    prompt = list(range(30, 50))
    ref = greedy_reference(model, prompt, 24, max_kv_size=8)
    draft = random_draft(model, block_size=8)
    cache = make_prompt_cache(model, draft, max_kv_size=8)
    assert not cache.windowed
    assert decoded(model, draft, tok, prompt, 24, max_kv_size=8, prompt_cache=cache)[0] == ref


def test_refusals_name_what_is_wrong():
    model, tok = _target()
    for bad in (4, 0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="max_kv_size must be a whole number > 4"):
            decoded(model, None, tok, [1, 2, 3], 4, max_kv_size=bad)
    with pytest.raises(UnsupportedTargetError, match="bounded KV cache cannot be quantized"):
        decoded(model, None, tok, [1, 2, 3], 4, max_kv_size=8, kv_bits=4, kv_group_size=32)
    cache = make_prompt_cache(model, max_kv_size=8)
    with pytest.raises(ValueError, match="prompt_cache was made with max_kv_size=8, not 16"):
        decoded(model, None, tok, [1, 2, 3], 4, max_kv_size=16, prompt_cache=cache)
    engine = BatchEngine(model, None, tok, max_batch=2)
    with pytest.raises(UnsupportedTargetError, match="one sequence at a time"):
        engine.add(BatchRequest([1, 2, 3], GenerationOptions(max_tokens=4), prompt_cache=cache))


def test_the_server_serves_a_bounded_kv_cache_one_request_at_a_time():
    """`dflash-mlx serve --max-kv-size`: every request decodes on mlx-lm's bounded cache, one at a time (a
    batch's windows keep no front tokens), and answers mlx-lm's greedy decode on it; a model with caches of its
    own keeps batching (the bound is ignored there, as mlx-lm ignores it); a quantized cache beside a bounded
    one is refused when the server starts."""
    from dflash_mlx.serve.worker import Worker
    from test_server import serving

    model, tok = _target()
    with serving(model, random_draft(model, block_size=8), tok, max_batch=4, kv_cache=dict(max_kv_size=8)) as s:
        assert s.worker.max_batch == 1 and "one request at a time" in s.worker.scheduling
        prompt = "tell me something new"
        ids = s.worker.encode_text(prompt)
        ref = greedy_reference(model, ids, 24, max_kv_size=8)
        assert ref != greedy_reference(model, ids, 24) and EOS_ID not in ref
        for _ in range(2):  # (the second on the cached conversation's snapshot)
            r = s.client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0.0)
            assert r.usage.completion_tokens == 24 and r.choices[0].text == tok.decode(ref)
    with pytest.raises(UnsupportedTargetError, match="bounded KV cache cannot be quantized"):
        Worker(model, None, tok, model_name="tiny", kv_cache=dict(max_kv_size=8, kv_bits=4, kv_group_size=32))
    model, tok = tiny_target("llama")
    assert Worker(model, None, tok, model_name="tiny", max_batch=4, kv_cache=dict(max_kv_size=8)).max_batch == 4


def test_the_draft_context_is_bounded_with_the_target_s():
    """Under max_kv_size the draft's context caches keep a window too (what it sees changes, no token does),
    so a long answer's memory is bounded; on a model that makes its own caches (unbounded) the draft's stay whole."""
    from dflash_mlx.models.draft.context_cache import ContextCache

    model, tok = _target()
    prompt, ref = _case(model, 20, 48, seed=7, size=8)
    draft = random_draft(model, block_size=8, num_layers=2)
    state = make_prompt_cache(model, draft, max_kv_size=8)
    assert decoded(model, draft, tok, prompt, 48, 8, prompt_cache=state)[0] == ref  # (drafting every cycle)
    held = [c.fetch()[0].shape[2] for c in state.draft_cache]
    assert all(c.offset == len(state.tokens) - (0 if state.pending is None else state.pending.shape[1])
               for c in state.draft_cache)
    assert max(held) <= 8 - 1 + ContextCache.TRIM_SLACK < len(state.tokens) - 8
    whole = make_prompt_cache(model, draft)
    assert decoded(model, draft, tok, prompt, 48, 8, prompt_cache=whole)[0] == greedy_reference(model, prompt, 48)
    full = [c for c in whole.draft_cache if c.window is None]
    assert full and all(c.fetch()[0].shape[2] == c.offset > 8 - 1 + ContextCache.TRIM_SLACK for c in full)
    llama, tok = tiny_target("llama")
    own = make_prompt_cache(llama, random_draft(llama, block_size=8, num_layers=1), max_kv_size=8)
    assert all(c.window is None for c in own.draft_cache)
