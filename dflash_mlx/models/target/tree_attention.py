"""Handing a token tree to any mlx-lm model for one verify forward, with no copy of any
attention code, and checking once per model that it takes one.

A tree's nodes (`TokenTree`) are verified in one forward, each node seeing the context, its
ancestors and itself, at the position its depth says. For that forward every cache is handed
over behind a `TreeCache` stand-in whose `make_mask` (what `create_attention_mask` asks every
model for) returns the tree's mask, and each attention's rotary embedding module is swapped
for a `TreeRoPE` that rotates each node by its depth (`Target.forward(tree=...)` does both).
After the forward, `compact_cache` moves the kept path's KV entries into place.

Whether a model builds its mask and positions that way is not assumed: `tree_support` checks
it once per model on a tiny tree against chains, and a model that does not (learned absolute
positions, a mask built without asking the cache, a recurrent state) keeps chains.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from dflash_mlx.identity import IdentityMap
from dflash_mlx.models.rope_offsets import takes_offset_arrays
from dflash_mlx.models.target.sharding import agreed_reason
from dflash_mlx.models.target.stand_ins import StandIn


@dataclass
class TokenTree:
    """Node 0 is the root (the last committed token); nodes are in depth order, so
    every node comes after its parent and each depth is one contiguous run."""

    tokens: List[int]  # target ids
    parents: List[int]  # -1 for the root
    depths: List[int]

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> List[Dict[int, int]]:
        """node -> {token: child node}"""
        out: List[Dict[int, int]] = [{} for _ in self.tokens]
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                out[parent].setdefault(self.tokens[node], node)
        return out

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))


# -- the tree's mask and positions ----------------------------------------------------


def tree_mask(tree: TokenTree, context: int, window: Optional[int] = None) -> mx.array:
    """[N, context + N] bool: node i sees the context and its own ancestors and itself
    (and, under a sliding window, only keys fewer than `window` positions back)."""
    n = len(tree)
    visible = np.zeros((n, context + n), dtype=bool)
    visible[:, :context] = True
    for i in range(n):
        j = i
        while j >= 0:
            visible[i, context + j] = True
            j = tree.parents[j]
    if window is not None:
        depths = np.asarray(tree.depths)
        key_pos = np.concatenate([np.arange(context), context + depths])
        query_pos = context + depths
        visible &= (query_pos[:, None] - key_pos[None, :]) < window
    return mx.array(visible)


class TreeCache(StandIn):
    """A cache as a model sees it during a tree verify: everything passes through to the
    real cache, except that the mask it makes is the tree's."""

    def __init__(self, cache, tree: TokenTree):
        self._wrapped = cache
        self._tree = tree

    def make_mask(self, n: int, *args, window_size: Optional[int] = None, **kwargs):
        return tree_mask(self._tree, self._wrapped.offset, window_size)


class TreeRoPE(StandIn):
    """A rotary embedding that rotates tree node i to position offset + depth[i]."""

    def __init__(self, rope, tree: TokenTree):
        self._wrapped = rope
        self._depths = mx.array(tree.depths)
        # runs of equal depth: (start, stop, depth)
        runs, start = [], 0
        for i in range(1, len(tree) + 1):
            if i == len(tree) or tree.depths[i] != tree.depths[start]:
                runs.append((start, i, tree.depths[start]))
                start = i
        self._runs = runs
        self._array_offsets = takes_offset_arrays(rope)

    def __call__(self, x: mx.array, offset=0, **kwargs) -> mx.array:
        n = x.shape[-2]
        if n != len(self._depths):  # not the tree's rows (e.g. a rope on something else)
            return self._wrapped(x, offset=offset, **kwargs)
        if self._array_offsets:  # one call, one offset per node
            return self._rotate(x, offset + self._depths, **kwargs)
        # one call per depth (nodes of one depth share a position)
        parts = [self._rotate(x[..., s:e, :], offset + d, **kwargs) for s, e, d in self._runs]
        return mx.concatenate(parts, axis=-2)

    def _rotate(self, x: mx.array, offset, **kwargs) -> mx.array:
        """Each of x's rows (axis -2) on its own at `offset`: the rows go to the batch
        axis, where a rotary embedding gives every entry the same (or its own) offset."""
        n, lead = x.shape[-2], x.shape[:-2]
        rows = mx.moveaxis(x, -2, 0).reshape(n, -1, 1, x.shape[-1])
        out = self._wrapped(rows, offset=offset, **kwargs)
        return mx.moveaxis(out.reshape(n, *lead, x.shape[-1]), 0, -2)


def _is_rope(module) -> bool:
    kind = type(module)
    return isinstance(module, nn.RoPE) or (
        kind.__module__.startswith("mlx_lm.models") and "rope" in kind.__name__.lower())


def rope_slots(layers) -> List[Tuple[Any, str]]:
    """(parent module, attribute) of every rotary embedding inside `layers`."""
    slots = []

    def walk(parent):
        for key, child in parent.children().items():
            items = child if isinstance(child, list) else [child]
            for i, item in enumerate(items):
                if not isinstance(item, nn.Module):
                    continue
                if _is_rope(item):
                    slots.append((child, i) if isinstance(child, list) else (parent, key))
                else:
                    walk(item)

    for layer in layers:
        walk(layer)
    return slots


def tree_caches(cache: List[Any], tree: TokenTree) -> List[Any]:
    return [TreeCache(c, tree) for c in cache]


def compact_cache(cache: List[Any], start: int, rows: Sequence[int], verified: int):
    """After a tree verify of `verified` rows from position `start`: keep the KV entries of
    `rows` (increasing verify rows), moved to start..start+len(rows)-1; drop the rest."""
    keep = len(rows)
    moved = list(rows) != list(range(keep))
    for c in cache:
        if moved and c.keys is not None:  # (None: a cache no layer fills, which `own_layers_caches` missed)
            idx = mx.array(rows) + start
            c.keys[..., start : start + keep, :] = c.keys[..., idx, :]
            c.values[..., start : start + keep, :] = c.values[..., idx, :]
        c.trim(verified - keep)


# -- does a model take trees? ---------------------------------------------------------

_SUPPORT = IdentityMap()


def tree_support(target) -> Optional[str]:
    """None when `target` verifies trees exactly, else why not (checked once per model)."""
    found = _SUPPORT.get((target.model,))
    if found is None:
        found = (_check(target),)
        _SUPPORT.put((target.model,), found)
    return found[0]


def _check(target) -> Optional[str]:
    # a split target's ranks hold different layers: every rank takes the same answer, and runs
    # the probe forwards (collectives) only where every rank does
    sharding = getattr(target, "sharding", None)
    reason = agreed_reason(sharding, _layers_reason(target))
    return reason if reason is not None else agreed_reason(sharding, _probe(target))


def _layers_reason(target) -> Optional[str]:
    cache = target.make_cache()
    kinds = {type(c).__name__ for c in cache if type(c) is not KVCache}
    if kinds:
        return f"its caches include {', '.join(sorted(kinds))} (trees need plain attention KV)"
    if not target.rope_slots:
        return "no rotary embedding modules were found in its layers"
    return None


def _probe(target) -> Optional[str]:
    # A tiny tree against the chain it contains: root r with children a and b, b with child c.
    # Rows r, b, c of the tree must equal the chain r, b, c; after compaction, one more
    # token must see the same cache either way.
    vocab = target.vocab_size
    prefix, (r, a, b, c, d) = [1 % vocab, 2 % vocab, 3 % vocab], [(4 + i) % vocab for i in range(5)]
    tree = TokenTree([r, a, b, c], [-1, 0, 0, 2], [0, 1, 1, 2])
    tight = 1e-4 if target.embed_tokens_dtype == mx.float32 else 3e-2

    def close(x, y):
        x, y = x.astype(mx.float32), y.astype(mx.float32)
        return (mx.abs(x - y).max() <= tight * (1.0 + mx.abs(y).max())).item()

    try:
        tree_cache, chain_cache = target.make_cache(), target.make_cache()
        for c_ in (tree_cache, chain_cache):
            target.forward(mx.array([prefix]), c_)
        h_tree, _, _ = target.forward(mx.array([tree.tokens]), tree_cache, tree=tree)
        h_chain, _, _ = target.forward(mx.array([[r, b, c]]), chain_cache)
        if not close(h_tree[:, [0, 2, 3]], h_chain):
            return "its attention does not take the tree's mask and positions"
        compact_cache(tree_cache, len(prefix), [0, 2, 3], len(tree))
        after_tree, _, _ = target.forward(mx.array([[d]]), tree_cache)
        after_chain, _, _ = target.forward(mx.array([[d]]), chain_cache)
        if not close(after_tree, after_chain):
            return "its cache cannot be compacted after a tree"
    except Exception as e:  # a model whose code cannot take the stand-ins
        return f"a tree verify failed ({type(e).__name__}: {e})"
    return None
