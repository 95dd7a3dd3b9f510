"""Loss weights exp(-(k-1)/gamma) on the mask positions, and the block metrics."""

import math

import dflash_mlx  # noqa: F401
import mlx.core as mx
import numpy as np

from dflash_mlx.train.loss import block_loss, block_metrics, expected_tau, position_weights


def test_position_weights():
    w = np.array(position_weights(16, 7.0))
    assert w.shape == (15,)
    assert w[0] == 1.0
    np.testing.assert_allclose(w, [math.exp(-(k - 1) / 7.0) for k in range(1, 16)], rtol=1e-6)
    assert np.all(np.diff(w) < 0)


def test_block_loss_is_weighted_mean_ce_over_valid_positions():
    rng = np.random.default_rng(0)
    N, K, B, V, gamma = 2, 3, 5, 11, 2.0
    logits = rng.normal(size=(N, K, B - 1, V)).astype(np.float32)
    labels = rng.integers(0, V, size=(N, K, B - 1))
    valid = rng.random((N, K, B - 1)) > 0.3
    loss, wsum = block_loss(mx.array(logits), mx.array(labels), mx.array(valid), gamma)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    w = np.exp(-np.arange(B - 1) / gamma)[None, None] * valid
    np.testing.assert_allclose(loss.item(), (ce * w).sum() / w.sum(), rtol=1e-5)
    np.testing.assert_allclose(wsum.item(), w.sum(), rtol=1e-6)
    # invalid positions do not matter, whatever their labels
    labels2 = np.where(valid, labels, (labels + 1) % V)
    loss2, _ = block_loss(mx.array(logits), mx.array(labels2), mx.array(valid), gamma)
    np.testing.assert_allclose(loss2.item(), loss.item(), rtol=1e-6)


def test_metrics_count_accepted_prefixes():
    V = 4
    labels = np.array([[[1, 2, 3, 0], [1, 1, 1, 1]]])  # [1, 2, 4]
    pred = np.array([[[1, 2, 0, 0], [2, 1, 1, 1]]])  # block 0: 2 accepted, block 1: 0
    logits = np.eye(V, dtype=np.float32)[pred] * 5
    valid = np.ones_like(labels, dtype=bool)
    exists = valid.copy()
    corr, n, acc, blocks = block_metrics(mx.array(logits), mx.array(labels), mx.array(valid), mx.array(exists))
    assert (corr.item(), n.item(), acc.item(), blocks.item()) == (6, 8, 2, 2)
    assert expected_tau(acc.item(), blocks.item()) == 2.0
