"""Where an mlx-lm model keeps the parts DFlash reads: its text model, the decoder layers, the
token embedding, and the text model's arguments (a wrapper's nested config).

mlx-lm has no one place for them: a text model sits at `model`, `language_model`, `backbone` or
`transformer`, one or two levels down; its layers are `layers`, `h` or `blocks` (or a decoder
module holding `layers`); its embedding goes by eleven names. `find_text_model` takes the innermost
module holding both; a model with neither is refused in one line naming what was looked for.
"""

import inspect
from typing import Any, Optional, Tuple

import mlx.nn as nn

from dflash_mlx.models.target.rollback import UnsupportedTargetError

# Where mlx-lm's text models keep their token embedding, and their decoder layers.
EMBEDDING_NAMES = ("embed_tokens", "embeddings", "wte", "tok_embeddings", "word_embeddings", "embed_in", "embedding",
                   "token_embeddings", "embed", "ngram_embeddings", "embd")
LAYER_LIST_NAMES = ("layers", "h", "blocks")


def find_text_model(model) -> Tuple[Any, Optional[Tuple[Any, str]]]:
    """(the inner module that owns the token embedding and the decoder `layers` list,
    (its parent, the parent's key for it) or None when it is the model itself)."""
    candidates = [(model, None)]
    for key in ("language_model", "model", "backbone", "transformer"):
        child = model.get(key) if isinstance(model, nn.Module) else None
        if isinstance(child, nn.Module):
            candidates.append((child, (model, key)))
            for inner_key in ("model", "backbone", "transformer", "language_model"):
                inner = child.get(inner_key)
                if isinstance(inner, nn.Module):
                    candidates.append((inner, (child, inner_key)))
    for holder, parent in reversed(candidates):  # innermost first
        if layer_list(holder) is not None and any(n in holder for n in EMBEDDING_NAMES):
            return holder, parent
    raise UnsupportedTargetError(
        f"cannot find the decoder layers and token embedding of {type(model).__module__}.{type(model).__name__}: "
        f"DFlash taps a list named {' or '.join(LAYER_LIST_NAMES)} next to one of {', '.join(EMBEDDING_NAMES)}"
    )


def layer_list(holder) -> Optional[list]:
    """The decoder layers: `holder.layers` (GPT-2 style: `h`, DBRX: `blocks`), or the list inside
    a decoder module there (PLaMo 2)."""
    layers = next((holder[n] for n in LAYER_LIST_NAMES if n in holder), None)
    if isinstance(layers, nn.Module):
        layers = layers.get("layers")
    return layers if isinstance(layers, list) else None


def token_embedding(module):
    """The token table the draft embeds with: the module, or the one an embedding that adds more
    to it holds (LongCat's n-gram embedding: `word_embeddings`, plus hashed n-grams of the context),
    or wraps (Phixtral's `embd.wte`)."""
    inner = next((module[n] for n in EMBEDDING_NAMES if "weight" not in module and n in module), None)
    return inner if inner is not None else module


def text_args(model, text_model):
    """The text model's arguments (`model_type`, `hidden_size`, ...): the model's own, a wrapper's
    text config, or, where a wrapper keeps that as a dict, the text model's."""
    args = getattr(model, "args", None)
    lm = getattr(model, "language_model", None)
    if lm is not None and hasattr(lm, "args"):
        args = lm.args
    for key in ("text_config", "text"):  # a wrapper whose arguments nest the text model's
        inner = getattr(args, key, None)
        if inner is not None and hasattr(inner, "hidden_size"):
            args = inner
    if not hasattr(args, "hidden_size"):  # a wrapper that keeps them as a dict (Gemma 3n): the text model's own
        own = getattr(text_model, "args", None) or getattr(text_model, "config", None)
        if hasattr(own, "hidden_size"):
            args = own
    return args


def takes_mask(text_model) -> bool:
    """Whether the text model's forward needs the attention mask handed in (Phixtral's `Model`
    makes it from the tokens and the first cache, as mlx-lm's `create_attention_mask`)."""
    parameter = inspect.signature(type(text_model).__call__).parameters.get("mask")
    return parameter is not None and parameter.default is inspect.Parameter.empty
