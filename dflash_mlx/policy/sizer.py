"""Verify width per cycle: fixed, or chosen from what has been measured (`block_size="auto"`).

A wide verify only pays if the draft is usually right deep into the block. On
CPUs (and for quantized or MoE targets on Apple GPUs) a 16-token verify costs
1.5-2x a one-token decode, so a weak draft at full width is slower than plain
decoding. `BlockSizer` maximises tokens committed per second:

    E(w) / t(w),   E(w) = 1 + sum_{k<w} prod_{j<=k} alpha_j

alpha_j: measured probability that draft position j is accepted given that the
positions before it were (`acceptance.DraftAcceptance`). t(w): measured seconds per
cycle at width w, per range of context lengths, in units of the current load
(`cost.CycleCosts`). Acceptance is kept across context ranges.

Wider widths are explored by doubling: one is tried once half of it is timed. Only
the width that runs is timed, so a close rival of the best width is timed again now
and then, ever more rarely while it keeps losing. When width 1 wins, a cheap probe
(width 2) runs now and then, ever more rarely while it finds nothing, so a poor draft
costs little and a draft that gets better is picked up again. The output never
depends on the width: every width is exact, only the speed changes.

What a `BlockSizer` learns belongs to the target/draft pair and the machine,
not to one prompt, so `sizer_for` keeps one per pair for the life of the
process: a chat, a server or a benchmark pays the exploration once, and later
calls start from what earlier ones measured (acceptance still fades with every
drafted cycle, so a change of subject is followed as before).
"""

import threading
from typing import Callable, Dict, List, Optional

from dflash_mlx.identity import IdentityMap, pair
from dflash_mlx.policy.acceptance import DraftAcceptance
from dflash_mlx.policy.cost import CycleCosts, interpolate
from dflash_mlx.policy.per_context import PerContext


class FixedWidth:
    """The same verify width every cycle (fewer when fewer tokens remain)."""

    def __init__(self, width: int):
        self.width = width

    def at_context(self, tokens: int):
        pass

    def choose(self, remaining: int) -> int:
        return min(self.width, remaining)

    def update(self, width: int, accept_length: int, seconds: float, chain: bool = True):
        pass

    def count(self, width: int, accept_length: int, chain: bool = True) -> Callable[[float], None]:
        return _untimed


class BlockSizer:
    """Adaptive verify width. `choose` before a cycle, `update` with what it measured."""

    def __init__(
        self,
        max_block: int,
        decay: float = 0.85,
        slow_decay: float = 0.95,
        change: float = 0.2,
        prior: float = 0.5,
        prior_strength: float = 1.0,
        first_width: int = 4,
        probe_every: int = 8,
        max_probe_every: int = 32,
        margin: float = 0.05,
        min_drafted_gain: float = 0.2,
        min_hoped_gain: float = 0.02,
        recent_cycles: int = 9,
        recheck_every: int = 16,
        max_recheck_gap: int = 256,
        recheck_within: float = 0.2,
        load_follow: float = 0.25,
    ):
        self.acceptance = DraftAcceptance(max(max_block - 1, 0), decay, slow_decay, change, prior, prior_strength)
        self.costs = CycleCosts(recent_cycles, load_follow)
        # whether the cycles being chosen for may verify token trees (set per call by the
        # engine: a call without trees must not count on what trees would commit)
        self.trees_on = False
        self.recheck_every = recheck_every
        self.max_recheck_gap = max_recheck_gap
        self.recheck_within = recheck_within
        self.cycle = 0  # cycles updated so far
        self.last_run: Dict[int, int] = {}  # width -> the cycle it last ran in
        self.recheck_gap: Dict[int, int] = {}  # width -> cycles to wait before timing it again
        self.margin = margin
        self.min_hoped_gain = min_hoped_gain
        self.min_drafted_gain = min_drafted_gain
        self.max_block = max_block
        self.first_width = first_width
        # Widths tried: dense where acceptance changes most, sparse deep in the
        # block (a rate is flat near its best, and each width costs a cycle to learn).
        self.widths = sorted({w for w in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if w < max_block} | {max_block})
        self.min_probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.probe_every = probe_every
        self.since_probe = 0
        self.probing = False

    # -- what was measured (kept by `costs` and `acceptance`) ---------------------

    def at_context(self, tokens: int):
        """The cycles chosen and timed next run with `tokens` of context."""
        self.costs.at_context(tokens)

    @property
    def context(self) -> PerContext:
        return self.costs.context

    @property
    def load(self) -> float:
        return self.costs.load

    @property
    def times(self) -> Dict[int, float]:
        """width -> seconds per cycle (in load units) at the current context range."""
        return self.costs.times

    @property
    def samples(self) -> Dict[int, int]:
        return self.costs.samples

    @property
    def hits(self) -> List[float]:
        """The short memory's per-depth hits and trials (`DraftAcceptance`; tests set them)."""
        return self.acceptance.hits

    @hits.setter
    def hits(self, hits: List[float]):
        self.acceptance.hits = hits

    @property
    def trials(self) -> List[float]:
        return self.acceptance.trials

    @trials.setter
    def trials(self, trials: List[float]):
        self.acceptance.trials = trials

    def cycle_time(self, width: int) -> Optional[float]:
        return self.costs.cycle_time(width)

    def chain_tokens(self, width: int) -> float:
        return self.acceptance.chain_tokens(width)

    def expected_tokens(self, width: int) -> float:
        """Tokens a cycle of `width` commits: the draft's chain, or a token tree of that
        width where one has done better (`policy.trees.TreePolicy`, riding on this sizer)."""
        chain = self.chain_tokens(width)
        trees = getattr(self, "trees", None) if self.trees_on else None
        tree = trees.expected_tokens(width) if trees is not None else None
        return chain if tree is None else max(chain, tree)

    def rate(self, width: int) -> float:
        t = self.cycle_time(width)
        return self.expected_tokens(width) / t if t else 0.0

    def hoped_rate(self, width: int) -> float:
        """What running `width` (again) could find. Never run: its cost might be as low
        as the nearest measured width below it (cost is flat up to a regime change,
        then jumps). Timed once: what the trusted widths around it predict, when its
        one sample sits well above that (a disturbed cycle); else its sample stands."""
        if width not in self.times:
            below = max(w for w in self.times if w < width)
            if self.expected_tokens(width) < self.expected_tokens(below) * (1 + self.min_hoped_gain):
                # Even at `below`'s cost it would add next to nothing: not worth a cycle.
                return self.rate(width)
            if width > 2 * max((w for w in self.times if w > 1), default=1):
                # explored by doubling: a width is tried once half of it is timed (past the
                # widest timed width cost may grow by every row: a long context on a CPU)
                return self.rate(width)
            return self.expected_tokens(width) / self.times[below]
        trusted = {w: t for w, t in self.times.items() if w > 1 and w != width and self.costs.trusted(w)}
        predicted = interpolate(width, trusted)
        if predicted is None or self.times[width] <= 1.1 * predicted:
            return self.rate(width)
        return self.expected_tokens(width) / predicted

    # -- the choice ---------------------------------------------------------------

    def choose(self, remaining: int) -> int:
        limit = min(self.max_block, remaining)
        self.probing = False
        if limit <= 1:
            return 1
        # First a moderate width (cheap if the draft is poor; a good draft widens by
        # doubling from it), then width 1 (a plain decode step): the two ends every
        # choice is judged between. In a new context range another range's times
        # price the drafted widths (`CycleCosts._prior`) once width 1 is timed here.
        if not any(w > 1 for w in self.times) and self.costs.reference() is None:
            return min(self.first_width, limit)
        if self.samples.get(1, 0) < 2:
            # Twice: every choice is judged against it, and it is not timed again
            # while drafting wins, so one disturbed cycle must not set it.
            return 1
        candidates = [w for w in self.widths if w <= limit] + ([limit] if limit not in self.widths else [])
        best = max(candidates, key=self.rate)
        # A width not yet trusted may be cheaper than interpolation (or its one
        # sample) says; on some BLAS cost is not even monotonic (3 rows can cost
        # more than 4). Run it if what it could find clearly beats `best`.
        untried = [w for w in candidates if w > 1 and not self.costs.trusted(w)]
        if untried:
            hopeful = max(untried, key=self.hoped_rate)
            if self.hoped_rate(hopeful) > self.rate(best) * (1 + self.min_hoped_gain):
                self.since_probe = 0
                return hopeful
        if best > 1:
            self.since_probe = 0
            self.recheck_gap[best] = self.recheck_every
            return self._stale_rival(candidates, best) or best
        # Near a tie keep drafting (at the best width already measured) if the
        # draft gets something right: a drafted cycle is what keeps acceptance
        # measured, width 1 learns nothing. A draft that is almost never right is
        # no tie, however cheap its cycle.
        measured = [w for w in candidates if w > 1 and w in self.times]
        drafted = max(measured, key=self.rate) if measured else None
        if (drafted and self.rate(drafted) * (1 + self.margin) >= self.rate(1)
                and self.expected_tokens(drafted) - 1 >= self.min_drafted_gain):
            self.since_probe = 0
            return drafted
        self.since_probe += 1
        if self.since_probe < self.probe_every:
            return 1
        # The cheapest drafted cycle: it measures the first draft position, which
        # is what would have to improve before any wider width could win.
        self.since_probe = 0
        self.probing = True
        return 2

    def _stale_rival(self, candidates: List[int], best: int) -> Optional[int]:
        """A width close behind `best` whose time was last measured long ago, or None.
        Only the width that runs is timed, so one slow cycle could otherwise keep a better
        width out for good (width 1 too: plain steps timed while a neighbour job ran make a
        poor draft's drafted cycles look cheap, and drafting would then never time them
        again); each recheck that does not win waits twice as long."""
        floor = self.rate(best) * (1 - self.recheck_within)
        rivals = [w for w in candidates if w != best and w in self.times
                  and self.rate(w) >= floor
                  and self.cycle - self.last_run.get(w, 0) >= self.recheck_gap.get(w, self.recheck_every)]
        if not rivals:
            return None
        rival = max(rivals, key=self.rate)
        self.recheck_gap[rival] = min(self.max_recheck_gap, 2 * self.recheck_gap.get(rival, self.recheck_every))
        return rival

    def observe(self, width: int, accept_length: int):
        """What one drafted chain of `width` accepted (the acceptance part of `update`; a
        batch cycle observes each of its rows and times the cycle once)."""
        self.acceptance.observe(width, accept_length)

    def update(self, width: int, accept_length: int, seconds: float, chain: bool = True):
        """`chain=False`: a cycle that verified something else than the draft's chain at
        this width (a token tree): its time counts, its accept length says nothing about
        the chain's per-depth acceptance."""
        self.count(width, accept_length, chain)(seconds)

    def count(self, width: int, accept_length: int, chain: bool = True) -> Callable[[float], None]:
        """`update` in two halves: what the cycle accepted is taken now (acceptance, the cycle
        count, a probe's outcome); the returned function takes its seconds. A split target's
        ranks learn rank 0's time a cycle or more later (`engine.distributed`), and the next
        choices must not wait for it to see what was accepted."""
        self.cycle += 1
        self.last_run[width] = self.cycle
        if chain:
            self.observe(width, accept_length)
        if self.probing:
            # A probe that found nothing: wait twice as long for the next one.
            found = accept_length > 0
            self.probe_every = (
                self.min_probe_every if found else min(self.max_probe_every, 2 * self.probe_every)
            )
        if self.cycle == 1:
            return _untimed  # the policy's first cycle runs cold (first graph, first allocations)
        return lambda seconds: self.costs.record(width, seconds)


def _untimed(seconds: Optional[float]):
    pass


# (model, draft) -> its BlockSizer, for as long as both live.
_SIZERS = IdentityMap()
_SIZERS_LOCK = threading.Lock()


def sizer_for(model, draft) -> BlockSizer:
    """The process's `BlockSizer` for this target/draft pair (made on first use). With no
    draft (None) a sizer of width 1: plain steps, the rival copies are priced against."""
    key = pair(model, draft)
    with _SIZERS_LOCK:
        sizer = _SIZERS.get(key)
        if sizer is None:
            sizer = BlockSizer(draft.block_size if draft is not None else 1)
            _SIZERS.put(key, sizer)
        return sizer


def has_sizer(model, draft) -> bool:
    """Whether this process has a `BlockSizer` for the pair yet."""
    with _SIZERS_LOCK:
        return _SIZERS.get(pair(model, draft)) is not None


def adopt_sizer(model, draft, sizer: BlockSizer) -> bool:
    """Make `sizer` (what an earlier process learned, `policy.memory`) the pair's, unless the pair
    has one already. True when adopted."""
    with _SIZERS_LOCK:
        return _SIZERS.put_new(pair(model, draft), sizer)


def forget_sizers():
    """Drop every learned width policy (the next "auto" call explores from scratch)."""
    with _SIZERS_LOCK:
        _SIZERS.clear()
