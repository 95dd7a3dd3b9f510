"""CPU weight layout (`dflash_mlx.models.layout`): the same values in a GEMM-friendly memory order."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx import stream_generate
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.models.layout import is_relaid, relayout_for_cpu
from dflash_mlx.testing.targets import greedy_reference, tiny_target


def _linears(model):
    return [m for _, m in model.named_modules() if type(m) is nn.Linear]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_relayout_keeps_values_shapes_and_the_models_output(arch):
    model, tok = tiny_target(arch, seed=7)
    before = {id(m): np.array(m.weight) for m in _linears(model)}
    ids = mx.array([[5, 3, 9, 14, 2, 7, 1]])
    want = np.array(model(ids))
    n = relayout_for_cpu(model)
    assert n == len(before) > 0
    for m in _linears(model):
        assert is_relaid(m.weight)
        np.testing.assert_array_equal(np.array(m.weight), before[id(m)])  # same values, same [out, in] shape
    np.testing.assert_allclose(np.array(model(ids)), want, rtol=1e-5, atol=1e-5)
    assert relayout_for_cpu(model) == 0  # once is enough
    # reloading weights gives ordinary arrays again: they are no longer marked
    m = _linears(model)[0]
    m.weight = mx.array(np.array(m.weight))
    assert not is_relaid(m.weight)


def test_relaid_target_and_draft_stay_exact():
    model, tok = tiny_target("llama", seed=8)
    prompt = [1, 4, 9, 2, 7]
    ref = greedy_reference(model, prompt, 24)
    draft = random_draft(model, num_layers=1, block_size=8)
    relayout_for_cpu(model)
    relayout_for_cpu(draft)
    for block in (1, 4, 8, "auto"):
        out = []
        for r in stream_generate(model, draft, tok, prompt, max_tokens=24, block_size=block, stop_token_ids=[]):
            out += r.tokens
        assert out == ref[: len(out)] and len(out) == 24


def test_load_lays_out_the_packaged_target_and_draft(smollm2):
    from dflash_mlx import load_draft

    model, _ = smollm2  # from dflash_mlx.load
    draft = load_draft("smollm2-135m", model, quiet=True)
    assert all(is_relaid(m.weight) for m in _linears(model))
    assert all(is_relaid(m.weight) for m in _linears(draft))
