"""The block-sparse attention mask that trains many draft blocks in one forward.

Keys are laid out as [context positions 0..S-1 ; block tokens], block j
occupying key slots S + j*B .. S + j*B + B-1. A query of block j (anchor a_j,
block position i, absolute position a_j + i) may see

- context position p iff p < a_j: target features strictly before the anchor,
  exactly what the engine's draft cache holds when it proposes that block
  (and, on sliding-window layers, only if a_j + i - p < window);
- every token of its own block (bidirectional; causal only when the draft
  config asks for it), and nothing of the other blocks.
"""

from typing import Optional

import mlx.core as mx


def block_mask(
    anchors: mx.array,
    seq_len: int,
    block_size: int,
    window: Optional[int] = None,
    causal: bool = False,
) -> mx.array:
    """anchors: [N, K] int -> boolean mask [N, 1, K*B, seq_len + K*B] (True = may attend)."""
    N, K = anchors.shape
    B = block_size
    blk_of_q = mx.repeat(mx.arange(K), B)  # [K*B] block index of each query
    idx_in_q = mx.tile(mx.arange(B), K)  # [K*B] position inside its block
    q_anchor = anchors[:, blk_of_q]  # [N, K*B]
    q_pos = q_anchor + idx_in_q[None]  # absolute positions of the queries

    ctx_pos = mx.arange(seq_len)
    ctx_ok = ctx_pos[None, None, :] < q_anchor[:, :, None]  # [N, K*B, S]
    if window is not None:
        ctx_ok = ctx_ok & (q_pos[:, :, None] - ctx_pos[None, None, :] < window)

    same_blk = blk_of_q[:, None] == blk_of_q[None, :]  # [K*B, K*B]
    if causal:
        same_blk = same_blk & (idx_in_q[None, :] <= idx_in_q[:, None])
    blk_ok = mx.broadcast_to(same_blk[None], (N, K * B, K * B))
    return mx.concatenate([ctx_ok, blk_ok], axis=-1)[:, None]
