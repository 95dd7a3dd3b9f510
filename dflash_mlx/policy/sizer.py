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
that follows what slows every width alike (a neighbour job), so widths timed at
different moments stay comparable. Width 1 is what it is, a plain decode step
with no draft forward, timed on its own; other widths are timed where they ran
and interpolated between measured widths elsewhere (never a line through all of
them: cost jumps where the hardware changes regime, and on some BLAS it is not
even monotonic); past the widest one timed, cost grows on as it did from width 1
up to it. Wider widths are explored by doubling: one is tried once half of it is
timed. Only the width that runs is timed, so a close rival of the best width is
timed again now and then, ever more rarely while it keeps losing. When width 1
wins, a cheap probe (width 2) runs now and then, ever more rarely while it finds
nothing, so a poor draft costs little and a draft that gets better is picked up
again. The output never depends on the width: every width is exact, only the
speed changes.

Cycle times are kept per range of context lengths (`context_bucket`): every verify
row attends to the whole context, so what a wide verify costs next to one row grows
with it (on a 2-core CPU width 4 costs 1.03x width 1 at 100 tokens of context and
1.33x at 3,500). Times learned on short prompts would price wide widths too low in a
long document (a load factor scales every width alike). In a range the context enters
for the first time, width 1 is timed first; until a width is timed there, its time is
another range's plus what the context added to width 1 there, once per row and a
learned share of it for every further row (`_prior`). Acceptance is kept across ranges.

What a `BlockSizer` learns belongs to the target/draft pair and the machine,
not to one prompt, so `sizer_for` keeps one per pair for the life of the
process: a chat, a server or a benchmark pays the exploration once, and later
calls start from what earlier ones measured (acceptance still fades with every
drafted cycle, so a change of subject is followed as before).
"""

import statistics
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from dflash_mlx.identity import IdentityMap


# Context lengths below this share one range of cycle times; above it, one range per doubling.
CONTEXT_RANGE = 512


def context_bucket(tokens: int) -> int:
    """The range of context lengths `tokens` falls in: 0 below `CONTEXT_RANGE`, then one per doubling."""
    return (max(0, tokens) // CONTEXT_RANGE).bit_length()


@dataclass
class WidthTimes:
    """Cycle times measured in one range of context lengths."""

    times: Dict[int, float] = field(default_factory=dict)  # width -> seconds (median of recent cycles)
    recent: Dict[int, List[float]] = field(default_factory=dict)  # width -> its last cycle times
    samples: Dict[int, int] = field(default_factory=dict)  # width -> cycles timed


class PerContext:
    """A `WidthTimes` per range of context lengths (`context_bucket`); `at(tokens)` moves to
    the range of a context of `tokens`, `here` is that range's (made on first use)."""

    def __init__(self):
        self.bucket = 0
        self.ranges: Dict[int, WidthTimes] = {}

    def at(self, tokens: int):
        self.bucket = context_bucket(tokens)

    def of(self, bucket: int) -> WidthTimes:
        """Range `bucket`'s times (made on first use)."""
        timed = self.ranges.get(bucket)
        if timed is None:
            timed = self.ranges[bucket] = WidthTimes()
        return timed

    @property
    def here(self) -> WidthTimes:
        return self.of(self.bucket)


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
        self.context = PerContext()  # cycle times per range of context lengths
        self.recent_cycles = recent_cycles
        self.min_probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.probe_every = probe_every
        self.since_probe = 0
        self.probing = False

    # -- cycle times, in the current context range --------------------------------

    def at_context(self, tokens: int):
        """The cycles chosen and timed next run with `tokens` of context."""
        self.context.at(tokens)

    @property
    def times(self) -> Dict[int, float]:
        """width -> seconds per cycle (in load units) at the current context range."""
        return self.context.here.times

    @property
    def samples(self) -> Dict[int, int]:
        return self.context.here.samples

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
        """Measured seconds at `width` in the current context range; else what another
        range's times say it costs here (`_prior`); else estimated from this range's
        widths (`_estimate`). None before anything above 1 was measured."""
        if width in self.times:
            return self.times[width]
        if width == 1:
            return None
        prior = self._prior(width)
        return prior if prior is not None else _estimate(self.times, width)

    def _reference(self) -> Optional[WidthTimes]:
        """The nearest other context range with width 1 and a drafted width timed."""
        here = self.context.bucket
        ranges = [(abs(b - here), b) for b, r in self.context.ranges.items()
                  if b != here and r.samples.get(1, 0) >= 2 and any(w > 1 for w in r.times)]
        return self.context.ranges[min(ranges)[1]] if ranges else None

    def _prior(self, width: int) -> Optional[float]:
        """`width`'s time in this range from a range where it was timed (or estimated), once
        width 1 is timed here: t_there(w) + (t1_here - t1_there) * (1 + share * (w - 1)),
        never below width 1's time here.
        What the context adds to a one-row step, each further verify row adds `share` of
        (`_row_share`): on a 2-core CPU about a quarter, measured from 200 to 3,500 tokens
        of context at widths 2-16; on a GPU next to nothing."""
        if self.samples.get(1, 0) < 2:
            return None
        ref = self._reference()
        if ref is None:
            return None
        there = _estimate(ref.times, width)
        if there is None:
            return None
        grown = self.times[1] - ref.times[1]
        # A shorter context saves each row's attention, but only the first row's saving is
        # known: taking off no more keeps a drafted cycle priced at no less than it costs.
        share = self._row_share(ref) if grown > 0 else 0.0
        return max(self.times[1], there + grown * (1 + share * (width - 1)))

    def _row_share(self, ref: WidthTimes) -> float:
        """The share of the first row's context cost each further verify row adds, from the
        drafted widths timed both here and in `ref` (median); 1, the most, until one is."""
        grown = self.times[1] - ref.times[1]  # > 0: called for a longer context only
        shares = []
        for w, t in self.times.items():
            there = _estimate(ref.times, w) if w > 1 else None
            if there is not None:
                shares.append(((t - there) / grown - 1) / (w - 1))
        return min(1.0, max(0.0, statistics.median(shares))) if shares else 1.0

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
            if width > 2 * max((w for w in self.times if w > 1), default=1):
                # explored by doubling: a width is tried once half of it is timed (past the
                # widest timed width cost may grow by every row: a long context on a CPU)
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
        # First a moderate width (cheap if the draft is poor; a good draft widens by
        # doubling from it), then width 1 (a plain decode step): the two ends every
        # choice is judged between. In a new context range another range's times
        # price the drafted widths (`_prior`) once width 1 is timed here.
        if not any(w > 1 for w in self.times) and self._reference() is None:
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
        recent = self.context.here.recent.setdefault(width, [])
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


def _estimate(times: Dict[int, float], width: int) -> Optional[float]:
    """A drafted width's seconds from one range's timed widths: its own time if timed; else
    interpolated between the nearest drafted widths timed (a draft forward runs at every
    width above 1), or the nearest one below their range; past the widest one, growing on
    as from width 1 up to it (every row's attention adds to a cycle on a CPU with a long
    context; on a GPU this overrates a flat cost until the width is timed, which
    `hoped_rate` lets happen)."""
    if width in times:
        return times[width]
    drafted = {w: t for w, t in times.items() if w > 1}
    if drafted and width > max(drafted) and 1 in times:
        widest = max(drafted)
        growth = max(0.0, (drafted[widest] - times[1]) / (widest - 1))
        return drafted[widest] + growth * (width - widest)
    return _interpolate(width, drafted)


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
