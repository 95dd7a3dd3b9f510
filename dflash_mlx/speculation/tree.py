"""Token trees: several continuations of the draft's block checked in one target forward.

The draft scores every block position at once, so besides its chain (the argmax
at each position) it offers the runner-ups. A tree spends the same verify rows on
the continuations the draft finds most likely as a whole: nodes are taken best
first by summed log-probability over the positions' top-k (DDTree, arXiv
2604.12989), each node's children being the next position's top-k. The target
verifies the root (the last committed token) and every node in one forward, each
node seeing the context, its ancestors and itself, at the position its depth says;
the deepest node whose path is the target's own choice at every step is accepted,
and the kept path's KV entries and features are moved into place.

How mlx-lm's models get the tree, with no copy of any attention code: for the one
forward, every cache is handed over behind a `TreeCache` stand-in whose `make_mask`
(what `create_attention_mask` asks every model for) returns the tree's mask, and
each attention's rotary embedding module is swapped for a `TreeRoPE` that rotates
each node by its depth. Whether a model builds its mask and positions that way is
not assumed: `tree_support` checks it once per model on a tiny tree against
chains, and a model that does not (learned absolute positions, a mask built without
asking the cache, a recurrent state) keeps chains.

At temperature > 0 the walk down the tree samples exactly (`accept_sampled`): at each
node the children, proposals that are fixed tokens, are tried in turn, each accepted with
its probability under what is left of the target's sampling distribution once the
siblings tried before it are removed; when all are rejected the token comes from that
residual. So every committed token follows the target's own distribution (the recursive
rejection of SpecInfer, with one-hot proposals).
"""

import heapq
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from dflash_mlx.speculation.accept import GreedyAcceptor
from dflash_mlx.identity import IdentityMap
from dflash_mlx.models.rope_offsets import takes_offset_arrays
from dflash_mlx.models.target.rollback import StandIn

# Runner-ups per drafted position a node may branch into.
TOP_K = 4
# Widths (root + nodes) at which trees are tried when the sizer would not go there.
TREE_WIDTHS = (4, 6, 8, 12, 16)


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


def build_tree(root: int, top_ids: np.ndarray, top_logprobs: np.ndarray, nodes: int) -> TokenTree:
    """The `nodes` most likely nodes under the draft, best first.

    top_ids, top_logprobs [P, K]: each drafted position's K likeliest tokens (target
    ids) and their log-probabilities, best first. A node at depth d holds one of
    position d's tokens; its score is the sum of its path's log-probabilities. A
    node's first child and its next sibling become candidates when it is taken,
    so candidates are always the best of what is left.
    """
    positions, k = top_ids.shape
    picked: List[Tuple[int, int, int]] = []  # (parent, depth, rank), in the order taken
    heap = [(-float(top_logprobs[0, 0]), 0, 0, 0, 1)] if positions and nodes else []  # (-score, tie, parent, rank, depth)
    tie = 1
    while heap and len(picked) < nodes:
        neg, _, parent, rank, depth = heapq.heappop(heap)
        picked.append((parent, depth, rank))
        me = len(picked)  # node index (the root is 0)
        score = -neg
        if depth < positions:
            heapq.heappush(heap, (-(score + float(top_logprobs[depth, 0])), tie, me, 0, depth + 1))
            tie += 1
        if rank + 1 < k:
            sibling = score - float(top_logprobs[depth - 1, rank]) + float(top_logprobs[depth - 1, rank + 1])
            heapq.heappush(heap, (-sibling, tie, parent, rank + 1, depth))
            tie += 1
    # Depth order (stable, so ranks stay in order among siblings); parents renumbered.
    order = sorted(range(len(picked)), key=lambda i: picked[i][1])
    new_index = {old + 1: new + 1 for new, old in enumerate(order)}
    new_index[0] = 0
    tokens, parents, depths = [root], [-1], [0]
    for old in order:
        parent, depth, rank = picked[old]
        tokens.append(int(top_ids[depth - 1, rank]))
        parents.append(new_index[parent])
        depths.append(depth)
    return TokenTree(tokens, parents, depths)


def draft_top_k(draft, draft_logits: mx.array, first: mx.array, k: int = TOP_K) -> Tuple[mx.array, mx.array]:
    """draft_logits [1, P, V_draft], first [1, P] (the draft's own choice, target ids)
    -> (ids [P, K] target ids, log-probabilities [P, K]), the own choice first.

    The own choice is the argmax, or what the draft's selector picked (DFlash 2):
    it leads every position so that the tree's spine is the chain."""
    logp = draft_logits[0].astype(mx.float32)
    logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
    k = min(k, logp.shape[-1])
    ids = mx.argpartition(-logp, kth=k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(logp, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    ids = draft.to_target_ids(mx.take_along_axis(ids, order, axis=-1)).astype(mx.int32)
    vals = mx.take_along_axis(vals, order, axis=-1)
    own = first[0].astype(mx.int32)
    if getattr(draft, "select_tokens", None) is not None:
        # the selector's pick leads, scored as the best; a runner-up equal to it drops out
        dup = ids == own[:, None]
        ids = mx.concatenate([own[:, None], ids], axis=1)
        vals = mx.concatenate([vals[:, :1], mx.where(dup, -mx.inf, vals)], axis=1)
    return ids, vals


def accept_greedy(tree: TokenTree, choices: Sequence[int]) -> Tuple[List[int], int]:
    """choices[i]: the target's argmax at node i. -> (accepted path of nodes, root first;
    the bonus token), the path ending at the deepest node whose every step was the
    target's own choice."""
    children = tree.children()
    path = [0]
    while True:
        child = children[path[-1]].get(int(choices[path[-1]]))
        if child is None:
            return path, int(choices[path[-1]])
        path.append(child)


def accept_sampled(tree: TokenTree, logprobs: mx.array) -> Tuple[List[int], int]:
    """logprobs [N, V]: the target's sampling distribution at each node (temperature and
    filters applied, `SamplingAcceptor.logprobs`). -> (accepted path of nodes, root first;
    the token drawn after its last node).

    At a node with distribution p whose children hold tokens x1, x2, ... (best first):
    x1 is accepted with probability p(x1); else x2 with probability p(x2) / (1 - p(x1)),
    its probability under p without x1; and so on; when every child is rejected the
    token is drawn from p without them. Each token is then distributed as p, and an
    accepted child's own node holds the target's distribution after it. The draws are
    one uniform per edge and one categorical, whatever the path (a seed reproduces)."""
    children = tree.children()
    edges = [(node, token, child) for node in range(len(tree)) for token, child in children[node].items()]
    u = mx.random.uniform(shape=(max(1, len(edges)),))
    if edges:
        p_edge = mx.exp(logprobs[mx.array([e[0] for e in edges]), mx.array([e[1] for e in edges])])
        mx.eval(u, p_edge)
        p_edge, u_host = p_edge.tolist(), u.tolist()
    by_node: Dict[int, List[int]] = {}
    for i, (node, _, _) in enumerate(edges):
        by_node.setdefault(node, []).append(i)
    path = [0]
    while True:
        node, nxt, removed, removed_mass = path[-1], None, [], 0.0
        for i in by_node.get(node, []):
            if u_host[i] * (1.0 - removed_mass) < p_edge[i]:
                nxt = edges[i][2]
                break
            removed.append(edges[i][1])
            removed_mass += p_edge[i]
        if nxt is None:
            row = logprobs[node]
            if removed:
                tried = (mx.arange(row.shape[-1])[:, None] == mx.array(removed)[None]).any(axis=1)
                row = mx.where(tried, -mx.inf, row)
            return path, int(mx.random.categorical(row).item())
        path.append(nxt)


# -- handing the tree to mlx-lm's models --------------------------------------------


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
        if moved:
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
    cache = target.make_cache()
    kinds = {type(c).__name__ for c in cache if type(c) is not KVCache}
    if kinds:
        return f"its caches include {', '.join(sorted(kinds))} (trees need plain attention KV)"
    if not target.rope_slots:
        return "no rotary embedding modules were found in its layers"
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


# -- the engine's tree cycle -------------------------------------------------------------


@dataclass
class TreeVerify:
    """One tree cycle's outcome: the accepted path (nodes, root first), the committed
    tokens (accepted nodes' tokens, then the target's bonus), the verify's logits
    [N, V] and features [1, N, F] (None without taps), and where the cache started."""

    tree: TokenTree
    path: List[int]
    tokens: List[int]
    logits: mx.array
    features: Optional[mx.array]
    start: int


def verify_tree(target, drafter, acceptor, cache: List[Any], last: mx.array, width: int) -> TreeVerify:
    """Draft a block of `width` - 1 positions, verify the best `width` - 1 nodes of its tree.

    Two host syncs: the draft's top-k (the tree's shape is built on the host), and the
    target's choice at every node (the walk down the tree)."""
    draft = drafter.draft
    draft_logits = drafter.draft_logits(last, width)
    own = acceptor.propose(draft, draft_logits).tokens
    ids, logprobs = draft_top_k(draft, draft_logits, own)
    mx.eval(ids, logprobs)
    tree = build_tree(int(last.item()), np.array(ids), np.array(logprobs), width - 1)
    start = cache[0].offset
    h, feats, _ = target.forward(mx.array([tree.tokens]), cache, drafter.layer_ids, tree=tree)
    logits = target.logits(h)[0]
    if isinstance(acceptor, GreedyAcceptor):
        choices = mx.argmax(logits, axis=-1)
        mx.eval(choices)
        path, bonus = accept_greedy(tree, choices.tolist())
    else:
        path, bonus = accept_sampled(tree, acceptor.logprobs(logits))
    tokens = [tree.tokens[n] for n in path[1:]] + [bonus]
    return TreeVerify(tree, path, tokens, logits, feats, start)


class TreePolicy:
    """Whether a drafted cycle verifies a token tree or the draft's chain, and trying trees.

    Rides on the draft's `BlockSizer`: a tree spends the same rows as the chain of its
    width, so both share the sizer's cycle times, and the sizer's rate of a width is the
    better of the two (`BlockSizer.expected_tokens`), so trees can make wider widths pay.
    The chain's expected tokens are the sizer's; a tree's are learned per width from its
    own cycles (decayed mean of the tokens they committed). A chain says nothing about
    what a tree of its width would find, so trees are tried: at a width the sizer
    chose, until tried `tries` times; at the tree widths (`TREE_WIDTHS`) up to twice the
    chosen width while drafting pays at all, one every `explore_every` drafted cycles,
    each width waiting twice as long for its next try.
    """

    def __init__(self, decay: float = 0.9, margin: float = 0.03, tries: int = 2, explore_every: int = 8,
                 max_explore_gap: int = 256):
        self.decay = decay
        self.margin = margin
        self.tries = tries
        self.explore_every = explore_every
        self.max_explore_gap = max_explore_gap
        self.committed: Dict[int, float] = {}  # width -> decayed sum of tokens per tree cycle
        self.weight: Dict[int, float] = {}  # width -> decayed count of tree cycles
        self.cycles: Dict[int, int] = {}  # width -> tree cycles run
        self.drafted = 0  # drafted cycles seen
        self.last_try = 0  # drafted cycle of the last exploration
        self.gap: Dict[int, int] = {}  # width -> drafted cycles between its explorations

    def expected_tokens(self, width: int) -> Optional[float]:
        if self.cycles.get(width, 0) < self.tries:
            return None
        return self.committed[width] / self.weight[width]

    def choose(self, width: int, chain_expected: float) -> bool:
        """At a width the sizer chose: a tree (True) or the chain."""
        if width < 3:  # one node: a tree is the chain
            return False
        tree = self.expected_tokens(width)
        return tree is None or tree > chain_expected * (1 + self.margin)

    def explore(self, chosen: int, limit: int) -> Optional[int]:
        """A tree width to try instead of the sizer's `chosen` width this cycle, or None."""
        if chosen < 2:
            return None  # drafting does not pay now: trees would not either
        self.drafted += 1
        if self.drafted - self.last_try < self.explore_every:
            return None
        # at most twice the rows the sizer chose: wider verifies are what it found too dear
        due = [w for w in TREE_WIDTHS if w <= min(limit, 2 * max(chosen, 2)) and w != chosen
               and self.drafted - self.last_try >= self.gap.get(w, 0)]
        if not due:
            return None
        width = min(due, key=lambda w: (self.cycles.get(w, 0), w))
        self.last_try = self.drafted
        self.gap[width] = min(self.max_explore_gap, 2 * self.gap.get(width, self.explore_every // 2))
        return width

    def update(self, width: int, accept_length: int):
        self.committed[width] = self.committed.get(width, 0.0) * self.decay + accept_length + 1
        self.weight[width] = self.weight.get(width, 0.0) * self.decay + 1.0
        self.cycles[width] = self.cycles.get(width, 0) + 1


def tree_policy_for(sizer) -> TreePolicy:
    """The `TreePolicy` riding on a target/draft pair's `BlockSizer` (made on first use)."""
    policy = getattr(sizer, "trees", None)
    if policy is None:
        policy = sizer.trees = TreePolicy()
    return policy
