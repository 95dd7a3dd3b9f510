"""Token trees: several continuations of the draft's block checked in one target forward.

The draft scores every block position at once, so besides its chain (the argmax
at each position) it offers the runner-ups. A tree spends the same verify rows on
the continuations the draft finds most likely as a whole: nodes are taken best
first by summed log-probability over the positions' top-k (DDTree, arXiv
2604.12989), each node's children being the next position's top-k (`build_tree`).
The target verifies the root (the last committed token) and every node in one
forward (`models.target.tree_attention`); the deepest node whose path is the
target's own choice at every step is accepted (`accept_greedy`).

At temperature > 0 the walk down the tree samples exactly (`accept_sampled`): at each
node the children, proposals that are fixed tokens, are tried in turn, each accepted with
its probability under what is left of the target's sampling distribution once the
siblings tried before it are removed; when all are rejected the token comes from that
residual. So every committed token follows the target's own distribution (the recursive
rejection of SpecInfer, with one-hot proposals).
"""

import heapq
from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from dflash_mlx.models.target.tree_attention import TokenTree

# Runner-ups per drafted position a node may branch into.
TOP_K = 4


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
    # (-score, tie, parent, rank, depth)
    heap = [(-float(top_logprobs[0, 0]), 0, 0, 0, 1)] if positions and nodes else []
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
