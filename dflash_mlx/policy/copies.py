"""Whether a cycle verifies a copy of the context instead of the draft, and how much of it.

A copy (`speculation.copies`) is worth its expected accepted tokens (`CopyRecord`) per
second of its verify. `CopyPolicy` weighs that against the draft's own best rate for a row
decoding alone; `BatchCopyPolicy` chooses one verify width for a batch's rows, each row
copying or drafting. Both keep copy cycle times per range of context lengths, as the
draft's `BlockSizer` keeps its own. Copies from earlier requests (`speculation.suffix_index`,
`CopyMatch.shared`) are weighed by the same rule with a record of their own, so a source
that keeps failing stops being proposed without making the context's own copies look bad.

With no draft the rival is a plain step: the sizer (`BlockSizer` of width 1) has no drafted
widths, so copy cycles time its wider widths themselves (a copy cycle is a verify with
nothing drafted), and a copy width not yet trusted is explored by doubling from the widest
trusted one, priced at that one's time (on a CPU a verify of a few more rows costs little
more; on a GPU next to nothing).
"""

import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from dflash_mlx.policy.cost import interpolate
from dflash_mlx.policy.per_context import PerContext
from dflash_mlx.speculation.copies import COPY_LENGTHS, CopyMatch, CopyRecord


class CopyPolicy:
    """Whether this cycle verifies a copy instead of the draft, and how much of it.

    Rides on the draft's `BlockSizer` (same target/draft pair, same machine): a copy
    of n tokens is worth (1 + expected accepted copy tokens) per copy cycle time at
    width n + 1, against the draft's own best rate. A copy cycle runs no draft forward,
    so it costs at most a drafted cycle of its width; until copy cycles at a width are
    timed, that drafted time stands in (copies start out underrated, never overrated).
    """

    def __init__(self, sizer, max_length: int = 15, margin: float = 0.05, recent_cycles: int = 9):
        self.sizer = sizer
        self.max_length = max_length
        self.margin = margin
        self.record = CopyRecord(max_length)
        self.shared_record = CopyRecord(max_length)  # copies from earlier requests, kept apart
        self.ranges = PerContext()  # copy cycle times per range of context lengths, the sizer's
        self.recent_cycles = recent_cycles

    @property
    def drafted(self) -> bool:
        """Whether the sizer's widths above 1 are drafted cycles (with no draft they are copies)."""
        return self.sizer.max_block > 1

    @property
    def times(self) -> Dict[int, float]:
        """verify width -> copy cycle seconds (sizer's load units), at the sizer's context range."""
        return self.ranges.of(self.sizer.context.bucket).times if self.drafted else self.sizer.times

    def record_of(self, match: CopyMatch) -> CopyRecord:
        return self.shared_record if match.shared else self.record

    def cycle_time(self, width: int) -> Optional[float]:
        if not self.drafted:
            return self.sizer.cycle_time(width)
        if width in self.times:
            return self.times[width]
        own = interpolate(width, self.times)  # the draft policy's rule between measured widths
        drafted = self.sizer.cycle_time(width)
        if own is None:
            return drafted
        return min(own, drafted) if drafted else own

    def hoped_time(self, width: int) -> Optional[float]:
        """No draft: what a copy width not yet trusted could cost, the time of the widest trusted
        width below it when it is at most twice that one (explored by doubling); else None."""
        costs = self.sizer.costs
        below = [w for w in costs.times if w < width and costs.trusted(w)]
        if self.drafted or costs.trusted(width) or not below or width > 2 * max(below):
            return None
        return costs.times[max(below)]

    def rate(self, length: int, n: int, record: Optional[CopyRecord] = None) -> float:
        t = self.cycle_time(n + 1)
        return (1.0 + (record or self.record).expected_tokens(length, n)) / t if t else 0.0

    def choose(self, match: Optional[CopyMatch], remaining: int, draft_width: int) -> int:
        """How many copy tokens to verify this cycle (0: none, run the draft's choice)."""
        if match is None or remaining < 2:
            return 0
        limit = min(self.max_length, len(match.continuation), remaining - 1)
        lengths = [n for n in COPY_LENGTHS if n <= limit]
        if not lengths:
            return 0
        record = self.record_of(match)
        best = max(lengths, key=lambda n: self.rate(match.length, n, record))
        rival = self.sizer.rate(draft_width) * (1 + self.margin)
        if self.rate(match.length, best, record) > rival:
            return best
        hoped = {n: (1.0 + record.expected_tokens(match.length, n)) / t
                 for n in lengths if (t := self.hoped_time(n + 1))}
        if hoped and max(hoped.values()) > rival:
            return max(hoped, key=hoped.get)
        return 0

    def best(self, matches: Sequence[Optional[CopyMatch]], remaining: int,
             draft_width: int) -> Tuple[Optional[CopyMatch], int]:
        """(the candidate to copy, how many of its tokens) of the context's own match and
        one from earlier requests; (None, 0): none pays, run the draft's choice."""
        chosen = [(m, self.choose(m, remaining, draft_width)) for m in matches if m is not None]
        chosen = [(m, n) for m, n in chosen if n]
        if not chosen:
            return None, 0

        def value(c: Tuple[CopyMatch, int]) -> float:
            m, n = c
            t = self.cycle_time(n + 1) or self.hoped_time(n + 1)
            return (1.0 + self.record_of(m).expected_tokens(m.length, n)) / t if t else 0.0

        return max(chosen, key=value)

    def update(self, length: int, proposed: int, accepted: int, seconds: float, shared: bool = False):
        self.count(length, proposed, accepted, shared)(seconds)

    def count(self, length: int, proposed: int, accepted: int, shared: bool = False) -> Callable[[float], None]:
        """`update` in two halves (as `BlockSizer.count`): what the copy accepted now, its
        seconds when the returned function gets them."""
        (self.shared_record if shared else self.record).update(length, proposed, accepted)
        return lambda seconds: self.timed(proposed + 1, seconds)

    def timed(self, width: int, seconds: float):
        """A copy cycle (a chain or a copy tree) verified `width` rows in `seconds`."""
        if not self.drafted:  # the sizer's widths above 1 are copies' own
            self.sizer.costs.record(width, seconds)
            return
        here = self.ranges.of(self.sizer.context.bucket)
        _keep_time(here.times, here.recent, width, seconds / self.sizer.load, self.recent_cycles)


# With no draft a copy may be as long as the longest of `COPY_LENGTHS`.
NO_DRAFT_MAX_COPY = COPY_LENGTHS[-1]


def copy_policy_for(sizer) -> CopyPolicy:
    """The `CopyPolicy` riding on a target/draft pair's `BlockSizer` (made on first use)."""
    policy = getattr(sizer, "copies", None)
    if policy is None:
        longest = sizer.max_block - 1 if sizer.max_block > 1 else NO_DRAFT_MAX_COPY
        policy = sizer.copies = CopyPolicy(sizer, max_length=longest)
    return policy


class BatchCopyPolicy:
    """Copies in a batched cycle. Rows verify together at one width, so a copy that pays for
    one row widens every row's verify: a width is worth the tokens all rows are expected
    to commit at it (each row the better of its draft chain and its own copy) per second
    of a verify of that many rows. The batch's draft width is the rival.

    Copy acceptance is the lone rows' `CopyRecord` (same pair, same texts). Cost is per
    verify rows in all (rows x width): batched cycles time it, and a lone row's widths
    seed it (`seed`). A count beyond the measured ones is priced by the last two measured
    points, or in proportion to the one measured point: copies start out underrated.
    Times are kept per range of the batch's context length (`at_context`), as a sizer's.
    With no draft (`explore`) nothing seeds the costs of wider verifies: a count not yet
    timed is explored by doubling (`hoped_cost`), as a lone row's copy widths are."""

    def __init__(self, record: CopyRecord, max_length: int, margin: float = 0.05, recent_cycles: int = 9,
                 shared_record: Optional[CopyRecord] = None, explore: bool = False):
        self.record = record
        self.shared_record = shared_record or CopyRecord(max_length)  # copies from earlier requests
        self.explore = explore
        self.max_length = max_length
        self.margin = margin
        self.recent_cycles = recent_cycles
        self.context = PerContext()

    def at_context(self, tokens: int):
        self.context.at(tokens)

    def record_of(self, match: CopyMatch) -> CopyRecord:
        return self.shared_record if match.shared else self.record

    def pick(self, matches: Sequence[Optional[CopyMatch]], budget: int) -> Optional[CopyMatch]:
        """A row's candidate: of its context's match and one from earlier requests, the one
        expected to commit the most at the longest copy it could verify."""
        def expected(m: CopyMatch) -> float:
            n = min(self.max_length, len(m.continuation), budget - 1)
            return self.record_of(m).expected_tokens(m.length, n) if n >= 1 else -1.0

        found = [m for m in matches if m is not None]
        return max(found, key=expected) if found else None

    @property
    def times(self) -> Dict[int, float]:
        """verify rows in all -> seconds (median of recent cycles), at the current context range."""
        return self.context.here.times

    def seed(self, times: Dict[int, float]):
        """Cycle seconds of verifies of so many rows measured elsewhere (a lone row's widths),
        for counts the batch has not timed itself."""
        for n, t in times.items():
            self.times.setdefault(n, t)

    def cost(self, rows: int) -> Optional[float]:
        if rows in self.times:
            return self.times[rows]
        if not self.times:
            return None
        above = [n for n in self.times if n > rows]
        below = sorted(n for n in self.times if n < rows)
        if not above and len(below) == 1:
            return self.times[below[0]] * rows / below[0]
        return interpolate(rows, self.times)

    def plan(self, matches: Sequence[Optional[CopyMatch]], budgets: Sequence[int], width: int,
             chain_tokens) -> Tuple[int, List[int]]:
        """(verify width, copy tokens per row: 0 for a row that drafts) for this cycle.
        `width`: the batch's draft width; `chain_tokens(w)`: a drafted row's expected tokens
        at width w."""
        rows = len(matches)
        none = (width, [0] * rows)
        usable = [min(self.max_length, len(m.continuation), b - 1) if m is not None else 0
                  for m, b in zip(matches, budgets)]
        if max(usable) < 1:
            return none

        def value(w: int) -> Tuple[float, List[int]]:
            drafted = chain_tokens(w) if w > 1 else 1.0
            total, copies = 0.0, []
            for m, n in zip(matches, usable):
                c = min(n, w - 1)
                copied = 1.0 + self.record_of(m).expected_tokens(m.length, c) if c >= 1 else 0.0
                copies.append(c if copied > drafted else 0)
                total += max(drafted, copied)
            return total, copies

        def rate(w: int) -> float:
            t = self.cost(rows * w)
            return value(w)[0] / t if t else 0.0

        base = rate(width)
        candidates = sorted({n + 1 for n in COPY_LENGTHS if n <= max(usable)} | {width})
        best = max(candidates, key=rate)
        # another width only for copies that pay (how wide to draft is the draft policy's call)
        if best != width and (rate(best) <= base * (1 + self.margin) or not any(value(best)[1])):
            best = width
        if best == width and self.explore:
            def hoped(w: int) -> float:
                t = self.hoped_cost(rows * w)
                return value(w)[0] / t if t else 0.0

            hopeful = max(candidates, key=hoped)
            if hoped(hopeful) > base * (1 + self.margin) and any(value(hopeful)[1]):
                best = hopeful
        return best, value(best)[1]

    def hoped_cost(self, rows: int) -> Optional[float]:
        """No draft (`explore`): what a verify of `rows` rows in all, not yet timed twice here,
        could cost: the time of the most rows timed twice below it, when it is at most twice
        that many (explored by doubling, as a lone row's copies are); else None."""
        recent = self.context.here.recent
        trusted = [n for n, samples in recent.items() if len(samples) >= 2 and n < rows]
        if len(recent.get(rows, ())) >= 2 or not trusted or rows > 2 * max(trusted):
            return None
        return self.times[max(trusted)]

    def update(self, rows: int, seconds: float):
        """The time of a batched verify of `rows` rows in all (copies or not)."""
        _keep_time(self.times, self.context.here.recent, rows, seconds, self.recent_cycles)


def _keep_time(times: Dict[int, float], recent: Dict[int, List[float]], key: int, seconds: float, keep: int):
    """`times[key]`: the median of its last `keep` samples, as `CycleCosts.record` times a width."""
    samples = recent.setdefault(key, [])
    samples.append(seconds)
    del samples[:-keep]
    times[key] = statistics.median(samples)


def batch_copy_policy_for(sizer) -> BatchCopyPolicy:
    """The `BatchCopyPolicy` of a target/draft pair, sharing its lone rows' copy record."""
    policy = getattr(sizer, "batch_copies", None)
    if policy is None:
        lone = copy_policy_for(sizer)
        policy = sizer.batch_copies = BatchCopyPolicy(lone.record, lone.max_length,
                                                      shared_record=lone.shared_record, explore=not lone.drafted)
    return policy
