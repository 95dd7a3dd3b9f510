"""Text models that apply their LM head themselves.

Most mlx-lm text models return final hidden states and their `Model` applies the LM head.
A few apply it inside the text model: GPT-NeoX's `embed_out` after its final norm, Lille's
tied `tok_embeddings.as_linear`, Gemma 3n's tied head followed by its soft cap.
DFlash needs the final hidden states (the draft's features, the split LM head, a reduced draft
vocabulary), so during each forward the head step keeps its input and passes it through (a
stand-in swapped in for the forward, put back after: nothing patches mlx-lm). What the text
model does after the head step (Gemma 3n soft-caps) then runs on the hidden states and is
discarded: `InnerHead.hidden` gives what the head step was handed, and `TargetHead` applies the
same head, and the same soft cap, to it.

Which step is the head is found, not assumed (`find`): each candidate is passed through on a
two-token forward, and kept only where the hidden states it then gives, through the head,
are the model's own logits.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from dflash_mlx.models.target.probe import own_model_fails
from dflash_mlx.models.target.rollback import UnsupportedTargetError
from dflash_mlx.models.target.stand_ins import StandIn, swaps


class _PassThrough(StandIn):
    """Stands in for a head layer inside the text model: keeps its input and returns it."""

    def __init__(self, module, inner: "InnerHead"):
        self._wrapped = module
        self._inner = inner

    def __call__(self, x, *args, **kwargs):
        self._inner.handed = x
        return x


class _EmbeddingWithoutHead(StandIn):
    """Stands in for a tied embedding inside the text model: embeds as it does, but its
    `as_linear` (the head) returns its input."""

    def __init__(self, module, inner: "InnerHead"):
        self._wrapped = module
        self._inner = inner

    def __call__(self, *args, **kwargs):
        return self._wrapped(*args, **kwargs)

    def as_linear(self, x):
        self._inner.handed = x
        return x


@dataclass
class InnerHead:
    """The text model's child that applies the head: `module` itself (a linear layer) or,
    `tied`, the embedding's `as_linear`."""

    name: str
    module: nn.Module
    tied: bool
    handed: Optional[mx.array] = None  # what the head step was handed in the last forward

    def stand_in(self):
        return _EmbeddingWithoutHead(self.module, self) if self.tied else _PassThrough(self.module, self)

    def hidden(self, out: mx.array) -> mx.array:
        """The final hidden states of the forward that returned `out`: what the head step was
        handed (a pipeline rank that did not reach it: `out`)."""
        handed, self.handed = self.handed, None
        return out if handed is None else handed


def candidates(text_model, embedding_name: str, head_names, vocab_size: int) -> List[InnerHead]:
    """Children of the text model that may apply the head: linear layers named as heads with one
    output per token id, then the tied embedding."""
    found = []
    for name in head_names:
        module = text_model.get(name) if name != embedding_name else None
        if isinstance(module, nn.Module) and "weight" in module and module["weight"].shape[0] == vocab_size:
            found.append(InnerHead(name, module, tied=False))
    found.append(InnerHead(embedding_name, text_model[embedding_name], tied=True))
    return found


@contextmanager
def passing_through(text_model, inner: InnerHead):
    """The text model's head step passes its input through for the duration."""
    with swaps() as put:
        put(text_model, inner.name, inner.stand_in())
        yield


def find(model, text_model, found: List[InnerHead], hidden_size: int, vocab_size: int,
         logits_of: Callable[[InnerHead, mx.array], mx.array]) -> Optional[InnerHead]:
    """The candidate that, passed through, leaves final hidden states [.., hidden_size] from which
    `logits_of(candidate, h)` gives the model's own logits (apart from rounding), else None.
    Raises `UnsupportedTargetError` where the model itself fails on two tokens (mlx-lm's OLMo)."""
    tokens = mx.array([[1 % vocab_size, 2 % vocab_size]])
    try:
        theirs = model(tokens).astype(mx.float32)
    except Exception as e:  # nothing to match, and nothing mlx-lm itself decodes (its prefill takes several)
        raise UnsupportedTargetError(own_model_fails(e)) from None
    scale = mx.abs(theirs).max().item() or 1.0
    for inner in found:
        try:
            with passing_through(text_model, inner):
                h = inner.hidden(text_model(tokens))
            if h.shape[-1] != hidden_size:
                continue
            ours = logits_of(inner, h).astype(mx.float32)
        except Exception:  # this candidate is not the head step
            continue
        if ours.shape == theirs.shape and mx.abs(ours - theirs).max().item() <= 1e-3 * scale:
            return inner
    return None


def head_inside(model, text_model, embedding_name: str, head_names, vocab_size: int, hidden_size: int,
                make_head: Callable[[InnerHead], Any]) -> Optional[Tuple[InnerHead, Any]]:
    """(the text model's head step, `make_head(step)`: the head that gives the model's own logits
    from what that step is handed), or None when no candidate does (GPT-NeoX, Lille, Gemma 3n)."""
    heads = {}  # one head a candidate: the one that matches is kept

    def head_of(inner):
        if inner.name not in heads:
            heads[inner.name] = make_head(inner)
        return heads[inner.name]

    found = candidates(text_model, embedding_name, head_names, vocab_size)
    inner = find(model, text_model, found, hidden_size, vocab_size, lambda inner, h: head_of(inner).logits(h))
    return None if inner is None else (inner, head_of(inner))
