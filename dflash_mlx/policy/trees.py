"""Whether a drafted cycle verifies a token tree or the draft's chain (`TreePolicy`, one per
target/draft pair, riding on its `BlockSizer`)."""

from typing import Dict, Optional

# Widths (root + nodes) at which trees are tried when the sizer would not go there.
TREE_WIDTHS = (4, 6, 8, 12, 16)


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
