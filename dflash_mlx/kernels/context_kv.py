"""DFlash draft KV injection: k_norm + RoPE + cache layout of every draft layer in one kernel.

`context_kv` computes the context K/V of all draft layers from their stacked
k_proj/v_proj outputs (`context_kv_reference` is the draft's own per-layer
math; `context_kv_metal` the kv_inject kernel). `draft_inject` is the draft's
injection on top of it: one matmul for all layers' projections (float or
affine-quantized alike), one kernel, and with a `StackedContextCache` one
slice update per tensor.
"""

import math
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from dflash_mlx.kernels import selection


def rope_inv_freq(rope, dims: Optional[int] = None) -> Tuple[mx.array, float, int]:
    """(inv_freq [dims/2] float32, mscale, dims) for an mlx-lm RoPE module.

    Supports nn.RoPE (base) and the freqs-based modules of mlx_lm.models.rope_utils
    (Llama3, YaRN, SuScaled, Proportional), non-traditional only.
    """
    if getattr(rope, "traditional", False):
        raise ValueError("context_kv: traditional (interleaved) RoPE is not supported")
    if getattr(rope, "scale", 1.0) != 1.0:
        raise ValueError("context_kv: RoPE position scale != 1 is not supported")
    dims = getattr(rope, "dims", None) or getattr(rope, "dim", None) or dims
    freqs = getattr(rope, "_freqs", None)
    if freqs is not None:
        # mx.fast.rope uses 1 / freqs; computing the same reciprocal keeps the
        # angles bit-identical to the reference.
        inv = mx.reciprocal(freqs.astype(mx.float32))
    else:
        half = dims // 2
        inv = mx.exp(mx.arange(half, dtype=mx.float32) * (-math.log(rope.base) / half))
    mscale = float(getattr(rope, "mscale", getattr(rope, "_scale", 1.0)))
    return inv, mscale, dims


def context_kv_reference(kv: mx.array, k_norm_weight: mx.array, offset: int, *, eps: float, rope):
    """Plain MLX, exactly the draft's per-layer context K/V (DraftAttention.project_kv).

    kv: [B, S, L, 2, Hkv, D] stacked k_proj/v_proj outputs; k_norm_weight: [L, D];
    rope: the draft's RoPE module. Returns keys, values [L, B, Hkv, S, D].
    """
    keys, values = [], []
    for layer in range(kv.shape[2]):
        k = mx.fast.rms_norm(kv[:, :, layer, 0], k_norm_weight[layer], eps).transpose(0, 2, 1, 3)
        keys.append(rope(k, offset=offset))
        values.append(kv[:, :, layer, 1].transpose(0, 2, 1, 3))
    return mx.stack(keys), mx.stack(values)


def context_kv_metal(kv, k_norm_weight, offset, *, eps, rope, factory=None):
    B, S, L, two, Hkv, D = kv.shape
    assert two == 2, "kv must be [B, S, L, 2, Hkv, D]"
    inv_freq, mscale, dims = rope_inv_freq(rope, D)
    if dims % 2 or dims > D:
        raise ValueError(f"context_kv: rotary dims {dims} must be even and <= head_dim {D}")
    rows = L * Hkv
    return selection.kernel("kv_inject", factory)(
        inputs=[kv, k_norm_weight, inv_freq, mx.array(int(offset), dtype=mx.int32),
                mx.array(eps, dtype=mx.float32), mx.array(mscale, dtype=mx.float32)],
        template=[("OutT", kv.dtype), ("L", L), ("Hkv", Hkv), ("D", D), ("RD", dims)],
        grid=(32, rows, B * S),
        threadgroup=(32, min(rows, 8), 1),
        output_shapes=[(L, B, Hkv, S, D), (L, B, Hkv, S, D)],
        output_dtypes=[kv.dtype, kv.dtype],
    )


def context_kv(kv, k_norm_weight, offset, *, eps, rope):
    if selection.use_metal("kv_inject"):
        return context_kv_metal(kv, k_norm_weight, offset, eps=eps, rope=rope)
    return context_kv_reference(kv, k_norm_weight, offset, eps=eps, rope=rope)


def _kv_projections(draft) -> list:
    return [p for layer in draft.layers for p in (layer.self_attn.k_proj, layer.self_attn.v_proj)]


def stack_kind(draft) -> Optional[str]:
    """'float' or 'quantized' when every layer's k/v projections stack into one matmul
    (no bias; quantized ones all affine with one group size and bits), else None."""
    projs = _kv_projections(draft)
    if any("bias" in p for p in projs):
        return None
    if all(type(p) is nn.Linear for p in projs):
        return "float"
    if all(type(p) is nn.QuantizedLinear for p in projs):
        kinds = {(p.group_size, p.bits, p.mode) for p in projs}
        return "quantized" if kinds == {(projs[0].group_size, projs[0].bits, "affine")} else None
    return None


def stacked_kv_weight(draft):
    """Every layer's k_proj then v_proj rows, stacked once (cached on the draft): the weight
    [L * 2 * Hkv * D, H] of float projections, or (packed weight, scales, biases) of
    quantized ones (a quantized row's groups lie along its input, so rows stack as they are)."""
    names = ("weight",) if stack_kind(draft) == "float" else ("weight", "scales", "biases")
    parts = [p[n] for p in _kv_projections(draft) for n in names]
    cached = getattr(draft, "_dflash_kv_stack", None)
    if cached is not None and len(cached[0]) == len(parts) and all(a is b for a, b in zip(cached[0], parts)):
        return cached[1]
    stacked = tuple(mx.concatenate(parts[i::len(names)], axis=0) for i in range(len(names)))
    w = stacked[0] if len(names) == 1 else stacked
    object.__setattr__(draft, "_dflash_kv_stack", (parts, w))
    return w


def stacked_kv(draft, h: mx.array) -> mx.array:
    """h [.., H] -> every layer's k_proj and v_proj outputs, [.., L * 2 * Hkv * D], in one matmul."""
    w = stacked_kv_weight(draft)
    if isinstance(w, tuple):
        p = draft.layers[0].self_attn.k_proj
        return mx.quantized_matmul(h, *w, transpose=True, group_size=p.group_size, bits=p.bits)
    return h @ w.T


class StackedContextCache:
    """Preallocated context K/V of all draft layers: keys, values [L, B, Hkv, capacity, D].

    `views` is the per-layer list the draft takes in place of `draft.make_cache()`
    (each view has the ContextCache interface: offset, append, fetch, trim).
    `draft_inject` writes all layers with one slice update per tensor. Sliding
    layers keep their whole history here; the draft's mask applies the window.
    """

    step = 256

    def __init__(self, num_layers: int):
        self.keys = None
        self.values = None
        self.views = [_StackedView(self, i) for i in range(num_layers)]

    def _reserve(self, need: int, like: mx.array):
        """like: [.., B, Hkv, S, D] (one layer's or all layers' new keys)."""
        cap = 0 if self.keys is None else self.keys.shape[3]
        if need <= cap:
            return
        new_cap = -(-need // self.step) * self.step
        B, H, _, D = like.shape[-4:]
        shape = (len(self.views), B, H, new_cap - cap, D)
        grow = mx.zeros(shape, dtype=like.dtype)
        if self.keys is None:
            self.keys, self.values = grow, mx.zeros(shape, dtype=like.dtype)
        else:
            self.keys = mx.concatenate([self.keys, grow], axis=3)
            self.values = mx.concatenate([self.values, mx.zeros(shape, dtype=like.dtype)], axis=3)

    def write(self, keys: mx.array, values: mx.array):
        """keys, values: [L, B, Hkv, S, D] at every layer's current offset (all equal)."""
        off = self.views[0].offset
        S = keys.shape[3]
        self._reserve(off + S, keys)
        self.keys[:, :, :, off:off + S, :] = keys
        self.values[:, :, :, off:off + S, :] = values
        for v in self.views:
            v.offset = off + S


class _StackedView:
    window = None

    def __init__(self, stack: StackedContextCache, layer: int):
        self.stack = stack
        self.layer = layer
        self.offset = 0

    def append(self, keys: mx.array, values: mx.array):
        st, off, S = self.stack, self.offset, keys.shape[2]
        st._reserve(off + S, keys)
        st.keys[self.layer, :, :, off:off + S, :] = keys
        st.values[self.layer, :, :, off:off + S, :] = values
        self.offset = off + S
        return self.fetch()

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        self.offset -= n
        return n

    def fetch(self):
        if self.stack.keys is None or self.offset == 0:
            return None, None
        return (self.stack.keys[self.layer, :, :, : self.offset, :],
                self.stack.values[self.layer, :, :, : self.offset, :])


def make_stacked_cache(draft) -> list:
    """Per-layer views over one StackedContextCache (use instead of draft.make_cache())."""
    return StackedContextCache(len(draft.layers)).views


def draft_inject(draft, features: Optional[mx.array], cache) -> None:
    """Drop-in for `draft.inject(features, cache)`: one matmul + one kernel for all layers.

    Layers must share head layout and k_norm eps (true for every z-lab draft).
    With views from `make_stacked_cache` the K/V land in the stacked buffer with
    one slice update each; with ContextCache lists, per layer via append.
    """
    if features is None or features.shape[1] == 0:
        return
    S = features.shape[1]
    if stack_kind(draft) is None:
        return draft.inject_reference(features, cache)  # biased or mixed projections: keep the draft's path
    offsets = {c.offset for c in cache}
    if len(offsets) != 1:
        raise ValueError("draft_inject: layer caches disagree on the context offset")
    attn = draft.layers[0].self_attn
    h_ctx = draft.fuse(features)
    B = h_ctx.shape[0]
    kv = stacked_kv(draft, h_ctx).reshape(
        B, S, len(draft.layers), 2, attn.n_kv_heads, attn.head_dim
    )
    k_w = mx.stack([layer.self_attn.k_norm.weight for layer in draft.layers])
    keys, values = context_kv(kv, k_w, offsets.pop(), eps=attn.k_norm.eps, rope=draft._rope)
    stack = getattr(cache[0], "stack", None)
    if stack is not None and all(getattr(c, "stack", None) is stack for c in cache):
        stack.write(keys, values)
        return
    for i, c in enumerate(cache):
        c.append(keys[i], values[i])
