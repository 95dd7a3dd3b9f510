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
from mlx_lm.models.base import create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

SUPPORTED_ARCHS = ("llama", "qwen3", "gemma3_text", "qwen3_5", "gemma4_text")


class UnsupportedTargetError(ValueError):
    pass


class _LayerTap:
    """Stands in for one decoder layer during a forward; attribute reads pass through."""

    def __init__(self, layer, before, after):
        self._layer = layer
        self._before = before
        self._after = after

    def __call__(self, *args, **kwargs):
        self._before(args, kwargs)
        out = self._layer(*args, **kwargs)
        self._after(out)
        return out

    def __getattr__(self, name):
        return getattr(self._layer, name)


@dataclass
class VerifyRecord:
    """What a forward needs kept so a recurrent layer can be rewound.

    gdn[i] = (layer, layer input x [B, S, H], (conv_state, recurrent_state) before the forward)
    """

    gdn: Dict[int, Tuple[Any, mx.array, List[Optional[mx.array]]]] = field(default_factory=dict)


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
        """Raw LM head (no soft-capping) over the whole vocabulary or over `vocab_ids`."""
        if vocab_ids is None:
            if self._lm_head is not None:
                return self._lm_head(h)
            return self.text_model.embed_tokens.as_linear(h)
        layer = self._lm_head if self._lm_head is not None else self.text_model.embed_tokens
        if "scales" in layer:  # quantized: take the rows, keep the packing
            w = layer.weight[vocab_ids]
            scales, biases = layer.scales[vocab_ids], layer.get("biases")
            biases = biases[vocab_ids] if biases is not None else None
            return mx.quantized_matmul(
                h, w, scales, biases, transpose=True, group_size=layer.group_size, bits=layer.bits
            )
        return h @ layer.weight[vocab_ids].T

    def logits(self, h: mx.array) -> mx.array:
        """Exactly the logits mlx-lm's `Model.__call__` produces from final hidden states."""
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
    def _taps(self, layer_ids: Sequence[int], features: List, record: Optional[VerifyRecord], cache):
        layers = self.text_model.layers
        slot: Dict[int, List[int]] = {}
        for i, lid in enumerate(layer_ids):  # an id may repeat (small targets)
            slot.setdefault(lid, []).append(i)
        recorded = set(self._gdn_layers) if record is not None else set()

        def make_tap(idx, layer):
            def before(args, kwargs):
                if idx in recorded:
                    x = args[0] if args else kwargs["x"]
                    record.gdn[idx] = (layer, x, list(cache[idx].cache))

            def after(out):
                for i in slot.get(idx, ()):
                    features[i] = out[0] if isinstance(out, tuple) else out

            return _LayerTap(layer, before, after)

        originals = {}
        try:
            for idx in set(slot) | recorded:
                originals[idx] = layers[idx]
                layers[idx] = make_tap(idx, originals[idx])
            yield
        finally:
            for idx, layer in originals.items():
                layers[idx] = layer

    def forward(
        self,
        tokens: mx.array,
        cache: List[Any],
        layer_ids: Sequence[int] = (),
        record: bool = False,
    ) -> Tuple[mx.array, Optional[mx.array], Optional[VerifyRecord]]:
        """tokens: [B, S] -> final hidden [B, S, H], features [B, S, n*H] (None if no taps), record."""
        features = [None] * len(layer_ids)
        rec = VerifyRecord() if (record and self.recurrent) else None
        with self._taps(layer_ids, features, rec, cache):
            h = self.text_model(tokens, cache=cache)
        feats = mx.concatenate(features, axis=-1) if layer_ids else None
        return h, feats, rec

    # -- rollback ---------------------------------------------------------------

    def rollback(self, cache: List[Any], num_tokens: int, num_rejected: int, record: Optional[VerifyRecord]):
        """Undo the last `num_rejected` of the `num_tokens` tokens the last forward fed.

        One path per cache kind: KVCache trims; RotatingKVCache (filled by a
        multi-token update, so its buffer is in temporal order) drops its tail,
        which stays correct after the window wraps; Gated DeltaNet state is
        re-run from the pre-forward state over the accepted inputs only.
        """
        if num_rejected <= 0:
            return
        keep = num_tokens - num_rejected
        for idx, c in enumerate(cache):
            if isinstance(c, RotatingKVCache):
                rollback_rotating(c, num_rejected)
            elif isinstance(c, ArraysCache):
                layer, x, state = record.gdn[idx]
                rerun_gdn(layer, x[:, :keep], c, state)
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


def rerun_gdn(layer, x_keep: mx.array, c: ArraysCache, state_before: List[Optional[mx.array]]):
    """Restore the conv + recurrent state, then advance it over the accepted inputs only.

    `x_keep` is the layer input for the accepted positions; the layer's token
    mixer is re-applied to them (outputs discarded) from the pre-verify state,
    which is exactly the state feeding only the accepted tokens would give.
    """
    c.cache = list(state_before)
    if x_keep.shape[1] == 0:
        return
    h = layer.input_layernorm(x_keep)
    layer.linear_attn(h, create_ssm_mask(h, c), c)
