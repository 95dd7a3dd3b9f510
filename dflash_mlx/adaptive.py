"""Verify width per cycle: fixed, or chosen from what has been measured (`block_size="auto"`).

A wide verify only pays if the draft is usually right deep into the block. On
CPUs (and for quantized or MoE targets on Apple GPUs) a 16-token verify costs
1.5-2x a one-token decode, so a weak draft at full width is slower than plain
decoding. `BlockSizer` maximises tokens committed per second:

    E(w) / t(w),   E(w) = 1 + sum_{k<w} prod_{j<=k} alpha_j

alpha_j: measured probability that draft position j is accepted given that the
positions before it were, from a long memory of drafted cycles (steady), or from
a short one while the two disagree (the draft got better or worse). t(w):
measured seconds per cycle at width w (the median of its recent cycles: a job
on another core only adds time, now and then a lot), divided by a load factor
that follows what slows every width alike (a neighbour job, a longer context),
so widths timed at different moments stay comparable. Width 1 is what it is, a
plain decode step with no draft forward, timed on its own; other widths are
timed where they ran and interpolated between measured widths elsewhere (never
a line through all of them: cost jumps where the hardware changes regime, and
on some BLAS it is not even monotonic). Only the width that runs is timed, so
a close rival of the best width is timed again now and then, ever more rarely
while it keeps losing. When width 1 wins, a cheap probe (width 2) runs now and then,
ever more rarely while it finds nothing, so a poor draft costs little and a
draft that gets better is picked up again. The output never
depends on the width: every width is exact, only the speed changes.

What a `BlockSizer` learns belongs to the target/draft pair and the machine,
not to one prompt, so `sizer_for` keeps one per pair for the life of the
process: a chat, a server or a benchmark pays the exploration once, and later
calls start from what earlier ones measured (acceptance still fades with every
drafted cycle, so a change of subject is followed as before).
"""

import statistics
import threading
from typing import Dict, List, Optional

from dflash_mlx.identity import IdentityMap


class FixedWidth:
    """The same verify width every cycle (fewer when fewer tokens remain)."""

    def __init__(self, width: int):
        self.width = width

    def choose(self, remaining: int) -> int:
        return min(self.width, remaining)

    def update(self, width: int, accept_length: int, seconds: float, chain: bool = True):
        pass


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
        self.load = 1.0  # how much slower cycles run now than when the times were learned
        # whether the cycles being chosen for may verify token trees (set per call by the
        # engine: a call without trees must not count on what trees would commit)
        self.trees_on = False
        self.load_follow = load_follow
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
        # Acceptance drifts with the text, so old cycles fade. Two memories: a long
        # one (steady estimates: a short memory's noise alone costs a few percent
        # against the best fixed width) and a short one that takes over while the
        # two disagree on the first draft position (the draft got better or worse).
        self.decay = decay
        self.slow_decay = slow_decay
        self.change = change
        self.prior = prior
        self.prior_strength = prior_strength
        n = max(max_block - 1, 0)
        self.hits: List[float] = [0.0] * n  # hits[k]: draft token k+1 accepted (decayed count)
        self.trials: List[float] = [0.0] * n  # trials[k]: draft token k+1 was reached
        self.slow_hits: List[float] = [0.0] * n  # the same, long memory
        self.slow_trials: List[float] = [0.0] * n
        self.times: Dict[int, float] = {}  # width -> seconds per cycle (median of recent cycles)
        self._recent: Dict[int, List[float]] = {}  # width -> its last `recent_cycles` cycle times
        self.recent_cycles = recent_cycles
        self.samples: Dict[int, int] = {}  # width -> cycles timed
        self.min_probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.probe_every = probe_every
        self.since_probe = 0
        self.probing = False

    # -- model --------------------------------------------------------------------

    def alpha(self) -> List[float]:
        """Acceptance rate per depth. A depth seen rarely leans on the depth above it
        (a draft right at depth k is usually about as right at k+1), so untried
        depths look neither perfect nor hopeless, and one observation moves them."""
        hits, trials = self.hits, self.trials
        if hits:
            drift = self._rate(hits, trials) - self._rate(self.slow_hits, self.slow_trials)
            if abs(drift) <= self.change:
                hits, trials = self.slow_hits, self.slow_trials
        out, above = [], self.prior
        s = self.prior_strength
        for h, t in zip(hits, trials):
            above = (h + s * above) / (t + s)
            out.append(above)
        return out

    def _rate(self, hits, trials) -> float:
        """First-position acceptance of one memory (the prior when it saw nothing)."""
        return (hits[0] + self.prior_strength * self.prior) / (trials[0] + self.prior_strength)

    def expected_tokens(self, width: int) -> float:
        """Tokens a cycle of `width` commits: the draft's chain, or a token tree of that
        width where one has done better (`token_tree.TreePolicy`, riding on this sizer)."""
        chain = self.chain_tokens(width)
        trees = getattr(self, "trees", None) if self.trees_on else None
        tree = trees.expected_tokens(width) if trees is not None else None
        return chain if tree is None else max(chain, tree)

    def chain_tokens(self, width: int) -> float:
        total, survive = 1.0, 1.0
        for a in self.alpha()[: width - 1]:
            survive *= a
            total += survive
        return total

    def cycle_time(self, width: int) -> Optional[float]:
        """Measured seconds at `width`; else interpolated between the nearest measured
        widths above 1 (a draft forward runs at every width above 1), or the nearest
        one outside their range. None before anything above 1 was measured."""
        if width in self.times:
            return self.times[width]
        if width == 1:
            return None
        return _interpolate(width, {w: t for w, t in self.times.items() if w > 1})

    def rate(self, width: int) -> float:
        t = self.cycle_time(width)
        return self.expected_tokens(width) / t if t else 0.0

    def trusted(self, width: int) -> bool:
        """Timed at least twice: one cycle can carry one-off work (the first cycle of a
        process, a kernel built for a new shape), so one sample alone decides nothing."""
        return self.samples.get(width, 0) >= 2

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
            return self.expected_tokens(width) / self.times[below]
        trusted = {w: t for w, t in self.times.items() if w > 1 and w != width and self.trusted(w)}
        predicted = _interpolate(width, trusted)
        if predicted is None or self.times[width] <= 1.1 * predicted:
            return self.rate(width)
        return self.expected_tokens(width) / predicted

    # -- policy -------------------------------------------------------------------

    def choose(self, remaining: int) -> int:
        limit = min(self.max_block, remaining)
        self.probing = False
        if limit <= 1:
            return 1
        # First a moderate width (cheap if the draft is poor; widths beyond it look
        # no dearer until measured, so a good draft widens at once), then width 1
        # (a plain decode step): the two ends every choice is judged between.
        if not any(w > 1 for w in self.times):
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
        untried = [w for w in candidates if w > 1 and not self.trusted(w)]
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
        """A drafted width close behind `best` whose time was last measured long ago, or
        None. Only the width that runs is timed, so one slow cycle could otherwise keep
        a better width out for good; each recheck that does not win waits twice as long."""
        floor = self.rate(best) * (1 - self.recheck_within)
        rivals = [w for w in candidates if w > 1 and w != best and w in self.times
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
        if width <= 1:
            return
        # Depth k (draft token k+1) was reached when every token before it was
        # accepted. Evidence fades with drafted cycles only (width-1 cycles say
        # nothing about the draft), and at every depth, reached or not: what
        # deep positions did while the draft was good must not outlive it.
        reached = min(width - 1, accept_length + 1)
        for hits, trials, d in ((self.hits, self.trials, self.decay),
                                (self.slow_hits, self.slow_trials, self.slow_decay)):
            for k in range(len(hits)):
                hits[k] = hits[k] * d + (1.0 if k < min(reached, accept_length) else 0.0)
                trials[k] = trials[k] * d + (1.0 if k < reached else 0.0)

    def update(self, width: int, accept_length: int, seconds: float, chain: bool = True):
        """`chain=False`: a cycle that verified something else than the draft's chain at
        this width (a token tree): its time counts, its accept length says nothing about
        the chain's per-depth acceptance."""
        self.cycle += 1
        self.last_run[width] = self.cycle
        if chain:
            self.observe(width, accept_length)
        # Per width, the median of its recent cycles: a job on another core only
        # adds time, now and then a lot, and one slow cycle must not price the best
        # width out for good (it is not timed again while another one wins). The
        # first cycle at a width can carry one-off work (the process's first cycle,
        # a kernel built for a new shape): the better of the first two stands.
        if self.cycle == 1:
            return  # the policy's first cycle runs cold (first graph, first allocations): untimed
        # Times are kept in the units of one load. Whatever slows every width alike
        # (a neighbour job starting, a longer context) shows first in the width that
        # runs, while the others keep times from before it: a poor draft's width 4
        # would then look cheap beside a width 1 timed under the new load. A cycle
        # slower or faster than its width's time moves the load a little; samples are
        # divided by it. Only a trusted time says what "slower" is (a first sample can
        # be one-off).
        if self.trusted(width):
            surprise = seconds / (self.load * self.times[width])
            self.load *= min(2.0, max(0.5, surprise)) ** self.load_follow
        seconds = seconds / self.load
        recent = self._recent.setdefault(width, [])
        recent.append(seconds)
        if self.samples.get(width, 0) == 1:
            recent[:] = [min(recent)]
        del recent[: -self.recent_cycles]
        self.times[width] = statistics.median(recent)
        self.samples[width] = self.samples.get(width, 0) + 1
        if self.probing:
            # A probe that found nothing: wait twice as long for the next one.
            found = accept_length > 0
            self.probe_every = (
                self.min_probe_every if found else min(self.max_probe_every, 2 * self.probe_every)
            )


# (model, draft) -> its BlockSizer, for as long as both live.
_SIZERS = IdentityMap()
_SIZERS_LOCK = threading.Lock()


def sizer_for(model, draft) -> BlockSizer:
    """The process's `BlockSizer` for this target/draft pair (made on first use)."""
    with _SIZERS_LOCK:
        sizer = _SIZERS.get((model, draft))
        if sizer is None:
            sizer = BlockSizer(draft.block_size)
            _SIZERS.put((model, draft), sizer)
        return sizer


def forget_sizers():
    """Drop every learned width policy (the next "auto" call explores from scratch)."""
    with _SIZERS_LOCK:
        _SIZERS.clear()


def _interpolate(width: int, times: Dict[int, float]) -> Optional[float]:
    """Seconds at `width` from measured (width -> seconds) points: linear between the
    nearest measured widths, the next one up below their range (cost grows with width:
    an upper bound), extended along the last two above it (never falling)."""
    points = sorted(times.items())
    if not points:
        return None
    below = [(w, t) for w, t in points if w < width]
    above = [(w, t) for w, t in points if w > width]
    if not below:
        return above[0][1]
    if not above:
        if len(below) == 1:
            return below[-1][1]
        (w0, t0), (w1, t1) = below[-2], below[-1]
        return t1 + max(0.0, (t1 - t0) / (w1 - w0)) * (width - w1)
    (w0, t0), (w1, t1) = below[-1], above[0]
    return t0 + (t1 - t0) * (width - w0) / (w1 - w0)
