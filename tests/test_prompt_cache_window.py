"""Prefix reuse with a sliding-window draft: the target's cache is kept, the draft's window is
trimmed while it still holds what stays visible and rebuilt from target features once it does not."""

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.testing.targets import EOS_ID, greedy_reference, tiny_target

WINDOW = 6


@pytest.fixture(scope="module")
def pair():
    model, tok = tiny_target("qwen3", seed=8)
    draft = random_draft(model, num_layers=2, block_size=4, sliding_window=WINDOW,
                         layer_types=["sliding_attention", "full_attention"])
    return model, tok, draft


def run(model, draft, tok, prompt, cache, max_tokens=8):
    out, prefill = [], None
    for r in stream_generate(model, draft, tok, prompt, max_tokens=max_tokens, block_size=4, prompt_cache=cache):
        prefill = r.prefill_tokens if prefill is None else prefill
        out.extend(r.tokens)
    return out, prefill


def visible(cache):
    """Per layer: (offset, the K/V a block can still see) of a draft cache."""
    out = []
    for c in cache:
        k, v = c.fetch()
        n = c.offset if c.window is None else min(c.window - 1, c.offset)
        out.append((c.offset, np.array(k[..., k.shape[2] - n:, :]), np.array(v[..., v.shape[2] - n:, :])))
    return out


def assert_same_context(reused, fresh):
    for (o1, k1, v1), (o2, k2, v2) in zip(visible(reused), visible(fresh)):
        assert o1 == o2
        np.testing.assert_allclose(k1, k2, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(v1, v2, rtol=1e-4, atol=1e-5)


def exact(model, prompt, out, max_tokens=8):
    assert out == greedy_reference(model, prompt, max_tokens, stop_ids=[EOS_ID])[: len(out)]
    assert len(out) == max_tokens or out[-1] == EOS_ID


@pytest.mark.parametrize("length, cut, expect_prefill", [
    (100, 25, 3 + (WINDOW - 1)),  # past the window: the target keeps 20 tokens, the window is run again
    (20, 4, 3),  # a short context: the sliding cache still holds all of it, a plain trim
])
def test_windowed_draft_reuses_the_target_cache_and_rebuilds_its_window(pair, length, cut, expect_prefill):
    model, tok, draft = pair
    cache = make_prompt_cache(model, draft)
    a1 = list(range(30, 30 + length))
    out1, _ = run(model, draft, tok, a1, cache)
    exact(model, a1, out1)
    edited = a1[:cut] + [1, 2, 3]
    out_e, prefill = run(model, draft, tok, edited, cache, max_tokens=1)
    assert prefill == expect_prefill  # was len(edited): both caches thrown away
    fresh = make_prompt_cache(model, draft)
    run(model, draft, tok, edited, fresh, max_tokens=1)
    assert_same_context(cache.draft_cache, fresh.draft_cache)
    # and the conversation goes on, exactly the target's greedy tokens
    out2, prefill2 = run(model, draft, tok, edited + [5, 6], cache)
    assert prefill2 == 2
    exact(model, edited + [5, 6], out2)


def test_windowed_draft_trims_into_its_last_answer(pair):
    # An edited answer tail: a trim of a few tokens past the window stays inside the
    # sliding cache's slack, so nothing is run again.
    model, tok, draft = pair
    cache = make_prompt_cache(model, draft)
    a1 = list(range(30, 70))
    out1, _ = run(model, draft, tok, a1, cache, max_tokens=10)
    a2 = a1 + out1[:5] + [7, 8]
    out2, prefill = run(model, draft, tok, a2, cache)
    assert prefill == 2
    exact(model, a2, out2)
    fresh = make_prompt_cache(model, draft)
    run(model, draft, tok, a2, fresh, max_tokens=1)
    reused = make_prompt_cache(model, draft)
    run(model, draft, tok, a1, reused, max_tokens=10)
    run(model, draft, tok, a2, reused, max_tokens=1)
    assert_same_context(reused.draft_cache, fresh.draft_cache)


def test_sliding_cache_trim_is_refused_once_the_window_is_short(pair):
    _, _, draft = pair
    c = draft.make_cache()[0]
    k = mx.zeros((1, 1, 3, 4))
    c.append(mx.zeros((1, 1, 10 + c.TRIM_SLACK, 4)), mx.zeros((1, 1, 10 + c.TRIM_SLACK, 4)))
    assert c.trimmable(c.TRIM_SLACK) and not c.trimmable(c.TRIM_SLACK + 1)
    c.trim(c.TRIM_SLACK)  # what is left is exactly the window: no further trim
    assert not c.trimmable(1)
    with pytest.raises(RuntimeError, match="rebuild it"):
        c.trim(1)
    short = draft.make_cache()[0]
    short.append(k, k)
    assert short.trimmable(2) and short.trim(2) == 2 and short.offset == 1
