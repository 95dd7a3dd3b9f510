"""Copy trees: several continuations of the context's suffix verified as one token tree.

The same n-gram is often followed by different tokens in different places (a variable
renamed in one copy of a function, a list item with another value, an answer of earlier
requests that went on differently). A chain copy bets on one continuation; a copy tree
merges several into a trie (a shared prefix is verified once) and spends a bounded number
of nodes on those most likely to be reached, verified in one forward as a draft's tree is
(`tree_verify.verify_token_tree`) and accepted by the same walk: greedy, or `accept_sampled`
at temperature > 0, where every node is a fixed token (a one-hot proposal, as a chain
copy's), so the rejection step keeps the target's distribution. SuffixDecoding (Arctic
Inference) verifies such trees from its suffix trees, scoring nodes by how often each
continuation occurred; here candidates come from the hashed n-gram indexes (`copies`,
`suffix_index`), and a node's score is the chance the walk reaches it:

- along a candidate, as a chain copy: a token is accepted with the candidate's own
  per-depth acceptance (`CopyRecord.alpha` of its match length and source);
- where the candidates part, the first one's token is the main child, accepted as above;
  when it is rejected, each other child in turn is accepted with the copy tree's own learned
  rate (`RescueRecord`), the only statistic a chain copy cannot give.

Nodes are taken best first (`plan_copy_tree`); a sibling never scores above the one before
it, so a node's main child is taken before its alternatives and is tried first in the walk.
"""

import heapq
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from dflash_mlx.models.target.tree_attention import TokenTree
from dflash_mlx.speculation.copies import CopyMatch


@dataclass
class CopyTreePlan:
    """A copy tree and what it is expected to commit: `rank[i]`, the candidate that put node i
    there (-1 for the root); `reach[i]`, the chance the walk reaches it."""

    tree: TokenTree
    rank: List[int]
    reach: List[float]
    primary: Optional[CopyMatch] = None  # candidate 0, whose chain leads the tree (set by the policy)

    @property
    def expected_tokens(self) -> float:
        """Expected accepted nodes (the bonus token not counted)."""
        return sum(self.reach[1:])

    def branches(self) -> bool:
        return len(set(self.rank[1:])) > 1


class RescueRecord:
    """P(another candidate's token is accepted | the tokens tried before it at that node were
    rejected), per depth, as decayed hit/trial counts (a depth seen rarely leans on the one above)."""

    def __init__(self, max_depth: int, decay: float = 0.95, prior: float = 0.3, prior_strength: float = 2.0):
        self.max_depth = max_depth
        self.decay = decay
        self.prior = prior
        self.prior_strength = prior_strength
        self.hits = [0.0] * max_depth
        self.trials = [0.0] * max_depth

    def rates(self) -> List[float]:
        out, above = [], self.prior
        for k in range(self.max_depth):
            rate = (self.hits[k] + self.prior_strength * above) / (self.trials[k] + self.prior_strength)
            out.append(rate)
            above = rate
        return out

    def update(self, outcomes: Sequence[Tuple[int, bool]]):
        """One copy tree cycle's tries of other candidates' tokens: (depth, accepted) each."""
        self.hits = [h * self.decay for h in self.hits]
        self.trials = [t * self.decay for t in self.trials]
        for depth, accepted in outcomes:
            if depth < self.max_depth:
                self.trials[depth] += 1.0
                self.hits[depth] += 1.0 if accepted else 0.0


def plan_copy_tree(root: int, continuations: Sequence[Sequence[int]], alphas: Sequence[Sequence[float]],
                   rescue: Sequence[float], nodes: int) -> CopyTreePlan:
    """The `nodes` nodes of the candidates' trie most likely to be reached, best first.

    continuations: the candidates' tokens, the likeliest first; alphas[c][d]: P(candidate c's
    token d + 1 accepted | its first d were); rescue[d]: `RescueRecord.rates` at depth d.
    A node's children are its candidates' next tokens, in candidate order (shared tokens once).
    """
    # the whole trie: node -> token, parent, depth, rank (first candidate through it), children
    tokens, parents, depths, ranks, kids = [root], [-1], [0], [-1], [[]]
    for c, cont in enumerate(continuations):
        node = 0
        for token in cont[:nodes]:
            child = next((k for k in kids[node] if tokens[k] == token), None)
            if child is None:
                child = len(tokens)
                tokens.append(int(token))
                parents.append(node)
                depths.append(depths[node] + 1)
                ranks.append(c)
                kids.append([])
                kids[node].append(child)
            node = child
    reach = [1.0] + [0.0] * (len(tokens) - 1)
    picked: List[int] = []
    heap: List[Tuple[float, int]] = []  # (-reach, node): ties go to the earlier candidate

    def offer(node: int):
        children = kids[node]
        if not children:
            return
        d = depths[node]
        first = alphas[ranks[children[0]]]
        main = reach[node] * (first[d] if d < len(first) else 0.0)
        rest = reach[node] - main  # the main child rejected
        rate = rescue[d] if d < len(rescue) else 0.0
        above = main
        for i, child in enumerate(children):
            p = main if i == 0 else min(above, rest * rate)
            if i:
                rest *= 1.0 - rate
            reach[child] = above = p
            heapq.heappush(heap, (-p, child))

    offer(0)
    while heap and len(picked) < nodes:
        _, node = heapq.heappop(heap)
        picked.append(node)
        offer(node)
    # depth order, siblings in candidate order (the trie's own numbering within a depth)
    order = sorted(picked, key=lambda n: (depths[n], n))
    new = {0: 0, **{old: i + 1 for i, old in enumerate(order)}}
    tree = TokenTree([root] + [tokens[n] for n in order], [-1] + [new[parents[n]] for n in order],
                     [0] + [depths[n] for n in order])
    return CopyTreePlan(tree, [-1] + [ranks[n] for n in order], [1.0] + [reach[n] for n in order])


def walk_outcome(plan: CopyTreePlan, path: Sequence[int]) -> Tuple[int, int, List[Tuple[int, bool]]]:
    """What the accepted `path` (nodes, root first) says: (tokens of candidate 0 accepted,
    how many of its tokens were tried, the other candidates' tries as (depth, accepted)).

    Candidate 0's part is a chain copy's outcome (its nodes are tried first at every node);
    at each node of the path whose main child was rejected, the children after it were tried
    in turn up to the accepted one (or all of them)."""
    children = [[] for _ in plan.tree.tokens]
    for node, parent in enumerate(plan.tree.parents):
        if parent >= 0:
            children[parent].append(node)
    tries: List[Tuple[int, bool]] = []
    for i, node in enumerate(path):
        nxt = path[i + 1] if i + 1 < len(path) else None
        kids = children[node]
        if len(kids) > 1 and nxt != kids[0]:
            for k in kids[1:]:
                tries.append((plan.tree.depths[node], k == nxt))
                if k == nxt:
                    break
    primary = 0
    while primary + 1 < len(path) and plan.rank[path[primary + 1]] == 0:
        primary += 1
    tried = primary + (1 if any(plan.rank[k] == 0 for k in children[path[primary]]) else 0)
    return primary, tried, tries
