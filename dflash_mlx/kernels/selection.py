"""Hot-path kernels: a custom Metal kernel where it is verified, else its pure-MLX twin.

Each op has three functions: `<op>` (the dispatcher the engine calls),
`<op>_reference` (plain MLX ops, the definition of correct) and `<op>_metal`
(the `mx.fast.metal_kernel` path; its `factory` argument lets the Linux test
harness run the very same kernel source and launch parameters on the CPU).

Selection: the Metal path runs only where `mx.metal.is_available()` and the
kernel is listed in `VERIFIED_ON_APPLE`. That set is empty: none of these
kernels has run on Apple hardware yet (see metal/README.md). Environment:
`DFLASH_MLX_KERNELS=reference` forces the twins everywhere;
`DFLASH_MLX_KERNELS=metal` enables the unverified kernels on a Metal machine
(for `tests/test_kernels_metal.py` and `benchmarks/kernels_bench.py`).

Ops
  context_kv    DFlash draft KV injection: k_norm + RoPE + cache layout, all layers
  qmm_small_m   affine-quantized matmul for verify widths M <= 16
  gdn_tape      Gated DeltaNet recurrence over a verify block, recording a tape
  gdn_replay    rebuild the Gated DeltaNet state after an accepted prefix

Engine entry points: `draft_inject` (draft), `quantized_linear` / `qmm_small_m`
(Target.forward and Target.head), `gdn_verify` / `gdn_rewind` (Target's taped
Gated DeltaNet and its rollback).
"""

import math
import os
from importlib import resources
from pathlib import Path
from typing import Callable, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

# Kernels whose Metal path has passed tests/test_kernels_metal.py on an Apple GPU.
VERIFIED_ON_APPLE: frozenset = frozenset()

KERNELS = ("kv_inject", "qmm_small_m", "gdn_tape", "gdn_replay")

# name -> (input names, output names); sources are metal/<name>.metal.
_SPECS = {
    "kv_inject": (["kv", "k_weight", "inv_freq", "offset", "eps", "mscale"], ["k_out", "v_out"]),
    "qmm_small_m": (["x", "w", "scales", "biases"], ["out"]),
    "gdn_tape": (["q", "k", "v", "g", "beta", "state_in", "T"], ["y", "state_out", "tape"]),
    "gdn_replay": (["state_in", "k", "g", "tape", "steps", "T"], ["state_out"]),
}

QMM_MIN_M = 4
QMM_MAX_M = 16
QMM_ROWS = 4  # weight rows per SIMD-group


def mode() -> str:
    """'auto' (default), 'reference' or 'metal' from DFLASH_MLX_KERNELS."""
    m = os.environ.get("DFLASH_MLX_KERNELS", "auto").strip().lower()
    return m if m in ("auto", "reference", "metal") else "auto"


def on_metal() -> bool:
    return mx.metal.is_available()


def use_metal(name: str) -> bool:
    m = mode()
    if m == "reference" or not on_metal():
        return False
    return m == "metal" or name in VERIFIED_ON_APPLE


def kernel_source(name: str) -> str:
    """The body of metal/<name>.metal (installed as the package dflash_mlx.metal)."""
    fname = f"{name}.metal"
    try:
        return resources.files("dflash_mlx.metal").joinpath(fname).read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        # Source checkout without an install: metal/ sits next to dflash_mlx/.
        return (Path(__file__).resolve().parents[2] / "metal" / fname).read_text()


_cache = {}


def _kernel(name: str, factory: Optional[Callable] = None):
    factory = factory or mx.fast.metal_kernel
    key = (name, factory)
    if key not in _cache:
        inputs, outputs = _SPECS[name]
        _cache[key] = factory(
            name=f"dflash_{name}",
            input_names=inputs,
            output_names=outputs,
            source=kernel_source(name),
        )
    return _cache[key]


# ---------------------------------------------------------------------------
# KV injection


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
    return _kernel("kv_inject", factory)(
        inputs=[kv, k_norm_weight, inv_freq, mx.array(int(offset), dtype=mx.int32),
                mx.array(eps, dtype=mx.float32), mx.array(mscale, dtype=mx.float32)],
        template=[("OutT", kv.dtype), ("L", L), ("Hkv", Hkv), ("D", D), ("RD", dims)],
        grid=(32, rows, B * S),
        threadgroup=(32, min(rows, 8), 1),
        output_shapes=[(L, B, Hkv, S, D), (L, B, Hkv, S, D)],
        output_dtypes=[kv.dtype, kv.dtype],
    )


def context_kv(kv, k_norm_weight, offset, *, eps, rope):
    if use_metal("kv_inject"):
        return context_kv_metal(kv, k_norm_weight, offset, eps=eps, rope=rope)
    return context_kv_reference(kv, k_norm_weight, offset, eps=eps, rope=rope)


def stacked_kv_weight(draft) -> mx.array:
    """[L * 2 * Hkv * D, H]: every layer's k_proj then v_proj rows (cached on the draft)."""
    parts = []
    for layer in draft.layers:
        parts += [layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight]
    cached = getattr(draft, "_dflash_kv_stack", None)
    if cached is not None and len(cached[0]) == len(parts) and all(a is b for a, b in zip(cached[0], parts)):
        return cached[1]
    w = mx.concatenate(parts, axis=0)
    object.__setattr__(draft, "_dflash_kv_stack", (parts, w))
    return w


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
    if not all(type(l.self_attn.k_proj) is nn.Linear and type(l.self_attn.v_proj) is nn.Linear
               and "bias" not in l.self_attn.k_proj for l in draft.layers):
        return draft.inject_reference(features, cache)  # quantized/biased projections: keep the draft's path
    offsets = {c.offset for c in cache}
    if len(offsets) != 1:
        raise ValueError("draft_inject: layer caches disagree on the context offset")
    attn = draft.layers[0].self_attn
    h_ctx = draft.fuse(features)
    B = h_ctx.shape[0]
    kv = (h_ctx @ stacked_kv_weight(draft).T).reshape(
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


# ---------------------------------------------------------------------------
# small-M quantized matmul


def qmm_small_m_reference(x, w, scales, biases, group_size: int = 64, bits: int = 4):
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)


def qmm_small_m_metal(x, w, scales, biases, group_size: int = 64, bits: int = 4, factory=None):
    """x: [..., K] with prod(leading) <= 16; w: [N, K * bits / 32] uint32."""
    K = x.shape[-1]
    N = w.shape[0]
    M = math.prod(x.shape[:-1]) if x.ndim > 1 else 1
    if M > QMM_MAX_M or bits not in (2, 4, 8) or K % group_size or group_size < 32:
        raise ValueError(f"qmm_small_m: unsupported M={M} bits={bits} group_size={group_size}")
    if w.shape[1] * 32 // bits != K:
        raise ValueError(f"qmm_small_m: w {w.shape} does not match K={K} at {bits} bits")
    out = _kernel("qmm_small_m", factory)(
        inputs=[x.reshape(M, K), w, scales, biases],
        template=[("T", x.dtype), ("M", M), ("N", N), ("K", K), ("BITS", bits),
                  ("GS", group_size), ("ROWS", QMM_ROWS)],
        grid=(32, -(-N // QMM_ROWS), 1),
        threadgroup=(32, 2, 1),
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )[0]
    return out.reshape(*x.shape[:-1], N)


def qmm_small_m(x, w, scales, biases, group_size: int = 64, bits: int = 4):
    """mx.quantized_matmul(x, w, scales, biases, transpose=True, ...) with the small-M kernel when on.

    The kernel takes verify widths QMM_MIN_M..QMM_MAX_M; narrower products stay
    on MLX's own qmv (tuned for decode), wider ones on its qmm.
    """
    M = math.prod(x.shape[:-1]) if x.ndim > 1 else 1
    if (QMM_MIN_M <= M <= QMM_MAX_M and bits in (2, 4, 8) and group_size >= 32
            and x.shape[-1] % group_size == 0 and use_metal("qmm_small_m")):
        return qmm_small_m_metal(x, w, scales, biases, group_size, bits)
    return qmm_small_m_reference(x, w, scales, biases, group_size, bits)


def quantized_linear(layer, x):
    """`layer(x)` for an affine nn.QuantizedLinear, through qmm_small_m (for a scoped verify hook)."""
    if getattr(layer, "mode", "affine") != "affine":
        return layer(x)
    out = qmm_small_m(x, layer["weight"], layer["scales"], layer.get("biases"),
                      layer.group_size, layer.bits)
    if "bias" in layer:
        out = out + layer["bias"]
    return out


# ---------------------------------------------------------------------------
# Gated DeltaNet tape + replay


def _repeat_heads(x, hv):
    r = hv // x.shape[-2]
    return mx.repeat(x, r, -2) if r > 1 else x


def _decay(g_t):
    return g_t[..., None, None] if g_t.ndim == 2 else g_t[..., None, :]


@mx.compile
def _gdn_tape_step(q_t, k_t, v_t, g_t, beta_t, state):
    """One step of mlx-lm's ops recurrence; also returns the delta (the tape entry)."""
    state = state * _decay(g_t)
    kv_mem = (state * k_t[..., None, :]).sum(axis=-1)
    delta = (v_t - kv_mem) * beta_t[..., None]
    state = state + k_t[..., None, :] * delta[..., None]
    y = (state * q_t[..., None, :]).sum(axis=-1)
    return y.astype(q_t.dtype), state, delta.astype(mx.float32)


def gdn_tape_reference(q, k, v, g, beta, state):
    """The mlx-lm ops recurrence (gated_delta_ops) that also returns the tape.

    q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g: [B, T, Hv] or [B, T, Hv, Dk];
    beta: [B, T, Hv]; state: [B, Hv, Dv, Dk] float32.
    Returns y [B, T, Hv, Dv], final state, tape [B, T, Hv, Dv] float32 (the deltas).
    """
    Hv = v.shape[2]
    q, k = _repeat_heads(q, Hv), _repeat_heads(k, Hv)
    ys, tape = [], []
    for t in range(k.shape[1]):
        y, state, delta = _gdn_tape_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        tape.append(delta)
    return mx.stack(ys, axis=1), state, mx.stack(tape, axis=1)


def gdn_replay_reference(state, k, g, tape, steps: Union[int, mx.array]):
    """State after the first `steps` steps, from the pre-verify state and the tape.

    `steps` may be an mx.array (the accept length straight from the graph): then
    every step is computed and masked, so no host sync is needed.
    """
    Hv = tape.shape[2]
    k = _repeat_heads(k, Hv)
    if isinstance(steps, int):
        for t in range(steps):
            state = state * _decay(g[:, t])
            state = state + k[:, t, :, None, :] * tape[:, t, :, :, None]
        return state
    for t in range(k.shape[1]):
        new = state * _decay(g[:, t])
        new = new + k[:, t, :, None, :] * tape[:, t, :, :, None]
        state = mx.where(t < steps, new, state)
    return state


def gdn_tape_metal(q, k, v, g, beta, state, factory=None):
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    return _kernel("gdn_tape", factory)(
        inputs=[q, k, v, g, beta, state, T],
        template=[("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv),
                  ("Hk", Hk), ("Hv", Hv), ("GVEC", g.ndim == 4)],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape, (B, T, Hv, Dv)],
        output_dtypes=[q.dtype, state.dtype, mx.float32],
    )


def gdn_replay_metal(state, k, g, tape, steps, factory=None):
    B, T, Hk, Dk = k.shape
    Hv, Dv = tape.shape[2:]
    # A 0-d input becomes a `constant int&` kernel argument; a device-side accept
    # length works as is (no host sync).
    steps = mx.array(steps, dtype=mx.int32).reshape(())
    return _kernel("gdn_replay", factory)(
        inputs=[state, k, g, tape, steps, T],
        template=[("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv),
                  ("GVEC", g.ndim == 4)],
        grid=(Dk, Dv, B * Hv),
        threadgroup=(min(Dk, 32), 8, 1),
        output_shapes=[state.shape],
        output_dtypes=[state.dtype],
    )[0]


def gdn_tape(q, k, v, g, beta, state):
    """Verify-time recurrence: (y, state_out, tape). Same contract as gated_delta_ops."""
    if use_metal("gdn_tape"):
        return tuple(gdn_tape_metal(q, k, v, g, beta, state))
    return gdn_tape_reference(q, k, v, g, beta, state)


def gdn_replay(state, k, g, tape, steps):
    """Pre-verify `state` advanced by the first `steps` verify steps (int or mx.array)."""
    if use_metal("gdn_replay"):
        return gdn_replay_metal(state, k, g, tape, steps)
    return gdn_replay_reference(state, k, g, tape, steps)


def gdn_verify(q, k, v, g, beta, state):
    """The recurrence of a verify forward: (y, state_out, deltas or None).

    With the gdn_tape kernel on, or on the CPU (where the twin costs what
    mlx-lm's own ops loop costs), the deltas come for free and a rollback is an
    elementwise replay. On an Apple GPU whose gdn_tape kernel is not verified,
    mlx-lm's fused kernel beats the twin's per-step loop, so it runs instead and
    the rollback re-runs the recurrence (not the layer) over the kept steps.
    """
    Dk = k.shape[-1]
    mlx_lm_kernel = on_metal() and mx.default_device() == mx.gpu and Dk >= 32 and Dk % 32 == 0
    if use_metal("gdn_tape") or not mlx_lm_kernel:
        return tuple(gdn_tape(q, k, v, g, beta, state))
    from mlx_lm.models.gated_delta import gated_delta_kernel

    y, state_out = gated_delta_kernel(q, k, v, g, beta, state)
    return y, state_out, None


def gdn_rewind(state, q, k, v, g, beta, deltas, steps: int):
    """The pre-verify `state` advanced by the first `steps` verify steps (inputs from gdn_verify)."""
    if deltas is not None:
        return gdn_replay(state, k, g, deltas, steps)
    if steps == 0:
        return state
    from mlx_lm.models.gated_delta import gated_delta_kernel

    return gated_delta_kernel(q[:, :steps], k[:, :steps], v[:, :steps], g[:, :steps], beta[:, :steps], state)[1]
