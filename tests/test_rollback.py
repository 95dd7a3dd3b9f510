"""After a partial accept, every target cache equals the cache obtained by feeding
only the accepted tokens (KV, rotating window after wrap, Gated DeltaNet state + conv state)."""

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import tiny_target

ARCHS = ["llama", "qwen3", "gemma3_text", "qwen3_5", "gemma4_text"]


def logical_state(c):
    """What the next token can see, independent of buffer layout."""
    if isinstance(c, RotatingKVCache):
        keys = c._temporal_order(c.keys)
        values = c._temporal_order(c.values)
        n = min(c.offset, c.max_size - 1)
        return c.offset, [keys[..., -n:, :], values[..., -n:, :]]
    if isinstance(c, ArraysCache):
        return None, list(c.cache)
    if isinstance(c, KVCache):
        return c.offset, [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    raise TypeError(type(c))


def assert_same(cache_a, cache_b):
    assert len(cache_a) == len(cache_b)
    for i, (a, b) in enumerate(zip(cache_a, cache_b)):
        off_a, arrs_a = logical_state(a)
        off_b, arrs_b = logical_state(b)
        assert off_a == off_b, f"cache {i}: offset {off_a} != {off_b}"
        for x, y in zip(arrs_a, arrs_b):
            assert x.shape == y.shape, f"cache {i}: {x.shape} != {y.shape}"
            np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-5, atol=1e-5, err_msg=f"cache {i}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prompt_len", [5, 40])  # 40 wraps every sliding window of the tiny models
@pytest.mark.parametrize("keep", [1, 3, 8])
def test_rollback_equals_feeding_accepted_prefix(arch, prompt_len, keep):
    model, _ = tiny_target(arch, seed=2)
    target = Target(model)
    rng = random.Random(prompt_len * 100 + keep)
    prompt = mx.array([[rng.randrange(256) for _ in range(prompt_len)]])
    block = mx.array([[rng.randrange(256) for _ in range(8)]])

    rolled = target.make_cache()
    target.forward(prompt, rolled)
    _, _, record = target.forward(block, rolled, record=True)
    target.rollback(rolled, 8, 8 - keep, record)

    fresh = target.make_cache()
    target.forward(prompt, fresh)
    target.forward(block[:, :keep], fresh)
    assert_same(rolled, fresh)

    # and the next step sees the same thing
    nxt = mx.array([[rng.randrange(256) for _ in range(3)]])
    h_a, _, _ = target.forward(nxt, rolled)
    h_b, _, _ = target.forward(nxt, fresh)
    np.testing.assert_allclose(np.array(h_a), np.array(h_b), rtol=1e-5, atol=1e-5)


def test_cache_kinds_are_covered():
    kinds = set()
    for arch in ARCHS:
        model, _ = tiny_target(arch)
        kinds |= {type(c).__name__ for c in Target(model).make_cache()}
    assert {"KVCache", "RotatingKVCache", "ArraysCache"} <= kinds


def test_full_accept_skips_gdn_rerun():
    model, _ = tiny_target("qwen3_5")
    target = Target(model)
    cache = target.make_cache()
    target.forward(mx.array([[1, 2, 3]]), cache)
    _, _, record = target.forward(mx.array([[4, 5, 6, 7]]), cache, record=True)
    before = [list(c.cache) if isinstance(c, ArraysCache) else None for c in cache]
    target.rollback(cache, 4, 0, record)
    after = [list(c.cache) if isinstance(c, ArraysCache) else None for c in cache]
    for b, a in zip(before, after):
        if b is not None:
            assert all(x is y for x, y in zip(b, a))  # untouched: same arrays, no recompute


def test_taps_are_scoped():
    """Feature capture leaves the mlx-lm model exactly as it was."""
    model, _ = tiny_target("qwen3_5")
    target = Target(model)
    layers_before = list(target.text_model.layers)
    cache = target.make_cache()
    target.forward(mx.array([[1, 2, 3]]), cache, layer_ids=[0, 2], record=True)
    assert all(a is b for a, b in zip(layers_before, target.text_model.layers))
    assert type(model.language_model.model.layers[0]).__name__ == "DecoderLayer"


def test_nested_stand_ins_keep_the_layers_class():
    """A tapped layer whose calls are also recorded sits behind two stand-ins. Models that pick a
    layer's mask by its class (OLMo hybrid: causal for full attention, the SSM mask otherwise)
    must still see the layer's own class, or a verify's full-attention rows see later rows."""
    from dflash_mlx.models.target.rollback import ReplayTap
    from dflash_mlx.models.target.taps import _LayerTap

    model, _ = tiny_target("qwen3_5")
    layer = Target(model).layers[0]
    nested = _LayerTap(ReplayTap(layer, {}, lambda entry: None), lambda out: None)
    assert isinstance(nested, type(layer)) and nested.__class__ is type(layer)


def test_a_tapped_full_attention_layer_among_recurrent_ones_stays_exact():
    """OLMo hybrid's full-attention layer tapped between two linear-attention layers (a draft's
    middle tap on a 3-layer target): it gave other tokens than mlx-lm's from width 2 up."""
    from dflash_mlx.testing import variant_check, variants

    v = next(v for v in variants.variants("olmo_hybrid") if v.kind == "layers3")
    assert v.overrides["layer_types"] == ["linear_attention", "full_attention", "linear_attention"]
    r = variant_check.check(v, widths=(1, 4), batches=False)
    assert r.status == "exact", r.reason
    assert r.checked == ["1", "4", "turns"]
