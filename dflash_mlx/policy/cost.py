"""What a cycle of each verify width costs: the cost model behind `BlockSizer`.

t(w), seconds per cycle at width w, is measured: the median of its recent cycles (a job
on another core only adds time, now and then a lot), divided by a load factor that
follows what slows every width alike (a neighbour job), so widths timed at different
moments stay comparable. Width 1 is what it is, a plain decode step with no draft
forward, timed on its own; other widths are timed where they ran and interpolated
between measured widths elsewhere (never a line through all of them: cost jumps where
the hardware changes regime, and on some BLAS it is not even monotonic); past the
widest one timed, cost grows on as it did from width 1 up to it.

Times are kept per range of context lengths (`per_context`). In a range the context
enters for the first time, width 1 is timed first; until a width is timed there, its
time is another range's plus what the context added to width 1 there, once per row and
a learned share of it for every further row (`CycleCosts._prior`).
"""

import statistics
from typing import Dict, Optional

from dflash_mlx.policy.per_context import PerContext, WidthTimes


class CycleCosts:
    """Seconds per cycle of each width, per range of context lengths, in load units.
    `record` a timed cycle, `cycle_time` prices a width in the current range."""

    def __init__(self, recent_cycles: int = 9, load_follow: float = 0.25):
        self.load = 1.0  # how much slower cycles run now than when the times were learned
        self.load_follow = load_follow
        self.recent_cycles = recent_cycles
        self.context = PerContext()  # cycle times per range of context lengths

    def at_context(self, tokens: int):
        """The cycles priced and timed next run with `tokens` of context."""
        self.context.at(tokens)

    @property
    def times(self) -> Dict[int, float]:
        """width -> seconds per cycle (in load units) at the current context range."""
        return self.context.here.times

    @property
    def samples(self) -> Dict[int, int]:
        return self.context.here.samples

    def trusted(self, width: int) -> bool:
        """Timed at least twice: one cycle can carry one-off work (the first cycle of a
        process, a kernel built for a new shape), so one sample alone decides nothing."""
        return self.samples.get(width, 0) >= 2

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

    def reference(self) -> Optional[WidthTimes]:
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
        ref = self.reference()
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

    def record(self, width: int, seconds: float):
        """A cycle of `width` took `seconds`.

        Per width, the median of its recent cycles: a job on another core only adds time,
        now and then a lot, and one slow cycle must not price the best width out for good
        (it is not timed again while another one wins). The first cycle at a width can
        carry one-off work (the process's first cycle, a kernel built for a new shape): the
        better of the first two stands.

        Times are kept in the units of one load. Whatever slows every width alike (a
        neighbour job starting, a longer context) shows first in the width that runs, while
        the others keep times from before it: a poor draft's width 4 would then look cheap
        beside a width 1 timed under the new load. A cycle slower or faster than its
        width's time moves the load a little; samples are divided by it. Only a trusted
        time says what "slower" is (a first sample can be one-off)."""
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


def _estimate(times: Dict[int, float], width: int) -> Optional[float]:
    """A drafted width's seconds from one range's timed widths: its own time if timed; else
    interpolated between the nearest drafted widths timed (a draft forward runs at every
    width above 1), or the nearest one below their range; past the widest one, growing on
    as from width 1 up to it (every row's attention adds to a cycle on a CPU with a long
    context; on a GPU this overrates a flat cost until the width is timed, which
    `BlockSizer.hoped_rate` lets happen)."""
    if width in times:
        return times[width]
    drafted = {w: t for w, t in times.items() if w > 1}
    if drafted and width > max(drafted) and 1 in times:
        widest = max(drafted)
        growth = max(0.0, (drafted[widest] - times[1]) / (widest - 1))
        return drafted[widest] + growth * (width - widest)
    return interpolate(width, drafted)


def interpolate(width: int, times: Dict[int, float]) -> Optional[float]:
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
