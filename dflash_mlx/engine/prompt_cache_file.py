"""A prompt cache in a file, in mlx-lm's format, with the draft's context beside the target's caches.

mlx-lm's `cache_prompt` saves the caches a prompt left (`save_prompt_cache`) and its `generate
--prompt-cache-file` answers after them, feeding only the text that follows. `save_prompt_cache` here
writes the same file: mlx-lm's list of the target's cache states, and after them one more element of that
list, the draft's context K/V (the features the draft had not absorbed absorbed first), to which mlx-lm's
metadata gives no class, so mlx-lm's loader leaves it out and its models see their own caches alone. The
metadata keeps mlx-lm's keys ("model", "tokenizer_config") and ours under "dflash_mlx": the prompt's
tokens, a fingerprint of the target's weights, and the shape of the draft part.

So mlx-lm reads our files, and `load_prompt_cache` reads mlx-lm's. Such a file does not hold its tokens:
they stay unknown (copies skip them, and a new prompt must start with `PromptCache.tokens`' placeholders,
as `continued` builds it), and the draft starts cold: its context is what comes after the file. Logits
processors (penalties) see the tokens after the file's, as mlx-lm's generate does with a prompt cache file.

What a file holds is checked against the model before it is used: the kinds of its caches and their
shapes (a one-token probe of the target's own), and, for our files, the fingerprint: a file of another
model (or dtype, or adapter) is refused in one line rather than decoded into wrong tokens.
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache

from dflash_mlx.engine.prompt_cache import PromptCache, make_prompt_cache
from dflash_mlx.models.target.adapter import target_for
from dflash_mlx.models.target.kv_window import KEEP, bounds, make_window_cache

KEY = "dflash_mlx"
FORMAT = 1
UNKNOWN_TOKEN = 0  # the placeholder of a token an mlx-lm file does not name (never read: see `known_from`)


@dataclass
class CacheFileInfo:
    """What `load_prompt_cache` found in a file."""

    model: Optional[str]  # the model it names (mlx-lm's "model" key), None if it names none
    tokenizer_config: Dict[str, Any] = field(default_factory=dict)
    tokens_known: bool = True  # False: an mlx-lm file (placeholders in `PromptCache.tokens`)
    draft_context: str = "none"  # "restored", "cold" (no context for this draft: it starts after the file), "none"
    kv_bits: Optional[int] = None  # the bits and group size of a quantized cache, else None
    kv_group_size: Optional[int] = None
    max_kv_size: Optional[int] = None  # the bound of a bounded cache, else None
    text: Optional[Dict[str, Any]] = None  # what a front end said it cached (`save_prompt_cache`'s `text`), if it did


class PromptCacheFileError(ValueError):
    """A prompt cache file that cannot be used with this model (what is wrong, and what to do)."""


def fingerprint(model) -> str:
    """A digest of `model`'s parameter names, shapes, dtypes and the first values of each: two models (or
    dtypes, or adapters) whose caches could not stand for each other's differ in it."""
    leaves = tree_flatten(model.parameters()) if hasattr(model, "parameters") else []  # (a stand-in draft: none)
    samples = []
    for _, a in leaves:
        while a.ndim > 1:  # (the first row, by indexing: a reshape would copy a transposed weight whole)
            a = a[0]
        a = a.reshape(1) if a.ndim == 0 else a
        samples.append(a[:64].astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a[:64])
    mx.eval(samples)
    digest = hashlib.sha256(type(model).__name__.encode())
    for (name, a), s in zip(leaves, samples):
        digest.update(f"{name}:{tuple(a.shape)}:{a.dtype};".encode())
        digest.update(np.array(s).tobytes())
    return digest.hexdigest()[:32]


def save_prompt_cache(path, prompt_cache: PromptCache, model_name: Optional[str] = None,
                      tokenizer_config: Optional[Dict[str, Any]] = None, text: Optional[Dict[str, Any]] = None) -> None:
    """Write `prompt_cache` (after a call that ran its prompt) to `path` (.safetensors), for
    `load_prompt_cache` here and mlx-lm's generate --prompt-cache-file. `model_name`: what mlx-lm's
    "model" key names (the model as given), `tokenizer_config`: mlx-lm's (JSON); `text`: what the tokens
    were made of (JSON: `dflash-mlx cache-prompt` keeps the prompt and system text, for the chat). The draft
    absorbs the features it has not yet first, as its next call would."""
    state = prompt_cache
    if not state.valid or state.ahead is not None or not state.tokens:
        raise ValueError("the prompt cache holds no finished prompt: run a prompt with it first")
    if state.known_from:
        raise ValueError("the prompt cache starts with tokens it does not know (it was loaded from an mlx-lm "
                         "file): save it with mlx-lm, or cache the prompt again here")
    target = target_for(state.model, state.draft)
    if target.sharding is not None:
        raise ValueError("a split target's prompt cache cannot be saved to a file: run the target in one process")
    entries = [_as_mlx_lm(c) for c in state.target_cache]
    ours: Dict[str, Any] = {"format": FORMAT, "tokens": list(state.tokens), "target_caches": len(entries),
                            "fingerprint": fingerprint(state.model), "max_kv_size": state.max_kv_size,
                            "draft": None, "text": text}
    if state.draft is not None and state.draft_cache is not None:
        if state.pending is not None:  # what the next draft call would absorb first
            state.draft.inject(state.pending, state.draft_cache)
            state.pending = None
        offsets, windows, draft_arrays = [], [], {}
        for i, c in enumerate(state.draft_cache):
            keys, values = c.fetch()
            if keys is not None:
                draft_arrays.update({f"{i}.keys": keys, f"{i}.values": values})
            offsets.append(c.offset)
            windows.append(getattr(c, "window", None))
        ours["draft"] = {"layers": len(offsets), "offsets": offsets, "windows": windows,
                         "fingerprint": fingerprint(state.draft)}
    metadata = {"model": model_name or "", "tokenizer_config": json.dumps(tokenizer_config or {}),
                KEY: json.dumps(ours)}
    path = Path(path)
    partial = path.with_name(path.name + ".partial.safetensors")  # (never a half-written file at `path`)
    try:
        _write(partial, entries, draft_arrays if ours["draft"] else {}, metadata)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def _write(path: Path, entries: List[Any], draft_arrays: Dict[str, mx.array], metadata: Dict[str, str]):
    """mlx-lm's `save_prompt_cache` file of `entries`, with the draft's arrays as one more element of its list
    of cache states: mlx-lm's loader makes a cache of each state that has a class name, and lists none for it
    (its models must see their own caches alone: several, Llama 4's and Gemma 4's, read every entry given)."""
    scalars: List[Any] = [""]  # (as mlx-lm's: non-empty, else flattening drops it)

    def stored(key: str, value) -> mx.array:
        if isinstance(value, mx.array):
            return value
        if isinstance(value, (int, float, bool)):
            scalars.append((key, "scalar"))
            return mx.array(value)
        if isinstance(value, str):
            scalars.append((key, "string"))
            return mx.array([ord(ch) for ch in value])
        if value is None:
            scalars.append((key, "none"))
            return mx.array([])
        raise ValueError(f"a cache state holds {type(value).__name__}, which a prompt cache file cannot keep")

    arrays = {k: stored(k, v) for k, v in tree_flatten([c.state for c in entries])}
    arrays.update({f"{len(entries)}.{k}": v for k, v in draft_arrays.items()})
    classes = [type(c).__name__ for c in entries]
    mx.save_safetensors(str(path), arrays, dict(tree_flatten([metadata, classes, scalars])))


def load_prompt_cache(path, model, draft=None) -> Tuple[PromptCache, CacheFileInfo]:
    """A `PromptCache` for `model` (and `draft`) holding what the file at `path` holds (ours or mlx-lm's),
    and what was found there; `PromptCacheFileError` naming what is wrong for a file that does not fit."""
    path = Path(path)
    if not path.is_file():
        raise PromptCacheFileError(f"no prompt cache file at {path}: make one with dflash-mlx cache-prompt")
    try:
        entries, metadata = mlx_cache.load_prompt_cache(str(path), return_metadata=True)
        ours = json.loads(metadata[KEY]) if KEY in metadata else None
        tokenizer_config = json.loads(metadata.get("tokenizer_config") or "{}")
    except Exception as e:  # (safetensors' own errors, a class mlx-lm does not know, bad JSON)
        raise PromptCacheFileError(f"{path} is not a prompt cache file of mlx-lm or dflash-mlx "
                                   f"({' '.join(str(e).split())[:200]})") from None
    if ours is not None and ours.get("format") != FORMAT:
        raise PromptCacheFileError(f"{path} is a dflash-mlx prompt cache of format {ours.get('format')}; this "
                                   f"version reads format {FORMAT}: make it again with dflash-mlx cache-prompt")
    target = target_for(model, draft)
    if target.sharding is not None:
        raise PromptCacheFileError("a prompt cache file cannot be used with a split target: run it in one process")
    info = CacheFileInfo(model=metadata.get("model") or None, tokenizer_config=tokenizer_config,
                         tokens_known=ours is not None, text=(ours or {}).get("text"))
    if ours is not None and ours["fingerprint"] != fingerprint(model):
        raise PromptCacheFileError(f"{path} was made for another model (or dtype, or adapter) than this one"
                                   + (f" ({info.model})" if info.model else "")
                                   + ": cache the prompt again with this model")
    info.max_kv_size = ours["max_kv_size"] if ours is not None else _bound_of(model, entries)
    fresh = make_window_cache(target, info.max_kv_size)
    n_target = len(fresh)
    draft_part = (ours or {}).get("draft")
    if len(entries) != n_target:
        raise PromptCacheFileError(f"{path} holds {len(entries)} caches where this model has {n_target} layers "
                                   f"of cache: it was made for another model")
    target_cache = [_checked(path, e, f) for e, f in zip(entries, fresh)]
    _check_shapes(path, target, target_cache, info)
    tokens = [int(t) for t in ours["tokens"]] if ours is not None else None
    length = _length(path, target_cache, tokens)
    prompt_cache = make_prompt_cache(model, draft, max_kv_size=info.max_kv_size)
    prompt_cache.target_cache = target_cache
    if tokens is None:
        tokens = [UNKNOWN_TOKEN] * length
        prompt_cache.known_from = length
    prompt_cache.tokens = tokens
    prompt_cache.history_start = length  # (penalties see what follows the file, as mlx-lm's generate)
    if draft is not None:
        restored = (draft_part is not None and draft_part["fingerprint"] == fingerprint(draft)
                    and _restore_draft(prompt_cache.draft_cache, _draft_arrays(path, n_target), draft_part))
        if not restored:  # (the draft's context does not change a token, only how many it guesses)
            for c in prompt_cache.draft_cache:
                c.offset = length
        info.draft_context = "restored" if restored else "cold"
    return prompt_cache, info


def continued(prompt_cache: PromptCache, suffix_ids: Sequence[int]) -> List[int]:
    """The prompt to pass with a loaded `prompt_cache` to answer after `suffix_ids` (the file's tokens, or
    their placeholders, then the suffix)."""
    return list(prompt_cache.tokens) + [int(t) for t in suffix_ids]


# -- internals ----------------------------------------------------------------


def _mlx_lm_class(cls):
    """The class of mlx-lm's that `cls` is (itself, or the one it extends: a bounded cache's window)."""
    for base in cls.__mro__:
        if getattr(mlx_cache, base.__name__, None) is base:
            return base
    return None


def _as_mlx_lm(c):
    """`c` as the mlx-lm cache it is, a `KVCache` without the room it grows into (mlx-lm's saves it too)."""
    base = _mlx_lm_class(type(c))
    if base is None:
        raise ValueError(f"the target's cache {type(c).__name__} is not one of mlx-lm's: it cannot go in a file")
    if base is mlx_cache.KVCache and c.keys is not None and c.keys.shape[2] > c.offset:
        return _kv(c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
    return c if type(c) is base else base.from_state(c.state)


def _kv(keys, values) -> mlx_cache.KVCache:
    kv = mlx_cache.KVCache()
    if keys is not None:
        kv.keys, kv.values, kv.offset = keys, values, keys.shape[2]
    return kv


def _checked(path, entry, fresh):
    """The file's `entry` as this model's cache of `fresh`'s kind (our bounded window for mlx-lm's)."""
    kind = _mlx_lm_class(type(fresh))
    same = type(entry) is kind or (kind is mlx_cache.KVCache and type(entry) is mlx_cache.QuantizedKVCache)
    if not same:
        raise PromptCacheFileError(f"{path} holds a {type(entry).__name__} where this model's cache is a "
                                   f"{kind.__name__}: it was made for another model (or another --max-kv-size)")
    if type(fresh) is not kind and type(entry) is kind:
        entry.__class__ = type(fresh)  # (a class of ours that only masks otherwise: no state of its own)
    return entry


def _bound_of(model, entries) -> Optional[int]:
    """mlx-lm's --max-kv-size a file was made with, read off its caches (mlx-lm's files do not say)."""
    first = entries[0] if entries else None
    if bounds(model) and isinstance(first, mlx_cache.RotatingKVCache) and first.keep == KEEP:
        return first.max_size
    return None


def _arrays(c) -> List[mx.array]:
    return [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]


def _check_shapes(path, target, caches: List[Any], info: CacheFileInfo):
    """Refuse caches whose arrays this model would not make: a one-token forward of the target on its own
    fresh caches, whose arrays must match the file's on every axis but the sequence axis."""
    quantized = [c for c in caches if isinstance(c, mlx_cache.QuantizedKVCache)]
    if quantized:
        info.kv_bits, info.kv_group_size = quantized[0].bits, quantized[0].group_size
    probe = make_window_cache(target, info.max_kv_size)
    target.forward(mx.array([[0]]), probe)
    for i, (p, c) in enumerate(zip(probe, caches)):
        if isinstance(c, mlx_cache.QuantizedKVCache) and not isinstance(p, mlx_cache.QuantizedKVCache):
            p = p.to_quantized(group_size=c.group_size, bits=c.bits)
        mine, theirs = _arrays(p), _arrays(c)
        if len(mine) != len(theirs) or any(not _fits(a.shape, b.shape) for a, b in zip(mine, theirs)):
            raise PromptCacheFileError(f"{path}: cache {i} holds arrays of shapes "
                                       f"{[tuple(b.shape) for b in theirs]} where this model makes "
                                       f"{[tuple(a.shape) for a in mine]}: it was made for another model")


def _fits(mine: Tuple[int, ...], theirs: Tuple[int, ...]) -> bool:
    if len(mine) != len(theirs):
        return False
    return all(a == b for axis, (a, b) in enumerate(zip(mine, theirs)) if not (len(mine) == 4 and axis == 2))


def _length(path, caches: List[Any], tokens: Optional[List[int]]) -> int:
    """Tokens the caches hold: what each cache that counts them says, and the file's tokens where it names them."""
    offsets = set() if tokens is None else {len(tokens)}
    for c in caches:
        for sub in (c.caches if isinstance(c, mlx_cache.CacheList) else (c,)):
            if hasattr(sub, "offset") and isinstance(sub.offset, int):
                offsets.add(sub.offset)
    if not offsets:
        raise PromptCacheFileError(f"{path}: mlx-lm's file for a model with recurrent caches only does not say how "
                                   "many tokens it holds: cache the prompt with dflash-mlx cache-prompt")
    if len(offsets) > 1:
        raise PromptCacheFileError(f"{path}: its caches (and tokens) disagree on how many tokens they hold "
                                   f"({sorted(offsets)}): the file is damaged; cache the prompt again")
    return offsets.pop()


def _draft_arrays(path: Path, n_target: int) -> Dict[str, mx.array]:
    """The draft's arrays in a file of ours ("0.keys", "0.values", ... by draft layer)."""
    prefix = f"{n_target}."
    return {k[len(prefix):]: v for k, v in mx.load(str(path)).items() if k.startswith(prefix)}


def _restore_draft(draft_cache: List[Any], arrays: Dict[str, mx.array], part: Dict[str, Any]) -> bool:
    """Put the file's draft context into `draft_cache` (a fresh one); False where it does not fit."""
    if part["layers"] != len(draft_cache) or part["windows"] != [getattr(c, "window", None) for c in draft_cache]:
        return False
    for i, (c, offset) in enumerate(zip(draft_cache, part["offsets"])):
        keys, values = arrays.get(f"{i}.keys"), arrays.get(f"{i}.values")
        held = 0 if keys is None else keys.shape[2]
        c.offset = offset - held
        if held:
            c.append(keys, values)
    return True
