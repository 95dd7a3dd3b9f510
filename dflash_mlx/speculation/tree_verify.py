"""One tree cycle: draft a block, build its token tree, verify every node in one target
forward, and walk down the tree to what the target accepts.

The engine runs it for a drafted cycle its `TreePolicy` gives a tree, and `verify_token_tree`
for a tree built otherwise (a copy tree, `copy_tree`); afterwards it keeps
the accepted path's KV entries (`compact_cache`) and features (`TreeVerify.path`).
"""

from dataclasses import dataclass
from typing import Any, List, Optional

import mlx.core as mx
import numpy as np

from dflash_mlx.models.target.tree_attention import TokenTree
from dflash_mlx.speculation.accept import GreedyAcceptor, greedy_choice
from dflash_mlx.speculation.processors import process_tree
from dflash_mlx.speculation.tree import accept_greedy, accept_sampled, build_tree, draft_top_k


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


def verify_tree(target, drafter, acceptor, cache: List[Any], last: mx.array, width: int, processors=(),
                prior=()) -> TreeVerify:
    """Draft a block of `width` - 1 positions, verify the best `width` - 1 nodes of its tree.

    Two host syncs: the draft's top-k (the tree's shape is built on the host), and the
    target's choice at every node (the walk down the tree)."""
    draft = drafter.draft
    draft_logits = drafter.draft_logits(last, width)
    own = acceptor.propose(draft, draft_logits).tokens
    ids, logprobs = draft_top_k(draft, draft_logits, own)
    mx.eval(ids, logprobs)
    tree = build_tree(int(last.item()), np.array(ids), np.array(logprobs), width - 1)
    return verify_token_tree(target, acceptor, cache, tree, drafter.layer_ids, drafter.fuse, processors, prior)


def verify_token_tree(target, acceptor, cache: List[Any], tree: TokenTree, layer_ids: List[int],
                      fuse=None, processors=(), prior=()) -> TreeVerify:
    """Verify every node of `tree` (its root the last committed token) in one target forward
    and walk down to what the target accepts (one host sync). Its nodes are fixed tokens:
    a draft's tree or a copy tree (`copy_tree`) alike. `processors`: the row's logits processors,
    each node's logits processed after `prior` (the tokens before the root) and its path."""
    start = cache[0].offset
    h, feats, _ = target.forward(mx.array([tree.tokens]), cache, layer_ids, tree=tree, fuse=fuse)
    logits = process_tree(processors, prior, tree, target.logits(h)[0])
    if isinstance(acceptor, GreedyAcceptor):
        choices = greedy_choice(logits)
        mx.eval(choices)
        path, bonus = accept_greedy(tree, choices.tolist())
    else:
        path, bonus = accept_sampled(tree, acceptor.logprobs(logits))
    tokens = [tree.tokens[n] for n in path[1:]] + [bonus]
    return TreeVerify(tree, path, tokens, logits, feats, start)
