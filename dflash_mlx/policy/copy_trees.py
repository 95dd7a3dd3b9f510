"""Whether a copy cycle verifies a tree of several copy candidates, and how many nodes
(`CopyTreePolicy`, one per target/draft pair, riding on its `CopyPolicy`).

A copy tree (`speculation.copy_tree`) is priced by the rule every proposal is: (1 + its
expected accepted tokens) per second of a verify of its rows, against the chain copy the
`CopyPolicy` chose (if any) and the draft's best width (a plain step without a draft). A
tree spends the rows of a chain copy of its width, so both share the copy policy's cycle
times. Its expected tokens come from each candidate's chain acceptance (the copy records)
and the one statistic kept apart, the copy tree's own `RescueRecord`: how often another
candidate's token is right where the likeliest one's is not. A source whose alternatives
keep failing drives that rate down until its trees are worth no more than the chain they
contain, and they are no longer proposed; the chain record keeps learning from trees, as
the likeliest candidate's part of a tree is exactly a chain copy's outcome.
"""

from typing import Callable, Dict, List, Optional, Sequence

from dflash_mlx.policy.copies import CopyPolicy, copy_policy_for
from dflash_mlx.speculation.copies import COPY_LENGTHS, CopyMatch
from dflash_mlx.speculation.copy_tree import CopyTreePlan, RescueRecord, plan_copy_tree, walk_outcome

# Candidates a copy tree holds at most (a node's children are its candidates' next tokens).
MAX_CANDIDATES = 4


class CopyTreePolicy:
    """Copy trees for a lone row's copy cycles (`plan`, `update`)."""

    def __init__(self, copies: CopyPolicy, margin: float = 0.05, max_candidates: int = MAX_CANDIDATES):
        self.copies = copies
        self.margin = margin
        self.max_candidates = max_candidates
        self.rescue = RescueRecord(copies.max_length)

    def gather(self, index, shared) -> List[CopyMatch]:
        """Candidates of the context's own index (`ContextIndex`) and of earlier requests'
        (`SuffixIndex`, or None)."""
        found = index.matches(self.copies.max_length, self.max_candidates)
        if shared is not None:
            found += shared.matches(index.tokens, self.copies.max_length, self.max_candidates)
        return found

    def candidates(self, matches: Sequence[Optional[CopyMatch]], chosen: Optional[CopyMatch],
                   limit: int) -> List[CopyMatch]:
        """Distinct candidates, the chosen chain copy first, then the likeliest by their own
        source's record; one whose first `limit` tokens another's begin with adds nothing."""
        found = [m for m in matches if m is not None]

        def expected(m: CopyMatch) -> float:
            return self.copies.record_of(m).expected_tokens(m.length, min(limit, len(m.continuation)))

        ranked = ([chosen] if chosen is not None else []) + sorted(found, key=expected, reverse=True)
        out: List[CopyMatch] = []
        kept: List[tuple] = []
        for m in ranked:
            c = tuple(m.continuation[:limit])
            if c and not any(k[: len(c)] == c for k in kept):
                kept.append(c)
                out.append(m)
        return out[: self.max_candidates]

    def plan(self, root: int, matches: Sequence[Optional[CopyMatch]], chosen: Optional[CopyMatch],
             chosen_length: int, remaining: int, draft_width: int) -> Optional[CopyTreePlan]:
        """A copy tree to verify this cycle, or None (the chain copy or the draft's choice stands).
        `chosen`, `chosen_length`: the `CopyPolicy`'s chain copy (None, 0 when none pays)."""
        limit = min(self.copies.max_length, remaining - 1)
        if limit < 2:
            return None
        ranked = self.candidates(matches, chosen, limit)
        if len(ranked) < 2:
            return None
        full = self._plan(root, ranked, limit)
        if not full.branches():
            return None
        nodes = self.nodes_that_pay(full, chosen, chosen_length, draft_width)
        if not nodes:
            return None
        plan = self._plan(root, ranked, nodes)
        plan.primary = ranked[0]
        return plan if plan.branches() else None  # (ties may leave a chain: the chain copy's call)

    def nodes_that_pay(self, full: CopyTreePlan, chosen: Optional[CopyMatch], chosen_length: int,
                       draft_width: int) -> int:
        """How many of `full`'s nodes (its likeliest, as a tree that branches) are expected to
        commit the most per second, when that beats the chain copy and the draft; else 0."""
        reach = sorted(full.reach[1:], reverse=True)  # best first: each n best nodes form a tree
        expected = {n: sum(reach[:n]) for n in COPY_LENGTHS if 2 <= n <= len(reach)}
        branching = [n for n in expected if self._branches_within(full, n)]
        rival = max(self.copies.sizer.rate(draft_width), self._chain_value(chosen, chosen_length))
        rival *= 1 + self.margin
        for time_of in (self.copies.cycle_time, self.copies.hoped_time):
            rates: Dict[int, float] = {n: (1.0 + expected[n]) / t for n in branching if (t := time_of(n + 1))}
            if rates and max(rates.values()) > rival:
                return max(rates, key=rates.get)
        return 0

    def update(self, plan: CopyTreePlan, path: Sequence[int], seconds: float):
        """A copy tree cycle: `path` accepted (nodes, root first) in `seconds`."""
        self.count(plan, path)(seconds)

    def count(self, plan: CopyTreePlan, path: Sequence[int]) -> Callable[[float], None]:
        """`update` in two halves (as `BlockSizer.count`): the walk now, the seconds later."""
        accepted, tried, tries = walk_outcome(plan, path)
        self.rescue.update(tries)
        self.copies.record_of(plan.primary).update(plan.primary.length, tried, accepted)
        return lambda seconds: self.copies.timed(len(plan.tree), seconds)

    def _plan(self, root: int, ranked: Sequence[CopyMatch], nodes: int) -> CopyTreePlan:
        alphas = [self.copies.record_of(m).alpha(m.length) for m in ranked]
        return plan_copy_tree(root, [m.continuation[:nodes] for m in ranked], alphas, self.rescue.rates(), nodes)

    @staticmethod
    def _branches_within(plan: CopyTreePlan, n: int) -> bool:
        """Whether the `n` likeliest nodes hold more than one candidate's."""
        order = sorted(range(1, len(plan.reach)), key=lambda i: (-plan.reach[i], i))[:n]
        return len({plan.rank[i] for i in order}) > 1

    def _chain_value(self, chosen: Optional[CopyMatch], length: int) -> float:
        if chosen is None or not length:
            return 0.0
        t = self.copies.cycle_time(length + 1) or self.copies.hoped_time(length + 1)
        return (1.0 + self.copies.record_of(chosen).expected_tokens(chosen.length, length)) / t if t else 0.0


def copy_tree_policy_for(sizer) -> CopyTreePolicy:
    """The `CopyTreePolicy` riding on a target/draft pair's `BlockSizer` (made on first use)."""
    policy = getattr(sizer, "copy_trees", None)
    if policy is None:
        policy = sizer.copy_trees = CopyTreePolicy(copy_policy_for(sizer))
    return policy
