"""What a batch of rows does with its targets' caches: which targets the batch engine takes
(`batch_support`, checked once per model), rows' own caches as one batch's (`merge_rows`,
`extend_rows`), and each row dropping what it rejected after a verify (`rollback_rows`).

Targets (`batch_support`), each cache kind with its own per-row rollback:
- attention KV (`BatchKVCache`) and sliding windows (`BatchRotatingKVCache`, put in
  temporal order before a verify of two or more tokens: `rollback.in_temporal_order`):
  `rollback.rollback_batch_rows`;
- Qwen3.5/3.6 Gated DeltaNet, taped in the verify: each row's conv window and its
  pre-verify state advanced by its own kept steps (`rollback.replay_gdn_rows`);
- any other recurrent state in an `ArraysCache` (Mamba, RWKV, short convs, Qwen3-Next's
  DeltaNet, ...): the layer's verify call is recorded, and rows that kept the same number
  of tokens re-run it together from their pre-verify states (`rollback.replay_layer_rows`).
A `CacheList` rolls back each of its caches: attention (GLM's DSA) per row; recurrent state
beside attention (Falcon-H1's Mamba) through the module the layer hands it to, recorded on
its own in the verify, re-run per group of rows. Refused: such state not handed to a module
of its own, attention that keeps key blocks cut over cache slots (MiniMax M3's indexer: a
row's left padding moves them), and models whose code does not batch rows of different
lengths even with `HeadAxisMask` (which mlx-lm's Gemma 2 needs); those are served one
request at a time (`stream_generate`).
"""

import copy
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, CacheList, KVCache, RotatingKVCache

from dflash_mlx.identity import IdentityMap
from dflash_mlx.models.rope_offsets import takes_offset_arrays
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.models.target.sharding import agreed_reason, on_every_rank
from dflash_mlx.models.target.rollback import (VerifyRecord, recorded_apart, replay_gdn_rows, replay_layer_rows,
                                               rollback_batch_rows, sub_caches)
from dflash_mlx.models.target.stand_ins import StandIn

_SUPPORT = IdentityMap()


def batch_support(target: Target) -> Optional[str]:
    """None when the batch engine serves `target`, else why not: its caches must be attention
    KV, sliding windows or recurrent state in an `ArraysCache` (rewound per row), and
    its code must batch rows of different lengths (checked once per model: three rows
    against each alone)."""
    return _support(target)[0]


def mask_head_axis(target: Target) -> bool:
    """Whether the batch's masks need an axis for grouped query heads (`HeadAxisMask`)."""
    return _support(target)[1]


def _support(target: Target) -> Tuple[Optional[str], bool]:
    found = _SUPPORT.get((target.model,))
    if found is None:
        reason = _check(target)
        found = (reason, False)
        retry = reason is not None and reason.startswith(("its rows", "a batch of rows"))
        if not on_every_rank(target.sharding, [not retry])[0]:  # (where one rank of a split retries, all do)
            # mlx-lm's Gemma 2 splits the query heads into (kv heads, repeats) before it applies
            # the mask, which a batch's per-row mask [B, 1, L, K] does not broadcast against
            if _check(target, head_axis=True) is None:
                found = (None, True)
        _SUPPORT.put((target.model,), found)
    return found


class HeadAxisMask(StandIn):
    """A batch's attention cache as such a model sees it for one forward: everything passes
    through to the cache, except that its mask [B, 1, L, K] gets an axis for the repeats
    of each KV head, [B, 1, 1, L, K]."""

    def __init__(self, cache):
        self._wrapped = cache

    def make_mask(self, *args, **kwargs):
        mask = self._wrapped.make_mask(*args, **kwargs)
        return mask[:, :, None] if isinstance(mask, mx.array) and mask.ndim == 4 else mask


def for_forward(caches: List, kinds: Sequence[str], head_axis: bool) -> List:
    """A batch's caches as the model gets them for one forward (`HeadAxisMask` where needed)."""
    if not head_axis:
        return caches
    return [HeadAxisMask(c) if kind == "trim" else c for c, kind in zip(caches, kinds)]


def _check(target: Target, head_axis: bool = False) -> Optional[str]:
    """Why `target` cannot be batched, or None. A split target's ranks hold different layers:
    each step's answer is the same on every rank, and the probe forwards (collectives) run only
    where every rank runs them."""
    sharding = target.sharding
    reason = agreed_reason(sharding, _caches_reason(target))
    if reason is None:  # before any probe forward: on a split it would raise only where such layers are
        reason = agreed_reason(sharding, _rope_reason(target))
    listed = _listed(target)
    if reason is None and not on_every_rank(sharding, [not listed])[0]:
        reason = agreed_reason(sharding, _recorded_apart_reason(target, listed))
    if reason is None:
        reason = agreed_reason(sharding, _rows_reason(target, head_axis))
    return reason


def _caches_reason(target: Target) -> Optional[str]:
    def batchable(c):
        return type(c) in (KVCache, RotatingKVCache, ArraysCache) or (
            type(c) is CacheList and all(batchable(s) and type(s) is not CacheList for s in c.caches))

    kinds = target.rollback_kinds()
    refused = sorted({type(c).__name__ for c, kind in zip(target.make_cache(), kinds)
                      if not (batchable(c) and (kind != "gdn" or type(c) is ArraysCache))})
    if refused:
        return (f"its caches include {', '.join(refused)} (batches take attention KV, sliding windows, "
                "recurrent state in an ArraysCache, and lists of them)")
    blocks = _slot_blocks(target)
    if blocks is not None:
        return (f"its sparse attention keeps the top key blocks of {blocks} cache slots (index_block_size), and a "
                "batch's left padding moves those blocks off the row's own, so rows would not attend as alone")
    return None


def _listed(target: Target) -> List[int]:
    """Caches that hold recurrent state beside attention in one CacheList (replayed)."""
    return [i for i, (c, kind) in enumerate(zip(target.make_cache(), target.rollback_kinds()))
            if kind == "replay" and type(c) is CacheList]


def _recorded_apart_reason(target: Target, listed: List[int]) -> Optional[str]:
    # a batch re-runs recurrent state per group of rows, which for state beside attention
    # in one CacheList needs the module that state is handed to, recorded on its own
    vocab = target.vocab_size
    cache = target.make_cache()
    _, _, record = target.forward(mx.array([[1 % vocab, 2 % vocab]]), cache, record=True)
    if listed and not all(recorded_apart(cache[i], record) for i in listed):
        return ("its CacheList's recurrent state is not handed to a module of its own, so it cannot be "
                "re-run per row beside the list's attention")
    return None


def _rows_reason(target: Target, head_axis: bool) -> Optional[str]:
    """Three rows of different lengths in one batch against each alone."""
    kinds = target.rollback_kinds()
    vocab = target.vocab_size
    # (a one-token row: a cache whose size follows the context, LongCat's n-gram ids, is ragged there)
    prompts = [[(7 * i + j) % vocab for j in range(n)] for i, n in enumerate((3, 5, 1))]
    step = mx.array([[(11 + i) % vocab, (13 + i) % vocab] for i in range(3)])
    tight = 1e-4 if target.embed_tokens_dtype == mx.float32 else 3e-2
    try:
        singles, alone = [], []
        for i, p in enumerate(prompts):
            cache = target.make_cache()
            target.forward(mx.array([p]), cache)
            singles.append(cache)
        merged = merge_rows(singles)
        for i, cache in enumerate(singles):
            alone.append(target.forward(step[i : i + 1], cache)[0])
        together, _, _ = target.forward(step, for_forward(merged, kinds, head_axis))
        alone = mx.concatenate(alone, axis=0).astype(mx.float32)
        if (mx.abs(together.astype(mx.float32) - alone).max() > tight * (1.0 + mx.abs(alone).max())).item():
            return "its rows do not come out of a batch as they do alone"
    except Exception as e:  # model code that cannot take a batch of different lengths
        return f"a batch of rows failed ({type(e).__name__}: {e})"
    return None


def _rope_reason(target: Target) -> Optional[str]:
    """A rotary embedding that takes one position offset per call (e.g. mlx-lm's dynamic NTK RoPE,
    which sizes its base from one offset) cannot rotate a batch whose rows sit at different positions."""
    single = sorted({type(parent[key]).__name__ for parent, key in target.rope_slots
                     if not takes_offset_arrays(parent[key])})
    if single:
        return (f"its rotary embedding ({', '.join(single)}) takes one position offset per call, and a "
                f"batch's rows sit at different positions")
    return None


def _slot_blocks(target: Target) -> Optional[int]:
    """The block size of attention that picks key blocks cut over cache slots, not positions
    (MiniMax M3's indexer), else None. A row padded on the left by other than a multiple of it
    is cut into other blocks than alone, and per-row rollback pads rows by any amount; the
    three-row check below is too short for such blocks to bite (a real model's are 64+ keys)."""
    for layer in target.layers:
        attn = getattr(layer, "self_attn", None) if layer is not None else None
        size = getattr(attn, "index_block_size", None) if attn is not None else None
        if isinstance(size, int) and getattr(attn, "index_topk_blocks", None) is not None:
            return size
    return None


def merge_rows(rows: List[List]) -> List:
    """Rows' own caches (one list per row, a cache per layer) as one batch's, in row order."""
    merged = [_batched(c) for c in rows[0]]
    for other in rows[1:]:
        extend_rows(merged, other)
    return merged


def extend_rows(batch: List, row: List):
    """Append one row's own caches to a batch's."""
    for c, o in zip(batch, row):
        c.extend(_batched(o))


def extract_row(batch: List, b: int) -> List:
    """Row `b`'s own caches out of a batch's, as it leaves."""
    return [_extract(c, b) for c in batch]


def _extract(c, b: int):
    if isinstance(c, CacheList):
        return CacheList(*(_extract(s, b) for s in c.caches))
    # never filled: a cache no layer fills, which `own_layers_caches` missed (mlx-lm's extract cannot take it)
    if isinstance(c, BatchRotatingKVCache) and c.keys is None:
        return RotatingKVCache(max_size=c.max_size)
    if isinstance(c, BatchKVCache) and c.keys is None:
        return KVCache()
    return c.extract(b)


def _batched(c):
    """A row's cache as the first row of a batch of its kind."""
    if isinstance(c, CacheList):
        return CacheList(*(_batched(s) for s in c.caches))
    if isinstance(c, RotatingKVCache):
        return _batched_window(c)
    return BatchKVCache.merge([c]) if isinstance(c, KVCache) else ArraysCache.merge([c])


def _batched_window(c: RotatingKVCache) -> BatchRotatingKVCache:
    """A lone row's window as a batch's. mlx-lm's merge copies `size()` = min(offset, window)
    entries; a window a verify rolled back holds one fewer (`rollback_rotating` drops the
    rejected tail, and with it the oldest key, which a one-token step no longer reads): it is
    merged with the entries it holds, at its own positions."""
    held = 0 if c.keys is None else c._temporal_order(c.keys).shape[2]
    if c.keys is None or held >= c.size():
        return BatchRotatingKVCache.merge([c])
    view = copy.copy(c)
    view.offset = held  # (merge's count of the entries to copy)
    batch = BatchRotatingKVCache.merge([view])
    batch.offset = mx.array([c.offset])
    return batch


def rollback_rows(caches: List, kinds: Sequence[str], record: Optional[VerifyRecord], width: int,
                  rejected: Sequence[int]):
    """After a verify of `width` tokens per row, row b drops its last `rejected[b]`: one path
    per cache kind (`Target.rollback` is the one-row twin)."""
    keep = [width - r for r in rejected]
    for idx, (c, kind) in enumerate(zip(caches, kinds)):
        if kind == "gdn":
            if record is not None and idx in record.gdn:
                replay_gdn_rows(c, record.gdn[idx], keep)
        elif kind == "replay" and isinstance(c, CacheList):
            if record is not None:  # recorded apart (checked by `batch_support`)
                for sub in c.caches:
                    if isinstance(sub, ArraysCache):
                        replay_layer_rows(record.replay[id(sub)], width, keep)
                    else:
                        rollback_batch_rows(sub, rejected)
        elif kind == "replay":
            if record is not None and id(c) in record.replay:
                replay_layer_rows(record.replay[id(c)], width, keep)
        else:
            for sub in sub_caches(c):
                rollback_batch_rows(sub, rejected)
