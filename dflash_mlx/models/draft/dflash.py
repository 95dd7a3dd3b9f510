"""The DFlash draft: a few decoder layers that denoise a whole block in one forward.

The draft owns no embedding and no LM head: it borrows the target's.
Target features (outputs of `target_layer_ids`) are fused by `fc` + `hidden_norm`
and injected into every layer's KV cache through that layer's own k/v projections
(`ContextCache` holds context K/V only). DFlash 2 drafts (same injection, a
grouped dynamic conv around each sublayer and a candidate selector) subclass
this in `dflash_mlx.models.draft.dflash2`; `dflash_mlx.models.draft.checkpoints` picks the class from the
config and reads/writes z-lab's checkpoint layout.
"""

from typing import List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from dflash_mlx.kernels import context_kv, selection
from dflash_mlx.models.draft.context_cache import ContextCache
from dflash_mlx.models.draft.config import DraftConfig, DraftMismatchError, check_vocab_ids
from dflash_mlx.models.rope_offsets import rotate_rows


class DraftAttention(nn.Module):
    def __init__(self, config: DraftConfig, layer_idx: int):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.window = config.sliding_window if sliding else None
        # z-lab's drafts are causal inside the block on sliding layers unless the
        # config says otherwise; full layers see the whole block.
        self.is_causal = sliding if config.is_causal is None else config.is_causal
        dim, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(dim, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, dim, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)

    def project_kv(self, h: mx.array, rope, offset):
        """h: [B, S, H] -> k, v: [B, n_kv, S, d], RoPE'd at positions offset..offset+S-1
        (`offset` an int, or a list of one per batch entry)."""
        B, S, _ = h.shape
        k = self.k_norm(self.k_proj(h).reshape(B, S, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(h).reshape(B, S, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return (rotate_rows(rope, k, offset) if isinstance(offset, list) else rope(k, offset=offset)), v

    def inject(self, h_ctx: mx.array, rope, cache: ContextCache):
        """KV injection: the fused target features become this layer's context K/V."""
        if h_ctx.shape[1] == 0:
            return
        k, v = self.project_kv(h_ctx, rope, cache.offset)
        cache.append(k, v)

    def __call__(self, x: mx.array, rope, cache: ContextCache, mask_fn=None) -> mx.array:
        B, L, _ = x.shape
        start = cache.offset  # block positions continue after the context
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = rope(q, offset=start)
        k_blk, v_blk = self.project_kv(x, rope, start)
        k_ctx, v_ctx = cache.fetch()
        n_ctx = 0 if k_ctx is None else k_ctx.shape[2]
        if n_ctx:
            keys = mx.concatenate([k_ctx, k_blk], axis=2)
            values = mx.concatenate([v_ctx, v_blk], axis=2)
        else:
            keys, values = k_blk, v_blk
        mask = self._mask(L, n_ctx, start)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def rows(self, x: mx.array, rope, caches: Sequence[ContextCache]) -> mx.array:
        """`__call__` for B rows, each with its own context (`caches[b]`, lengths differing):
        x [B, L, H]. The contexts are left-padded to the longest, the padding masked out."""
        B, L, _ = x.shape
        starts = [c.offset for c in caches]
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = rotate_rows(rope, q, starts)
        k_blk, v_blk = self.project_kv(x, rope, starts)
        held = [c.fetch() for c in caches]
        lengths = [0 if k is None else k.shape[2] for k, _ in held]
        n_ctx = max(lengths)

        def padded(i, b):
            part = held[b][i]
            pad = n_ctx - lengths[b]
            if not pad:
                return part
            zeros = mx.zeros((1, self.n_kv_heads, pad, self.head_dim), dtype=k_blk.dtype)
            return zeros if part is None else mx.concatenate([zeros, part], axis=2)

        if n_ctx:
            keys = mx.concatenate([mx.concatenate([padded(0, b) for b in range(B)], axis=0), k_blk], axis=2)
            values = mx.concatenate([mx.concatenate([padded(1, b) for b in range(B)], axis=0), v_blk], axis=2)
        else:
            keys, values = k_blk, v_blk
        # [B, 1, L, n_ctx + L]: row b's context is its last lengths[b] slots before the block
        slot = mx.arange(n_ctx + L)[None, None]
        is_ctx = slot < n_ctx
        ctx_ok = is_ctx & (slot >= n_ctx - mx.array(lengths)[:, None, None])
        query = mx.arange(L)[None, :, None]
        if self.window is not None:  # block query l sees context slot j at distance l + n_ctx - j
            ctx_ok = ctx_ok & (query + n_ctx - slot < self.window)
        blk_ok = ~is_ctx
        if self.is_causal:
            blk_ok = blk_ok & (slot - n_ctx <= query)
        mask = (ctx_ok | blk_ok)[:, None]
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _mask(self, L: int, n_ctx: int, start: int):
        if self.window is None and not self.is_causal:
            return None
        q_pos = start + mx.arange(L)[:, None]
        k_pos = mx.concatenate([start - n_ctx + mx.arange(n_ctx), start + mx.arange(L)])[None]
        is_ctx = mx.arange(n_ctx + L)[None] < n_ctx
        ctx_ok = is_ctx
        if self.window is not None:
            ctx_ok = ctx_ok & (q_pos - k_pos < self.window)
        blk_ok = ~is_ctx
        if self.is_causal:
            blk_ok = blk_ok & (k_pos <= q_pos)
        return ctx_ok | blk_ok


class DraftLayer(nn.Module):
    def __init__(self, config: DraftConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DraftAttention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)  # mlx-lm's SwiGLU, z-lab's names
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, rope, cache):
        h = x + self.self_attn(self.input_layernorm(x), rope, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    def rows(self, x, rope, caches):
        h = x + self.self_attn.rows(self.input_layernorm(x), rope, caches)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    """Block-diffusion drafter. Bind it to a target (`bind`) before use."""

    layer_class = DraftLayer
    version = 1

    def __init__(self, config: DraftConfig):
        super().__init__()
        if config.version != self.version:
            # A DFlash 2 config in a DFlash model would silently drop the conv and the selector.
            raise DraftMismatchError(
                f"{type(self).__name__} builds DFlash {self.version} drafts but the config is "
                f"DFlash {config.version}; build it with "
                "dflash_mlx.models.draft.checkpoints.draft_class(config)(config)"
            )
        self.config = config
        n_feat = len(config.target_layer_ids) * config.hidden_size
        self.fc = nn.Linear(n_feat, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [self.layer_class(config, i) for i in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Plain attributes (not module children): the target's weights are borrowed,
        # never saved with the draft nor trained.
        object.__setattr__(self, "_rope", initialize_rope(
            config.head_dim,
            config.rope_theta,
            False,
            config.rope_scaling,
            config.max_position_embeddings,
        ))
        object.__setattr__(self, "target", None)
        object.__setattr__(self, "vocab_ids", None)  # reduced draft vocabulary, or None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def bind(self, target) -> "DFlashDraftModel":
        """target: a `dflash_mlx.models.target.adapter.Target` (supplies embed/lm_head)."""
        object.__setattr__(self, "target", target)
        return self

    def set_vocab(self, token_ids: Optional[mx.array]):
        """A reduced draft vocabulary: the target token ids the draft scores, [V_draft]. An id past
        the target's vocabulary would be drafted, then embedded by the target's verify from
        outside its table: garbage (NaN) in its caches, wrong tokens with no error."""
        if token_ids is not None:
            check_vocab_ids(token_ids, self.config.vocab_size)
        object.__setattr__(self, "vocab_ids", token_ids)

    def make_cache(self) -> List[ContextCache]:
        if selection.use_metal("kv_inject"):
            # Preallocated K/V of all layers: the kernel's output lands with one write per tensor.
            return context_kv.make_stacked_cache(self)
        return [ContextCache(layer.self_attn.window) for layer in self.layers]

    def fused_taps(self) -> Optional[nn.Module]:
        """What a target may apply to the taps before they reach `fuse`: `fc`, linear, so a split
        target's ranks can each send their taps' share of it (`Target.forward(fuse=...)`); None
        with one tap, whose share is as wide as the tap."""
        linear = "bias" not in self.fc and len(self.config.target_layer_ids) > 1
        return self.fc if linear else None

    def fuse(self, features: mx.array) -> mx.array:
        """features: [B, S, n_tl*H] concatenated target layer outputs, or [B, S, H] already
        through `fc` (`fused_taps`; with n_tl > 1 the widths differ) -> [B, S, H]."""
        if features.shape[-1] != self.config.hidden_size or len(self.config.target_layer_ids) == 1:
            features = self.fc(features)
        return self.hidden_norm(features)

    def inject(self, features: Optional[mx.array], cache: List[ContextCache]):
        if features is None:
            return
        if selection.use_metal("kv_inject"):  # off unless verified on Apple GPUs (see metal/README.md)
            return context_kv.draft_inject(self, features, cache)
        self.inject_reference(features, cache)

    def inject_reference(self, features: mx.array, cache: List[ContextCache]):
        h_ctx = self.fuse(features)
        for layer, c in zip(self.layers, cache):
            layer.self_attn.inject(h_ctx, self._rope, c)

    def hidden(self, block_ids: mx.array, cache: List[ContextCache]) -> mx.array:
        """block_ids: [B, L] -> normalized hidden states [B, L, H]."""
        h = self.target.embed(block_ids)
        if self.config.input_embedding_scale != 1.0:
            h = h * self.config.input_embedding_scale
        for layer, c in zip(self.layers, cache):
            h = layer(h, self._rope, c)
        return self.norm(h)

    def logits(self, h: mx.array, vocab_ids: Optional[mx.array] = None) -> mx.array:
        """Draft logits over `vocab_ids`, else the draft vocabulary (all target tokens, or `self.vocab_ids`)."""
        out = self.target.head(h, self.vocab_ids if vocab_ids is None else vocab_ids)
        if self.config.output_multiplier != 1.0:
            out = out * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            out = mx.tanh(out / cap) * cap
        return out

    def propose_hidden(
        self, last_token: mx.array, features: Optional[mx.array], cache: List[ContextCache], block_size: int
    ) -> mx.array:
        """Inject `features`, denoise `[last, MASK x (block_size-1)]`: hidden [B, block_size-1, H] of the
        mask positions."""
        self.inject(features, cache)
        B = last_token.shape[0]
        mask_ids = mx.full((B, block_size - 1), self.config.mask_token_id, dtype=last_token.dtype)
        block = mx.concatenate([last_token[:, None], mask_ids], axis=1)
        return self.hidden(block, cache)[:, 1:]

    def batches_rows(self, caches: Sequence[List[ContextCache]]) -> bool:
        """Whether `propose_logits_rows` serves rows with these caches (DFlash drafts on
        `ContextCache`s; a DFlash 2 draft's selector keeps one row's state)."""
        return type(self).layer_class is DraftLayer and all(
            type(c) is ContextCache for cache in caches for c in cache)

    def propose_logits_rows(self, last_tokens: Sequence[mx.array], features: Sequence[Optional[mx.array]],
                            caches: Sequence[List[ContextCache]], block_size: int) -> mx.array:
        """`propose_logits` for B rows with their own contexts in one forward: last_tokens[b] [1],
        features[b] [1, S_b, n_tl*H] or None, caches[b] its context cache. Returns logits
        [B, block_size-1, V_draft]; row b's are what `propose_logits` gives it alone, up to
        rounding (its context padded and masked out)."""
        for f, cache in zip(features, caches):
            self.inject(f, cache)
        last = mx.concatenate(list(last_tokens))  # [B]
        mask_ids = mx.full((last.shape[0], block_size - 1), self.config.mask_token_id, dtype=last.dtype)
        h = self.target.embed(mx.concatenate([last[:, None], mask_ids], axis=1))
        if self.config.input_embedding_scale != 1.0:
            h = h * self.config.input_embedding_scale
        for i, layer in enumerate(self.layers):
            h = layer.rows(h, self._rope, [cache[i] for cache in caches])
        return self.logits(self.norm(h)[:, 1:])

    def propose_logits(
        self, last_token: mx.array, features: Optional[mx.array], cache: List[ContextCache], block_size: int
    ) -> mx.array:
        """One denoising step.

        last_token: [B] last committed token; features: [B, S_new, n_tl*H] for the
        tokens committed since the previous call (injected into the cache).
        Returns logits [B, block_size-1, V_draft] for the mask positions.
        """
        return self.logits(self.propose_hidden(last_token, features, cache, block_size))

    def to_target_ids(self, draft_ids: mx.array) -> mx.array:
        return draft_ids if self.vocab_ids is None else self.vocab_ids[draft_ids]
