"""The training forward (many blocks, block-sparse mask) equals the engine's draft forward."""

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)
import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.models.target.adapter import Target
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.testing.targets import tiny_target
from dflash_mlx.train.forward import training_logits


def _inference_logits(draft, target, tokens, anchor, block_size):
    """What the engine's draft proposes for a block anchored at `anchor`."""
    _, feats, _ = target.forward(mx.array([tokens]), cache=None, layer_ids=draft.config.target_layer_ids)
    cache = draft.make_cache()
    return draft.propose_logits(mx.array([tokens[anchor]]), feats[:, :anchor], cache, block_size)[0]


@pytest.mark.parametrize("arch,layers", [("llama", 2), ("qwen3", 1), ("gemma3_text", 2)])
def test_training_forward_matches_propose_logits(arch, layers):
    model, _ = tiny_target(arch)
    target = Target(model)
    B = 8
    draft = random_draft(target, num_layers=layers, block_size=B, seed=3)
    rng = np.random.default_rng(0)
    S = 40
    tokens = rng.integers(0, 256, size=S).tolist()
    anchors = [5, 11, 12, 30]  # overlapping blocks, one running past the end
    _, feats, _ = target.forward(mx.array([tokens]), cache=None, layer_ids=draft.config.target_layer_ids)
    block_ids = []
    for a in anchors:
        block_ids += [tokens[a]] + [draft.config.mask_token_id] * (B - 1)
    logits = training_logits(draft, feats, mx.array([block_ids]), mx.array([anchors]))
    assert logits.shape == (1, len(anchors), B - 1, target.vocab_size)
    for j, a in enumerate(anchors):
        ref = _inference_logits(draft, target, tokens, a, B)
        np.testing.assert_allclose(np.array(logits[0, j]), np.array(ref), atol=1e-4, rtol=1e-4)


def test_training_forward_sliding_window_and_reduced_vocab():
    model, _ = tiny_target("qwen3")
    target = Target(model)
    B = 6
    draft = random_draft(
        target, num_layers=2, block_size=B, seed=1,
        layer_types=["sliding_attention", "full_attention"], sliding_window=9,
    )
    vocab = mx.array([3, 7, 50, 99, 120, 255, 257], dtype=mx.int32)
    draft.set_vocab(vocab)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 256, size=30).tolist()
    anchors = [4, 20, 25]
    _, feats, _ = target.forward(mx.array([tokens]), cache=None, layer_ids=draft.config.target_layer_ids)
    block_ids = sum(([tokens[a]] + [draft.config.mask_token_id] * (B - 1) for a in anchors), [])
    logits = training_logits(draft, feats, mx.array([block_ids]), mx.array([anchors]))
    assert logits.shape[-1] == vocab.size
    for j, a in enumerate(anchors):
        ref = _inference_logits(draft, target, tokens, a, B)
        np.testing.assert_allclose(np.array(logits[0, j]), np.array(ref), atol=1e-4, rtol=1e-4)
