"""The draft's training forward: many blocks of one sequence in a single pass.

At inference the draft proposes one block at a time from a cache of context
K/V. In training each sequence carries K blocks at random anchors; all of them
run together, with the block-sparse mask of `mask.py` reproducing what each
block would see at inference. Only the draft's own submodules are used (its
projections, norms, MLP, `fc`/`hidden_norm` and RoPE object), so the trained
weights mean exactly the same thing in `DFlashDraftModel.propose_logits`.
"""

from typing import Optional

import mlx.core as mx

from dflash_mlx.train.mask import block_mask


def _attention(attn, x, h_ctx, anchors, rope, block_size, mask):
    """One draft layer's attention. x: [N, K*B, H] block states, h_ctx: [N, S, H]."""
    N, L, _ = x.shape
    K = anchors.shape[1]
    B = block_size
    d = attn.head_dim

    # Block queries/keys/values, RoPE'd per block at a_j .. a_j+B-1: fold the
    # blocks into the batch axis so each gets its own offset.
    def per_block(t, heads):
        t = t.reshape(N * K, B, heads, d).transpose(0, 2, 1, 3)
        return rope(t, offset=anchors.reshape(-1))

    q = attn.q_norm(attn.q_proj(x).reshape(N, L, attn.n_heads, d))
    q = per_block(q.reshape(N, L, attn.n_heads * d), attn.n_heads)
    k_blk = attn.k_norm(attn.k_proj(x).reshape(N, L, attn.n_kv_heads, d))
    k_blk = per_block(k_blk.reshape(N, L, attn.n_kv_heads * d), attn.n_kv_heads)
    v_blk = attn.v_proj(x).reshape(N * K, B, attn.n_kv_heads, d).transpose(0, 2, 1, 3)

    def unfold(t, heads):  # [N*K, heads, B, d] -> [N, heads, K*B, d]
        return t.reshape(N, K, heads, B, d).transpose(0, 2, 1, 3, 4).reshape(N, heads, K * B, d)

    q = unfold(q, attn.n_heads)
    k_blk, v_blk = unfold(k_blk, attn.n_kv_heads), unfold(v_blk, attn.n_kv_heads)

    # Context K/V at their true positions 0..S-1 (the same projection inference injects).
    k_ctx, v_ctx = attn.project_kv(h_ctx, rope, 0)
    keys = mx.concatenate([k_ctx, k_blk], axis=2)
    values = mx.concatenate([v_ctx, v_blk], axis=2)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(N, L, -1))


def _dropout(x: mx.array, p: float) -> mx.array:
    if not p:
        return x
    return x * mx.random.bernoulli(1.0 - p, x.shape).astype(x.dtype) / (1.0 - p)


def training_hidden(draft, features: mx.array, block_ids: mx.array, anchors: mx.array,
                    dropout: float = 0.0) -> mx.array:
    """Normalized draft hidden states of every block token.

    features: [N, S, n_tl*H] target features of the whole sequence;
    block_ids: [N, K*B] token ids ([anchor token, MASK x (B-1)] per block);
    anchors: [N, K] absolute positions of the anchor tokens.
    dropout: on the fused context and on each residual branch (training only: a small
    draft memorises its few target responses, see train/README.md).
    Returns [N, K*B, H].
    """
    B = block_ids.shape[1] // anchors.shape[1]
    S = features.shape[1]
    h_ctx = _dropout(draft.fuse(features), dropout)
    h = draft.target.embed(block_ids)
    if draft.config.input_embedding_scale != 1.0:
        h = h * draft.config.input_embedding_scale
    masks = {}
    for layer in draft.layers:
        attn = layer.self_attn
        key = (attn.window, attn.is_causal)
        if key not in masks:
            masks[key] = block_mask(anchors, S, B, window=attn.window, causal=attn.is_causal)
        a = _attention(attn, layer.input_layernorm(h), h_ctx, anchors, draft._rope, B, masks[key])
        h = h + _dropout(a, dropout)
        h = h + _dropout(layer.mlp(layer.post_attention_layernorm(h)), dropout)
    return draft.norm(h)


def training_logits(
    draft,
    features: mx.array,
    block_ids: mx.array,
    anchors: mx.array,
    vocab_ids: Optional[mx.array] = None,
    dropout: float = 0.0,
) -> mx.array:
    """Logits [N, K, B-1, V] at the mask positions of every block (draft vocabulary
    `vocab_ids`, else `draft.vocab_ids`, else the full vocabulary)."""
    N, K = anchors.shape
    B = block_ids.shape[1] // K
    h = training_hidden(draft, features, block_ids, anchors, dropout).reshape(N, K, B, -1)[:, :, 1:]
    return draft.logits(h, vocab_ids)
