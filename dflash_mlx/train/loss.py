"""Loss and metrics on the mask positions of the training blocks.

Position k (1..B-1) of a block is weighted exp(-(k-1)/gamma): a drafted token
only counts if every earlier one was accepted, so early positions matter most.
"""

import math

import mlx.core as mx
import mlx.nn as nn


def position_weights(block_size: int, gamma: float) -> mx.array:
    """[B-1] weights for mask positions k = 1..B-1: exp(-(k-1)/gamma)."""
    k = mx.arange(1, block_size, dtype=mx.float32)
    return mx.exp(-(k - 1) / gamma)


def block_loss(logits: mx.array, labels: mx.array, valid: mx.array, gamma: float,
               soft_ids=None, soft_probs=None, distill: float = 0.0):
    """Weighted cross-entropy over mask positions.

    logits: [N, K, B-1, V] (draft vocabulary); labels: [N, K, B-1] indices into it;
    valid: [N, K, B-1] bool (label exists and is in the draft vocabulary).
    With `distill` > 0, soft_ids/soft_probs [N, K, B-1, k] (the target's top-k
    distribution over draft-vocabulary indices) add the cross-entropy against it:
    ce = (1 - distill) * CE(label) + distill * CE(soft), whose gradient is that
    of the KL divergence from the target's distribution.
    Returns (loss, sum of weights) with loss = sum(w * ce * valid) / sum(w * valid).
    """
    w = position_weights(logits.shape[2] + 1, gamma)[None, None, :] * valid
    ce = nn.losses.cross_entropy(logits, mx.where(valid, labels, 0), reduction="none")
    if distill and soft_ids is not None:
        logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        soft = -(soft_probs * mx.take_along_axis(logq, soft_ids, axis=-1)).sum(-1)
        ce = (1.0 - distill) * ce + distill * soft
    wsum = w.sum()
    return (ce * w).sum() / mx.maximum(wsum, 1e-6), wsum


def block_metrics(logits: mx.array, labels: mx.array, valid: mx.array, exists: mx.array):
    """Top-1 accuracy over existing labels, and the expected accept length.

    exists: [N, K, B-1] the label position is inside the sequence (an
    out-of-vocabulary label exists but can never be correct).
    Returns (correct count, label count, sum over blocks of accepted prefix
    lengths, number of blocks): tau_hat = 1 + accepted / blocks is what greedy
    decoding would get if each block were proposed from this context.
    """
    correct = (logits.argmax(-1) == labels) & valid
    accepted = mx.cumprod(correct.astype(mx.int32), axis=-1).sum(-1)  # [N, K]
    has_block = exists[..., 0]
    return (
        correct.sum(),
        exists.sum(),
        (accepted * has_block).sum(),
        has_block.sum(),
    )


def expected_tau(accepted_sum: float, blocks: float) -> float:
    return 1.0 + accepted_sum / blocks if blocks else math.nan


def position_accuracy(logits: mx.array, labels: mx.array, valid: mx.array, exists: mx.array):
    """Per mask position k = 1..B-1: (correct count [B-1], existing label count [B-1])."""
    correct = (logits.argmax(-1) == labels) & valid
    return correct.sum(axis=(0, 1)), exists.sum(axis=(0, 1))
