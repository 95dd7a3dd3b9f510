"""Target adapters: run an mlx-lm model while tapping the layers DFlash reads,
and roll its caches back after a partial accept.

Nothing here patches mlx-lm classes. Taps are scoped: during one forward the
tapped entries of the model's own `layers` list are swapped for thin wrappers,
and put back in a `finally`. The model's own forward (masks, sliding windows,
shared KV, embedding scales) runs unchanged.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from dflash_mlx import kernels
from dflash_mlx.draft_config import validate_for_target
from dflash_mlx.layout import transposed

SUPPORTED_ARCHS = ("llama", "qwen3", "gemma3_text", "qwen3_5", "gemma4_text")

class UnsupportedTargetError(ValueError):
    pass


class _LayerTap:
    """Stands in for one decoder layer during a forward; attribute reads pass through."""

    def __init__(self, layer, after):
        self._layer = layer
        self._after = after

    def __call__(self, *args, **kwargs):
        out = self._layer(*args, **kwargs)
        self._after(out)
        return out

    def __getattr__(self, name):
        return getattr(self._layer, name)


@dataclass
class GDNTape:
    """What one Gated DeltaNet layer keeps from a verify forward so that a partial
    accept rebuilds its cache from the accepted steps alone (no second forward)."""

    conv_input: mx.array  # [B, K-1+S, C]: the conv state before verify, then the S new conv inputs
    state: mx.array  # [B, Hv, Dv, Dk] recurrent state before verify
    q: mx.array  # [B, S, Hk, Dk] the recurrence's inputs: normalized queries and keys,
    k: mx.array
    v: mx.array  # [B, S, Hv, Dv] values,
    g: mx.array  # [B, S, Hv] (or [B, S, Hv, Dk]) per-step decay,
    beta: mx.array  # [B, S, Hv] write strength
    deltas: Optional[mx.array]  # [B, S, Hv, Dv] float32 per-step updates (v_t - S k_t) * beta_t, if computed


@dataclass
class VerifyRecord:
    """What a verify forward keeps so recurrent layers can be rewound: gdn[layer index] = GDNTape."""

    gdn: Dict[int, GDNTape] = field(default_factory=dict)


class _TapedGatedDeltaNet:
    """Stands in for a Qwen3.5 `GatedDeltaNet` token mixer during verify.

    The same computation as mlx-lm's module for an unpadded batch, except that
    the recurrence is `kernels.gdn_verify` (which also returns the per-step
    deltas where that is free), and the tape is handed to `sink`.
    """

    def __init__(self, mixer, sink):
        self._mixer = mixer
        self._sink = sink

    def __getattr__(self, name):
        return getattr(self._mixer, name)

    def __call__(self, inputs: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        from mlx_lm.models.gated_delta import compute_g, normalize_qk  # only hybrid targets need it

        m = self._mixer
        if mask is not None or cache is None or getattr(cache, "lengths", None) is not None:
            raise UnsupportedTargetError("verify with a taped Gated DeltaNet needs an unpadded batch and a cache")
        B, S, _ = inputs.shape
        qkv = m.in_proj_qkv(inputs)
        z = m.in_proj_z(inputs).reshape(B, S, m.num_v_heads, m.head_v_dim)
        beta = mx.sigmoid(m.in_proj_b(inputs))
        g = compute_g(m.A_log, m.in_proj_a(inputs), m.dt_bias)
        conv_state = cache[0]
        if conv_state is None:
            conv_state = mx.zeros((B, m.conv_kernel_size - 1, m.conv_dim), dtype=inputs.dtype)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        cache[0] = mx.contiguous(conv_input[:, -(m.conv_kernel_size - 1):, :])
        conv_out = nn.silu(m.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [m.key_dim, 2 * m.key_dim], -1),
                [m.num_k_heads, m.num_k_heads, m.num_v_heads],
                [m.head_k_dim, m.head_k_dim, m.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=m.head_k_dim**-0.5, eps=1e-6)
        state = cache[1]
        if state is None:
            state = mx.zeros((B, m.num_v_heads, m.head_v_dim, m.head_k_dim), dtype=mx.float32)
        out, cache[1], deltas = kernels.gdn_verify(q, k, v, g, beta, state)
        cache.advance(S)
        self._sink(GDNTape(conv_input, state, q, k, v, g, beta, deltas))
        out = m.norm(out, z)
        return m.out_proj(out.reshape(B, S, -1))


def _quantized_linears(module) -> List[Tuple[Any, Any, nn.QuantizedLinear]]:
    """(parent, key, layer) for every affine QuantizedLinear under `module` (parent: Module or list)."""
    found = []

    def walk(parent, items):
        for key, child in items:
            if isinstance(child, nn.QuantizedLinear):
                if getattr(child, "mode", "affine") == "affine":
                    found.append((parent, key, child))
            elif isinstance(child, nn.Module):
                walk(child, child.items())
            elif isinstance(child, list):
                walk(child, enumerate(child))

    walk(module, module.items())
    return found


class _SmallMQuantizedLinear:
    """Stands in for one QuantizedLinear during a verify forward: `kernels.quantized_linear`."""

    def __init__(self, layer):
        self._layer = layer

    def __call__(self, x):
        return kernels.quantized_linear(self._layer, x)

    def __getattr__(self, name):
        return getattr(self._layer, name)


def _find_text_model(model):
    """The inner module that owns `embed_tokens` and the `layers` list."""
    for holder in (
        getattr(getattr(model, "language_model", None), "model", None),
        getattr(model, "model", None),
        getattr(model, "language_model", None),
        model,
    ):
        if holder is None:
            continue
        if "embed_tokens" in holder and isinstance(holder.get("layers"), list):
            return holder
    raise UnsupportedTargetError(
        f"cannot find embed_tokens/layers in {type(model).__module__}.{type(model).__name__}"
    )


def _text_args(model):
    args = getattr(model, "args", None)
    lm = getattr(model, "language_model", None)
    if lm is not None and hasattr(lm, "args"):
        args = lm.args
    return args


class Target:
    """A DFlash view of an mlx-lm model (never modifies it)."""

    def __init__(self, model, name: Optional[str] = None):
        self.model = model
        self.args = _text_args(model)
        self.arch = getattr(self.args, "model_type", None) or getattr(model, "model_type", "?")
        if self.arch not in SUPPORTED_ARCHS:
            raise UnsupportedTargetError(
                f"target architecture '{self.arch}' is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
            )
        self.name = name or f"{self.arch} target"
        self.text_model = _find_text_model(model)
        self.hidden_size = self.args.hidden_size
        self.vocab_size = self.args.vocab_size
        self.num_layers = len(self.text_model.layers)
        self.rms_norm_eps = getattr(self.args, "rms_norm_eps", 1e-6)
        self.max_context = getattr(self.args, "max_position_embeddings", None)
        self.softcap = getattr(model, "final_logit_softcapping", None)
        head_holder = model.language_model if "language_model" in model else model
        self._lm_head = head_holder.get("lm_head")
        self._gdn_layers = [
            i for i, layer in enumerate(self.text_model.layers) if getattr(layer, "is_linear", False)
        ]
        if self._gdn_layers:
            from mlx_lm.models.qwen3_5 import GatedDeltaNet

            for i in self._gdn_layers:
                mixer = self.text_model.layers[i].get("linear_attn")
                if not isinstance(mixer, GatedDeltaNet):
                    # _TapedGatedDeltaNet is a port of exactly this module; another mixer needs its own.
                    raise UnsupportedTargetError(
                        f"layer {i}: linear mixer {type(mixer).__name__} is not Qwen3.5's GatedDeltaNet"
                    )
        # (vocab_ids, head weight, rows) of the last reduced draft vocabulary (_head_rows).
        self._rows_cache = None
        # Affine-quantized projections of the decoder layers, for the small-M verify kernel.
        self._quantized = [x for layer in self.text_model.layers for x in _quantized_linears(layer)]

    # -- embedding and head -------------------------------------------------

    def embed(self, ids: mx.array) -> mx.array:
        """The target's input embedding, with its scale (the draft reuses it)."""
        h = self.text_model.embed_tokens(ids)
        if self.arch == "gemma3_text":
            h = h * mx.array(self.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        elif self.arch == "gemma4_text":
            h = h * self.text_model.embed_scale
        return h

    def head(self, h: mx.array, vocab_ids: Optional[mx.array] = None) -> mx.array:
        """Raw LM head (no soft-capping) over the whole vocabulary or over `vocab_ids`.

        An affine-quantized head goes through `kernels.qmm_small_m`, whose
        reference path is exactly the layer's own `mx.quantized_matmul`.
        """
        layer = self._lm_head if self._lm_head is not None else self.text_model.embed_tokens
        if vocab_ids is not None:
            w, scales, biases, bias = self._head_rows(layer, vocab_ids)
        else:
            w, scales, biases, bias = layer["weight"], layer.get("scales"), layer.get("biases"), layer.get("bias")
        if scales is not None:  # quantized: the rows keep their packing
            if getattr(layer, "mode", "affine") == "affine":
                out = kernels.qmm_small_m(h, w, scales, biases, layer.group_size, layer.bits)
            else:
                out = mx.quantized_matmul(h, w, scales, biases, transpose=True, group_size=layer.group_size,
                                          bits=layer.bits, mode=layer.mode)
        elif vocab_ids is None:
            wt = self._transposed_head(layer)
            if wt is None:
                return self._lm_head(h) if self._lm_head is not None else layer.as_linear(h)
            out = h @ wt
        else:
            out = h @ w  # w: the rows, transposed once (see _head_rows)
        if bias is not None:
            out = out + bias
        return out

    def _head_rows(self, layer, vocab_ids: mx.array):
        """The head's rows for a reduced draft vocabulary, gathered once per vocabulary.

        The draft scores its vocabulary every cycle; gathering the rows each time
        would read and copy them twice per cycle. Costs one copy of those rows.
        Dense rows are kept transposed, [H, V_draft] contiguous: the CPU's GEMM
        runs a skinny product 25-40% faster that way than on the transposed view.
        """
        cached = self._rows_cache
        if cached is not None and cached[0] is vocab_ids and cached[1] is layer["weight"]:
            return cached[2]
        take = lambda name: layer[name][vocab_ids] if name in layer else None  # noqa: E731
        rows = (take("weight"), take("scales"), take("biases"), take("bias"))
        if rows[1] is None:
            rows = (mx.contiguous(rows[0].T),) + rows[1:]
        mx.eval([r for r in rows if r is not None])
        self._rows_cache = (vocab_ids, layer["weight"], rows)
        return rows

    # A dense head up to this size gets a transposed copy on the CPU (see _transposed_head).
    MAX_TRANSPOSED_HEAD_BYTES = 1 << 30

    def _transposed_head(self, layer) -> Optional[mx.array]:
        """The whole dense head as [H, V] contiguous, on the CPU backend only, else None.

        The CPU's GEMM runs the product of a few rows with the [V, H] head 1.5-1.9x
        faster on a contiguous transposed copy than on the transposed view (measured
        for SmolLM2's 49152 x 576 head: 34 -> 18 ms for one row, 41 -> 26 ms for 16):
        the head is a third of a one-token forward there. It costs one copy of the
        head; a GPU reads the view at full speed, so there it is not made.
        """
        w = layer["weight"]
        if mx.default_device() != mx.cpu or w.nbytes > self.MAX_TRANSPOSED_HEAD_BYTES:
            return None
        # Kept per weight for the process (every Target of the model shares it; plain
        # decoding makes a Target per call); an untied lm_head laid out at load needs no copy.
        return transposed(w)

    def logits(self, h: mx.array) -> mx.array:
        """The logits mlx-lm's `Model.__call__` produces from final hidden states (on the
        CPU through the transposed head copy: the same products, summed in another order)."""
        out = self.head(h)
        if self.softcap:
            out = mx.tanh(out / self.softcap) * self.softcap
        return out

    # -- caches ---------------------------------------------------------------

    def make_cache(self) -> List[Any]:
        return make_prompt_cache(self.model)

    @property
    def recurrent(self) -> bool:
        return bool(self._gdn_layers)

    # -- forward with taps ------------------------------------------------------

    @contextmanager
    def _taps(self, layer_ids: Sequence[int], features: List, record: Optional[VerifyRecord], small_m: bool):
        layers = self.text_model.layers
        slot: Dict[int, List[int]] = {}
        for i, lid in enumerate(layer_ids):  # an id may repeat (small targets)
            slot.setdefault(lid, []).append(i)

        def make_tap(idx, layer):
            def after(out):
                for i in slot.get(idx, ()):
                    features[i] = out[0] if isinstance(out, tuple) else out

            return _LayerTap(layer, after)

        def make_sink(idx):
            def sink(tape):
                record.gdn[idx] = tape

            return sink

        # (container, key, original) for everything swapped; restored in reverse.
        swapped = []
        try:
            if record is not None:
                for idx in self._gdn_layers:
                    layer = layers[idx]
                    swapped.append((layer, "linear_attn", layer["linear_attn"]))
                    layer["linear_attn"] = _TapedGatedDeltaNet(layer["linear_attn"], make_sink(idx))
            if small_m:
                for parent, key, q in self._quantized:
                    swapped.append((parent, key, q))
                    parent[key] = _SmallMQuantizedLinear(q)
            for idx in slot:
                swapped.append((layers, idx, layers[idx]))
                layers[idx] = make_tap(idx, layers[idx])
            yield
        finally:
            for container, key, original in reversed(swapped):
                container[key] = original

    def forward(
        self,
        tokens: mx.array,
        cache: List[Any],
        layer_ids: Sequence[int] = (),
        record: bool = False,
    ) -> Tuple[mx.array, Optional[mx.array], Optional[VerifyRecord]]:
        """tokens: [B, S] -> final hidden [B, S, H], features [B, S, n*H] (None if no taps), record.

        `record=True` marks a verify forward: Gated DeltaNet layers run taped
        (the VerifyRecord `rollback` replays). A quantized target's projections
        go through the small-M kernel when it is on and B*S fits its widths.
        """
        features = [None] * len(layer_ids)
        rec = VerifyRecord() if (record and self.recurrent) else None
        width = tokens.shape[0] * tokens.shape[1]
        small_m = (bool(self._quantized) and kernels.QMM_MIN_M <= width <= kernels.QMM_MAX_M
                   and kernels.use_metal("qmm_small_m"))
        with self._taps(layer_ids, features, rec, small_m):
            h = self.text_model(tokens, cache=cache)
        feats = mx.concatenate(features, axis=-1) if layer_ids else None
        return h, feats, rec

    # -- rollback ---------------------------------------------------------------

    def rollback(self, cache: List[Any], num_tokens: int, num_rejected: int, record: Optional[VerifyRecord]):
        """Undo the last `num_rejected` of the `num_tokens` tokens the last forward fed.

        One path per cache kind: KVCache trims; RotatingKVCache (filled by a
        multi-token update, so its buffer is in temporal order) drops its tail,
        which stays correct after the window wraps; Gated DeltaNet state is
        replayed from the pre-verify state over the accepted steps of the tape.
        """
        if num_rejected <= 0:
            return
        keep = num_tokens - num_rejected
        for idx, c in enumerate(cache):
            if isinstance(c, RotatingKVCache):
                rollback_rotating(c, num_rejected)
            elif isinstance(c, ArraysCache):
                replay_gdn(c, record.gdn[idx], keep)
            elif isinstance(c, KVCache) or (hasattr(c, "trim") and c.is_trimmable()):
                c.trim(num_rejected)
            else:
                raise UnsupportedTargetError(f"cannot roll back cache of type {type(c).__name__}")


def rollback_rotating(c: RotatingKVCache, n: int):
    if c._idx != c.keys.shape[2]:
        raise RuntimeError(
            "RotatingKVCache rollback expects the buffer left by a multi-token update; "
            "verify feeds at least two tokens whenever there is something to reject"
        )
    c.keys = c.keys[..., : c._idx - n, :]
    c.values = c.values[..., : c._idx - n, :]
    c.offset -= n
    c._idx -= n


def replay_gdn(c: ArraysCache, tape: GDNTape, keep: int):
    """Set a Gated DeltaNet cache to what feeding only the first `keep` verify tokens gives.

    Conv state: the last K-1 conv inputs up to the kept ones. Recurrent state:
    the pre-verify state advanced by the first `keep` taped steps (no layer runs).
    """
    n_conv = tape.conv_input.shape[1] - tape.k.shape[1]  # K - 1
    c[0] = mx.contiguous(tape.conv_input[:, keep : keep + n_conv])
    c[1] = kernels.gdn_rewind(tape.state, tape.q, tape.k, tape.v, tape.g, tape.beta, tape.deltas, keep)


def target_for(model, draft) -> Target:
    """The `Target` adapter a draft is bound to for `model`; binds (and checks) a draft bound elsewhere."""
    target = getattr(draft, "target", None)
    if target is not None and target.model is model:
        return target
    target = Target(model)
    if draft is not None:
        if hasattr(draft, "config"):
            validate_for_target(draft.config, target)
        draft.bind(target)
    return target
