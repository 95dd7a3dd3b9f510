"""The target's ends at the vocabulary: its token embedding in, its LM head out.

`TargetHead` embeds tokens as the model does (with its scale; the draft reuses
it), applies the LM head over the whole vocabulary or a draft's reduced one,
and turns final hidden states into exactly the logits mlx-lm's `Model.__call__`
gives. Where the model's output code does more than a soft-capped head (logit
scaling, multipliers, ...), that code itself runs on the hidden states
(`_HiddenStates`); whether it must is checked once per model.
"""

import weakref
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from dflash_mlx.identity import IdentityMap
from dflash_mlx.kernels import gemv, qmm
from dflash_mlx.models.layout import transposed
from dflash_mlx.models.target.rollback import UnsupportedTargetError
from dflash_mlx.models.target.sharding import gather_vocab, head_group, split_stream
from dflash_mlx.models.target.stand_ins import StandIn, swaps

# Where mlx-lm's text models keep their LM head when untied.
HEAD_NAMES = ("lm_head", "output", "embed_out")


def find_lm_head(model) -> Optional[nn.Module]:
    """The model's untied LM head module, or None (tied: the embedding is the head)."""
    holder = model.language_model if "language_model" in model else model
    return next((holder[n] for n in HEAD_NAMES if isinstance(holder.get(n), nn.Module)), None)


class HeadInsideTextModel(UnsupportedTargetError):
    """The text model applies the LM head itself (`inner_head`): the model returns its output."""


class _HiddenStates(StandIn):
    """Stands in for the text model inside the model's own forward and returns given
    final hidden states, so `Model.__call__` applies exactly its own head and output
    transforms (logit scaling, soft-capping, ...) to them. Attribute reads pass through."""

    def __init__(self, text_model, h):
        self._wrapped = text_model
        self._h = h

    def __call__(self, *args, **kwargs):
        return self._h


# Per model: whether `logits` may compute the logits itself (the LM head, soft-capped)
# or must run the model's own output code on the hidden states (see `_needs_own_head`).
_HEAD_CHECKS = IdentityMap()


class TargetHead:
    """Embedding and LM head of one target model (a `Target` holds one as `vocab`).

    model: the mlx-lm model; text_model / text_parent: its inner text model and
    (parent, key) where the model holds it (None: the model is the text model);
    embed_tokens: the embedding module; lm_head: the untied head, or None.
    """

    # A dense head up to this size gets a transposed copy on the CPU (see _transposed_head).
    MAX_TRANSPOSED_HEAD_BYTES = 1 << 30

    def __init__(self, model, text_model, text_parent, embed_tokens, lm_head, arch: str, hidden_size: int,
                 inner: bool = False):
        self.model = model
        self.text_model = text_model
        self._text_parent = text_parent
        self.embed_tokens = embed_tokens
        self._lm_head = lm_head
        self.arch = arch
        self.hidden_size = hidden_size
        # (Gemma 3n's text model soft-caps its own logits: it holds the cap)
        self.softcap = getattr(model, "final_logit_softcapping", None) or (
            getattr(text_model, "final_logit_softcapping", None) if inner else None)
        # tensor parallel: a head split by vocabulary rows is gathered (`sharding.head_group`)
        self._vocab_group = head_group(lm_head) if lm_head is not None else None
        # (vocab_ids, head weight, rows) of the last reduced draft vocabulary (_head_rows).
        self._rows_cache = None
        # (weak reference to the dense head's weight, its transposed copy, the device) of the last full-vocabulary
        # head, which `head` uses at once while the weight and device are the same (host work a decode step)
        self._dense_head = None
        # inner: the text model applies this head itself, passed through in forwards (`inner_head`),
        # which checked that the head on what comes out is the model's own logits
        self._own_head = False if inner else self._needs_own_head()

    @property
    def embed_tokens_dtype(self):
        w = self.embed_tokens
        return w.scales.dtype if "scales" in w else w.weight.dtype

    def embed(self, ids: mx.array) -> mx.array:
        """The target's input embedding, with its scale (the draft reuses it)."""
        h = self.embed_tokens(ids)
        if self.arch == "gemma3_text":
            h = h * mx.array(self.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        elif self.arch == "gemma4_text":
            h = h * self.text_model.embed_scale
        elif self.arch == "gemma3n_text":
            h = h * (self.hidden_size**0.5)
        return h

    def head(self, h: mx.array, vocab_ids: Optional[mx.array] = None) -> mx.array:
        """Raw LM head (no soft-capping) over the whole vocabulary or over `vocab_ids`.

        An affine-quantized head goes through `qmm.qmm_small_m`, whose
        reference path is exactly the layer's own `mx.quantized_matmul`.
        """
        layer = self._lm_head if self._lm_head is not None else self.embed_tokens
        dense = self._dense_head
        if (vocab_ids is None and dense is not None and dense[0]() is layer.get("weight")
                and dense[2] == mx.default_device()):
            return h @ dense[1]  # (what the lines below resolve to, each decode step, for this weight)
        if "weight" not in layer and "scales" not in layer:  # a head with its own norm (Phixtral's)
            out = layer(h)
            return out if vocab_ids is None else mx.take(out, vocab_ids, axis=-1)
        if self._vocab_group is not None:  # each rank's rows, gathered; then the draft's vocabulary
            with split_stream(True):
                out = gather_vocab(layer(h), self._vocab_group)
            return out if vocab_ids is None else mx.take(out, vocab_ids, axis=-1)
        if vocab_ids is not None:
            w, scales, biases, bias = self._head_rows(layer, vocab_ids)
        else:
            w, scales, biases, bias = layer["weight"], layer.get("scales"), layer.get("biases"), layer.get("bias")
        if scales is not None:  # quantized: the rows keep their packing
            if getattr(layer, "mode", "affine") == "affine":
                out = qmm.qmm_small_m(h, w, scales, biases, layer.group_size, layer.bits)
            else:
                out = mx.quantized_matmul(h, w, scales, biases, transpose=True, group_size=layer.group_size,
                                          bits=layer.bits, mode=layer.mode)
        elif vocab_ids is None:
            wt = self._transposed_head(layer)
            if wt is None and bias is None and gemv.custom_width(h.size // h.shape[-1]):
                return gemv.rows_product(h, w)  # a verify's rows, each as a decode step's own
            if wt is None:
                return self._lm_head(h) if self._lm_head is not None else layer.as_linear(h)
            if bias is None:
                self._dense_head = (weakref.ref(w), wt, mx.default_device())
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
        with swaps() as put:
            put(parent, key, _HiddenStates(self.text_model, h))
            return self.model(mx.zeros(h.shape[:-1], mx.int32))

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
        if ours.shape != theirs.shape and theirs.shape == probe.shape:
            raise HeadInsideTextModel(f"{self.arch}: its text model applies the LM head itself (the model "
                                        "returns its output unchanged), and no step of it passes the final "
                                        "hidden states through to the same logits, so DFlash gets none to "
                                        "apply the head to")
        if ours.shape != theirs.shape:
            raise UnsupportedTargetError(f"{self.arch}: the model's logits have shape {theirs.shape}, "
                                         f"its LM head gives {ours.shape}")
        scale = mx.abs(theirs).max().item() or 1.0
        own = mx.abs(ours - theirs).max().item() > 1e-3 * scale  # rounding apart, they agree
        _HEAD_CHECKS.put((self.model,), own)
        return own
