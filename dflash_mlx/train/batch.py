"""What one training step sees: K blocks per record, their context features and labels.

Each block is [anchor, MASK x (B-1)] at a random anchor in the record's response;
its labels are the B-1 tokens after the anchor (the target's response, or the
target's argmax on depth records), as indices into the draft's (possibly reduced)
vocabulary. Features are the target's tapped hidden
states for the whole record, padded to the longest record of the batch.
"""

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np


@dataclass
class Batch:
    features: mx.array  # [N, S, n_tl*H]
    block_ids: mx.array  # [N, K*B]
    anchors: mx.array  # [N, K]
    labels: mx.array  # [N, K, B-1] draft-vocabulary indices
    valid: mx.array  # [N, K, B-1] label exists and is in the draft vocabulary
    exists: mx.array  # [N, K, B-1] label exists
    # The target's distribution at each label (distillation): its top-k tokens as
    # draft-vocabulary indices and their probabilities, renormalised over the top-k
    # tokens the draft vocabulary has (0 elsewhere). None without a teacher.
    soft_ids: Optional[mx.array] = None  # [N, K, B-1, k]
    soft_probs: Optional[mx.array] = None  # [N, K, B-1, k]

    @property
    def supervised(self) -> int:
        return int(self.exists.sum().item())


def make_batch(
    records: Sequence[dict],
    features: Callable[[dict], np.ndarray],
    rng: np.random.Generator,
    block_size: int,
    blocks_per_seq: int,
    mask_token_id: int,
    vocab_index: np.ndarray,
    max_seq_len: int = 512,
    feature_scale: Optional[np.ndarray] = None,
    teacher: Optional[Callable[[dict], tuple]] = None,
    target_labels: Optional[Callable[[dict], np.ndarray]] = None,
) -> Batch:
    """K random anchors in each record's response; blocks past the end are masked.
    `feature_scale` [n_tl*H] preconditions the features (folded into fc at export).
    `teacher(rec)` -> (ids [len-1, k], log-probs [len-1, k]): soft labels as well.
    Depth records (`train/depth_data.py`) may carry `spans` ([start, end) positions
    anchors are drawn from: the target's own responses in a chained conversation) and
    `target_labels` (labels are then `target_labels(rec)`, the target's argmax after
    each position, instead of the next token of the text)."""
    B, K = block_size, blocks_per_seq
    feats, blocks, anchors, labels, valid, exists = [], [], [], [], [], []
    soft_ids, soft_probs = [], []
    for rec in records:
        seq = (rec["prompt"] + rec["response"])[:max_seq_len]
        T = len(seq)
        P = min(len(rec["prompt"]), T - 2)
        cand = np.arange(P, T - 1)  # anchors need at least one label after them
        if rec.get("spans"):
            inside = np.zeros(T, dtype=bool)
            for a0, a1 in rec["spans"]:
                inside[max(a0, 0):min(a1, T)] = True
            cand = cand[inside[cand]]
        take = min(K, len(cand))
        a = np.sort(rng.choice(cand, size=take, replace=False)) if take else np.zeros(0, np.int64)
        a_ok = np.arange(K) < take
        a = np.concatenate([a, np.full(K - take, P, dtype=a.dtype)]).astype(np.int64)
        pos = a[:, None] + np.arange(1, B)[None]  # label positions [K, B-1]
        ex = (pos < T) & a_ok[:, None]
        seq_np = np.asarray(seq, dtype=np.int64)
        feats.append(np.asarray(features(rec))[: T - 1])  # first: the same forward may give the labels
        if rec.get("target_labels"):
            if target_labels is None:
                raise ValueError(f"record {rec['id']} is labelled by the target: pass target_labels")
            argmax = np.asarray(target_labels(rec), dtype=np.int64)  # [len-1]: token after position j
            lab_full = np.where(ex, argmax[np.minimum(pos - 1, len(argmax) - 1)], 0)
        else:
            lab_full = np.where(ex, seq_np[np.minimum(pos, T - 1)], 0)
        lab = vocab_index[lab_full]
        va = ex & (lab >= 0)
        blk = np.full((K, B), mask_token_id, dtype=np.int64)
        blk[:, 0] = seq_np[a]
        blocks.append(blk.reshape(-1))
        anchors.append(a)
        labels.append(np.maximum(lab, 0))
        valid.append(va)
        exists.append(ex)
        if teacher is not None:
            # row j of the teacher is the target's distribution of token j+1
            t_ids, t_logp = teacher(rec)
            rows = np.minimum(pos - 1, len(t_ids) - 1)
            ids = vocab_index[np.asarray(t_ids)[rows]]  # [K, B-1, k], -1: not in the draft vocabulary
            p = np.exp(np.asarray(t_logp, np.float32)[rows]) * (ids >= 0) * ex[..., None]
            p /= np.maximum(p.sum(-1, keepdims=True), 1e-9)
            soft_ids.append(np.maximum(ids, 0))
            soft_probs.append(p)
    S = max(f.shape[0] for f in feats)
    F = np.zeros((len(feats), S, feats[0].shape[1]), dtype=np.float32)
    for i, f in enumerate(feats):
        F[i, : f.shape[0]] = f
    if feature_scale is not None:
        F *= feature_scale[None, None, :]
    return Batch(
        mx.array(F),
        mx.array(np.stack(blocks).astype(np.int32)),
        mx.array(np.stack(anchors).astype(np.int32)),
        mx.array(np.stack(labels).astype(np.int32)),
        mx.array(np.stack(valid)),
        mx.array(np.stack(exists)),
        mx.array(np.stack(soft_ids).astype(np.int32)) if teacher is not None else None,
        mx.array(np.stack(soft_probs)) if teacher is not None else None,
    )
