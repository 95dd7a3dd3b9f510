"""Target adapters: run an mlx-lm model while tapping the layers DFlash reads,
and roll its caches back after a partial accept (the rollback of each cache kind:
`dflash_mlx/models/target/rollback.py`).

Nothing here patches mlx-lm classes. Taps are scoped: during one forward the
tapped entries of the model's own `layers` list are swapped for thin wrappers,
and put back in a `finally`. The model's own forward (masks, sliding windows,
shared KV, embedding scales) runs unchanged.
"""

from contextlib import contextmanager
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, CacheList, make_prompt_cache

from dflash_mlx.kernels import selection
from dflash_mlx.models.draft.config import validate_for_target
from dflash_mlx.identity import IdentityMap
from dflash_mlx.models.layout import transposed
from dflash_mlx.speculation.tree import TreeRoPE, rope_slots, tree_caches
from dflash_mlx.models.target.rollback import (
    UnsupportedTargetError, VerifyRecord, ReplayTap, StandIn, TapedGatedDeltaNet, gdn_class,
    recorded_apart, sub_caches, replay_gdn, replay_layer, rollback_cache, rollback_kind,
)

# Where mlx-lm's text models keep their token embedding, and their LM head when untied.
EMBEDDING_NAMES = ("embed_tokens", "embeddings", "wte", "tok_embeddings", "word_embeddings")
HEAD_NAMES = ("lm_head", "output", "embed_out")


class _LayerTap(StandIn):
    """Stands in for one decoder layer during a forward and hands its output to `after`."""

    def __init__(self, layer, after):
        self._wrapped = layer
        self._after = after

    def __call__(self, *args, **kwargs):
        out = self._wrapped(*args, **kwargs)
        self._after(out)
        return out


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


class _SmallMQuantizedLinear(StandIn):
    """Stands in for one QuantizedLinear during a verify forward: `selection.quantized_linear`."""

    def __init__(self, layer):
        self._wrapped = layer

    def __call__(self, x):
        return selection.quantized_linear(self._wrapped, x)


def _find_text_model(model) -> Tuple[Any, Optional[Tuple[Any, str]]]:
    """(the inner module that owns the token embedding and the decoder `layers` list,
    (its parent, the parent's key for it) or None when it is the model itself)."""
    candidates = [(model, None)]
    for key in ("language_model", "model", "backbone", "transformer"):
        child = model.get(key) if isinstance(model, nn.Module) else None
        if isinstance(child, nn.Module):
            candidates.append((child, (model, key)))
            for inner_key in ("model", "backbone", "transformer"):
                inner = child.get(inner_key)
                if isinstance(inner, nn.Module):
                    candidates.append((inner, (child, inner_key)))
    for holder, parent in reversed(candidates):  # innermost first
        if _layer_list(holder) is not None and any(n in holder for n in EMBEDDING_NAMES):
            return holder, parent
    raise UnsupportedTargetError(
        f"cannot find the decoder layers and token embedding of {type(model).__module__}.{type(model).__name__}: "
        f"DFlash taps a `layers` list next to one of {', '.join(EMBEDDING_NAMES)}"
    )


def _layer_list(holder) -> Optional[list]:
    """The decoder layers: `holder.layers`, or the list inside a decoder module there (PLaMo 2)."""
    layers = holder.get("layers")
    if isinstance(layers, nn.Module):
        layers = layers.get("layers")
    return layers if isinstance(layers, list) else None


def _text_args(model):
    args = getattr(model, "args", None)
    lm = getattr(model, "language_model", None)
    if lm is not None and hasattr(lm, "args"):
        args = lm.args
    for key in ("text_config", "text"):  # a wrapper whose arguments nest the text model's
        inner = getattr(args, key, None)
        if inner is not None and hasattr(inner, "hidden_size"):
            args = inner
    return args


class _HiddenStates(StandIn):
    """Stands in for the text model inside the model's own forward and returns given
    final hidden states, so `Model.__call__` applies exactly its own head and output
    transforms (logit scaling, soft-capping, ...) to them. Attribute reads pass through."""

    def __init__(self, text_model, h):
        self._wrapped = text_model
        self._h = h

    def __call__(self, *args, **kwargs):
        return self._h


# Per model: whether `Target.logits` may compute the logits itself (the LM head, soft-capped)
# or must run the model's own output code on the hidden states (see `Target._own_head`).
_HEAD_CHECKS = IdentityMap()


class Target:
    """A DFlash view of an mlx-lm model (never modifies it).

    Any mlx-lm text model runs if its decoder layers can be tapped and every cache it
    makes has a rollback path (`rollback_kind`); otherwise construction fails naming the
    layer and the cache kind.
    """

    def __init__(self, model, name: Optional[str] = None):
        self.model = model
        self.args = _text_args(model)
        self.arch = getattr(self.args, "model_type", None) or getattr(model, "model_type", "?")
        self.name = name or f"{self.arch} target"
        self.text_model, self._text_parent = _find_text_model(model)
        self.layers = _layer_list(self.text_model)  # the model's own list: taps swap its entries
        self.embed_tokens = next(self.text_model[n] for n in EMBEDDING_NAMES if n in self.text_model)
        self.hidden_size = getattr(self.args, "hidden_size", None) or self.embed_tokens.weight.shape[1]
        self.vocab_size = getattr(self.args, "vocab_size", None) or self.embed_tokens.weight.shape[0]
        self.num_layers = len(self.layers)
        self.rms_norm_eps = getattr(self.args, "rms_norm_eps", 1e-6)
        self.max_context = getattr(self.args, "max_position_embeddings", None)
        self.softcap = getattr(model, "final_logit_softcapping", None)
        head_holder = model.language_model if "language_model" in model else model
        self._lm_head = next((head_holder[n] for n in HEAD_NAMES if isinstance(head_holder.get(n), nn.Module)),
                             None)
        self._gdn_layers = [
            i for i, layer in enumerate(self.layers)  # (qwen3_5 is imported only for a model with linear layers)
            if "linear_attn" in layer and isinstance(layer["linear_attn"], gdn_class())
        ]
        # (vocab_ids, head weight, rows) of the last reduced draft vocabulary (_head_rows).
        self._rows_cache = None
        # Affine-quantized projections of the decoder layers, for the small-M verify kernel.
        self._quantized = [x for layer in self.layers for x in _quantized_linears(layer)]
        self._replay_kinds = self._check_caches()
        self._own_head = self._needs_own_head()
        self._rope_slots = None

    def _check_caches(self) -> List[Optional[str]]:
        """Each cache entry's rollback ("trim" | "gdn" | "replay"); refuses what has none."""
        kinds = []
        for i, c in enumerate(self.make_cache()):
            kind = rollback_kind(c)
            if kind is None:
                parts = "/".join(type(s).__name__ for s in sub_caches(c))
                raise UnsupportedTargetError(
                    f"{self.arch}: cache {i} ({parts}) cannot be rolled back after a partial accept: it has no "
                    "trim (attention KV) and is not a recurrent state (mlx-lm's ArraysCache) that can be "
                    "restored and replayed; it needs a rollback path in dflash_mlx/models/target/adapter.py"
                )
            if kind == "replay" and i in self._gdn_layers and isinstance(c, ArraysCache):
                kind = "gdn"  # the taped Gated DeltaNet: rewound without running the layer again
            kinds.append(kind)
        return kinds

    def _needs_own_head(self) -> bool:
        """Whether the model's output differs from the soft-capped LM head on the same
        hidden states (logit scaling, multipliers, ...): then `logits` runs the model's own
        output code (`_HiddenStates`), which is exact by construction. Checked once per model."""
        known = _HEAD_CHECKS.get((self.model,))
        if known is not None:
            return known
        probe = mx.random.normal((1, 2, self.hidden_size), key=mx.random.key(0)).astype(mx.float32)
        # Logits as large as real ones get (~64): a soft cap of 30 is near the identity on
        # small logits and would pass unnoticed.
        probe = probe * (64.0 / (mx.abs(self.head(probe.astype(self.embed_tokens_dtype))).max().item() or 1.0))
        probe = probe.astype(self.embed_tokens_dtype)
        ours = self.logits(probe, own_head=False).astype(mx.float32)
        theirs = self._model_logits(probe).astype(mx.float32) if self._text_parent is not None else ours
        if ours.shape != theirs.shape:
            raise UnsupportedTargetError(f"{self.arch}: the model's logits have shape {theirs.shape}, "
                                         f"its LM head gives {ours.shape}")
        scale = mx.abs(theirs).max().item() or 1.0
        own = mx.abs(ours - theirs).max().item() > 1e-3 * scale  # rounding apart, they agree
        _HEAD_CHECKS.put((self.model,), own)
        return own

    @property
    def embed_tokens_dtype(self):
        w = self.embed_tokens
        return w.scales.dtype if "scales" in w else w.weight.dtype

    # -- embedding and head -------------------------------------------------

    def embed(self, ids: mx.array) -> mx.array:
        """The target's input embedding, with its scale (the draft reuses it)."""
        h = self.embed_tokens(ids)
        if self.arch == "gemma3_text":
            h = h * mx.array(self.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        elif self.arch == "gemma4_text":
            h = h * self.text_model.embed_scale
        return h

    def head(self, h: mx.array, vocab_ids: Optional[mx.array] = None) -> mx.array:
        """Raw LM head (no soft-capping) over the whole vocabulary or over `vocab_ids`.

        An affine-quantized head goes through `selection.qmm_small_m`, whose
        reference path is exactly the layer's own `mx.quantized_matmul`.
        """
        layer = self._lm_head if self._lm_head is not None else self.embed_tokens
        if vocab_ids is not None:
            w, scales, biases, bias = self._head_rows(layer, vocab_ids)
        else:
            w, scales, biases, bias = layer["weight"], layer.get("scales"), layer.get("biases"), layer.get("bias")
        if scales is not None:  # quantized: the rows keep their packing
            if getattr(layer, "mode", "affine") == "affine":
                out = selection.qmm_small_m(h, w, scales, biases, layer.group_size, layer.bits)
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

    def logits(self, h: mx.array, own_head: Optional[bool] = None) -> mx.array:
        """The logits mlx-lm's `Model.__call__` produces from final hidden states (on the
        CPU through the transposed head copy: the same products, summed in another order).
        A model whose output code does more than a soft-capped head runs that code itself."""
        if self._own_head if own_head is None else own_head:
            return self._model_logits(h)
        out = self.head(h)
        if self.softcap:
            out = mx.tanh(out / self.softcap) * self.softcap
        return out

    def _model_logits(self, h: mx.array) -> mx.array:
        """`Model.__call__` on final hidden states `h` [B, S, H]: its text model swapped for
        `_HiddenStates` for the duration of the call."""
        parent, key = self._text_parent
        parent[key] = _HiddenStates(self.text_model, h)
        try:
            return self.model(mx.zeros(h.shape[:-1], mx.int32))
        finally:
            parent[key] = self.text_model

    # -- caches ---------------------------------------------------------------

    def make_cache(self) -> List[Any]:
        return make_prompt_cache(self.model)

    @property
    def recurrent(self) -> bool:
        """Whether some cache holds recurrent state (it cannot be trimmed back to a prefix)."""
        return any(kind != "trim" for kind in self._replay_kinds)

    @property
    def rope_slots(self) -> List[Tuple[Any, Any]]:
        """(parent, key) of every rotary embedding in the decoder layers (for tree verifies)."""
        if self._rope_slots is None:
            self._rope_slots = rope_slots(self.layers)
        return self._rope_slots

    def rollback_kinds(self) -> List[str]:
        """Each cache entry's rollback path: "trim", "gdn" (taped replay) or "replay" (re-run)."""
        return list(self._replay_kinds)

    # -- forward with taps ------------------------------------------------------

    @contextmanager
    def _taps(self, layer_ids: Sequence[int], features: List, record: Optional[VerifyRecord], small_m: bool,
              cache: List[Any], tree=None):
        layers = self.layers
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

        def keep_replay(entry):
            record.replay[id(entry.cache)] = entry

        # (container, key, original) for everything swapped; restored in reverse.
        swapped = []
        try:
            if record is not None:
                for idx in self._gdn_layers:
                    layer = layers[idx]
                    swapped.append((layer, "linear_attn", layer["linear_attn"]))
                    layer["linear_attn"] = TapedGatedDeltaNet(layer["linear_attn"], make_sink(idx))
                replayed = [c for c, kind in zip(cache, self._replay_kinds) if kind == "replay"]
                watched = {id(c): c for c in replayed}
                # recurrent state beside attention in one CacheList (Falcon-H1): the module the
                # layer hands that state to is recorded too, so a rollback re-runs that module
                # alone and the attention beside it is trimmed (per row in a batch)
                inner = {id(s): s for c in replayed if isinstance(c, CacheList)
                         for s in c.caches if isinstance(s, ArraysCache)}
                if watched:
                    # which layer gets which cache is the model's business: every layer is
                    # watched, and one handed a watched cache records its call
                    for idx in range(len(layers)):
                        layer = layers[idx]
                        if inner:
                            for name, child in list(layer.children().items()):
                                if isinstance(child, nn.Module):
                                    swapped.append((layer, name, child))
                                    layer[name] = ReplayTap(child, inner, keep_replay)
                        swapped.append((layers, idx, layer))
                        layers[idx] = ReplayTap(layer, watched, keep_replay)
            if small_m:
                for parent, key, q in self._quantized:
                    swapped.append((parent, key, q))
                    parent[key] = _SmallMQuantizedLinear(q)
            if tree is not None:
                for parent, key in self.rope_slots:
                    swapped.append((parent, key, parent[key]))
                    parent[key] = TreeRoPE(parent[key], tree)
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
        tree=None,
    ) -> Tuple[mx.array, Optional[mx.array], Optional[VerifyRecord]]:
        """tokens: [B, S] -> final hidden [B, S, H], features [B, S, n*H] (None if no taps), record.

        `record=True` marks a verify forward: Gated DeltaNet layers run taped and the
        layers holding other recurrent state are recorded (the VerifyRecord `rollback`
        replays). A quantized target's projections go through the small-M kernel when
        it is on and B*S fits its widths. `tree` (a `token_tree.TokenTree` of S nodes):
        the tokens are its nodes, each seeing its ancestors at the position of its depth
        (the caches' masks and the rotary embeddings are swapped for the call).
        """
        features = [None] * len(layer_ids)
        rec = VerifyRecord() if (record and self.recurrent) else None
        width = tokens.shape[0] * tokens.shape[1]
        small_m = (bool(self._quantized) and selection.QMM_MIN_M <= width <= selection.QMM_MAX_M
                   and selection.use_metal("qmm_small_m"))
        with self._taps(layer_ids, features, rec, small_m, cache, tree):
            h = self.text_model(tokens, cache=cache if tree is None else tree_caches(cache, tree))
        feats = mx.concatenate(features, axis=-1) if layer_ids else None
        return h, feats, rec

    # -- rollback ---------------------------------------------------------------

    def rollback(self, cache: List[Any], num_tokens: int, num_rejected: int, record: Optional[VerifyRecord]):
        """Undo the last `num_rejected` of the `num_tokens` tokens the last forward fed.

        One path per cache kind (`rollback_kind`): attention caches trim (`rollback_cache`);
        a Qwen3.5 Gated DeltaNet state is replayed from the pre-verify state over the
        accepted steps of its tape (`replay_gdn`); any other cache that holds recurrent
        state is restored to its pre-verify state and its layer runs again on the kept
        tokens (`replay_layer`).
        """
        if num_rejected <= 0:
            return
        keep = num_tokens - num_rejected
        for idx, (c, kind) in enumerate(zip(cache, self._replay_kinds)):
            if kind == "trim":
                rollback_cache(c, num_rejected)
            elif kind == "gdn":
                replay_gdn(c, record.gdn[idx], keep)
            elif recorded_apart(c, record):
                for sub in sub_caches(c):
                    if isinstance(sub, ArraysCache):
                        replay_layer(record.replay[id(sub)], num_tokens, keep)
                    else:
                        rollback_cache(sub, num_rejected)
            elif id(c) in record.replay:
                replay_layer(record.replay[id(c)], num_tokens, keep)
            else:
                raise RuntimeError(f"cache {idx} ({type(c).__name__}) was not fed by the verify forward")


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
