"""Copy proposals: propose the continuation of the longest earlier match of the context's suffix.

Rewrites, edits, quotes and repeated answers are mostly spans of what the context
already holds. `ContextIndex` keeps, for every n-gram of the context (n up to
`MAX_NGRAM`) that has a next token, the latest position where it ended; a lookup
finds the longest n-gram the context ends with that occurred before, and proposes
what followed it (past the end of the context, a repeat continues with its period).
Appending a token costs `MAX_NGRAM` dictionary writes, so the index follows the
committed tokens at amortized O(1) per token.

`CopyRecord` learns how often copies are right: per match length and per depth of
the proposal, as decayed hit/trial counts (the same estimate `adaptive.BlockSizer`
keeps for the draft), and gives the expected number of accepted tokens of a copy
(cf. Arctic Inference's suffix decoding, which scores a candidate by its expected
accepted tokens). A copy is a deterministic proposal: greedy acceptance is exact,
and at temperature > 0 it is a one-hot q, exact with the usual rejection step.
"""

import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from dflash_mlx.policy.sizer import PerContext, _interpolate

MAX_NGRAM = 8


@dataclass
class CopyMatch:
    """The context's last `length` tokens occurred before, ending just before `start`:
    what followed them, `continuation`, is the proposal."""

    length: int
    start: int
    continuation: List[int]


class ContextIndex:
    """Hashed n-grams (n = 1..MAX_NGRAM) of a token sequence -> the latest position each
    ended at, for n-grams that have a next token."""

    def __init__(self, tokens: Sequence[int] = ()):
        self.tokens: List[int] = []
        self.latest: Dict[Tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]):
        seq, latest = self.tokens, self.latest
        for t in tokens:
            i = len(seq)  # the new token's position: every n-gram ending at i-1 now has a next token
            for n in range(1, min(MAX_NGRAM, i) + 1):
                latest[tuple(seq[i - n : i])] = i - 1
            seq.append(int(t))

    def follows(self, tokens: Sequence[int]) -> bool:
        """Whether the index's tokens are a prefix of `tokens` (then `extend` brings it up to date)."""
        n = len(self.tokens)
        return len(tokens) >= n and list(tokens[:n]) == self.tokens

    def match(self, max_tokens: int) -> Optional[CopyMatch]:
        """The longest earlier occurrence of the context's suffix and up to `max_tokens`
        tokens of what followed it; None when not even the last token occurred before."""
        seq = self.tokens
        end = len(seq)
        for n in range(min(MAX_NGRAM, end - 1), 0, -1):
            last = self.latest.get(tuple(seq[end - n :]))
            if last is None or last >= end - 1:
                continue
            start = last + 1
            period = end - start  # the match repeats every `period` tokens past the end
            continuation = [seq[start + j] if start + j < end else seq[start + (j % period)]
                            for j in range(max_tokens)]
            return CopyMatch(n, start, continuation)
        return None


class CopyRecord:
    """How often a copy's tokens are accepted, per match length and depth (decayed counts)."""

    def __init__(self, max_depth: int, decay: float = 0.95, prior: float = 0.3, prior_strength: float = 2.0):
        self.max_depth = max_depth
        self.decay = decay
        self.prior = prior
        self.prior_strength = prior_strength
        self.hits = [[0.0] * max_depth for _ in range(MAX_NGRAM + 1)]
        self.trials = [[0.0] * max_depth for _ in range(MAX_NGRAM + 1)]

    def alpha(self, length: int) -> List[float]:
        """P(copy token k+1 accepted | tokens up to k were), per depth k, for a match of `length`.
        A depth seen rarely leans on the depth above it."""
        hits, trials = self.hits[length], self.trials[length]
        out, above = [], self.prior
        for k in range(self.max_depth):
            rate = (hits[k] + self.prior_strength * above) / (trials[k] + self.prior_strength)
            out.append(rate)
            above = rate
        return out

    def expected_tokens(self, length: int, n: int) -> float:
        """Expected accepted copy tokens when `n` of them are verified."""
        total, chain = 0.0, 1.0
        for a in self.alpha(length)[:n]:
            chain *= a
            total += chain
        return total

    def update(self, length: int, proposed: int, accepted: int):
        """A copy of a match of `length`: `proposed` tokens verified, the first `accepted` right."""
        hits, trials = self.hits[length], self.trials[length]
        for k in range(self.max_depth):
            hits[k] *= self.decay
            trials[k] *= self.decay
        for k in range(min(proposed, accepted + 1, self.max_depth)):
            trials[k] += 1.0
            hits[k] += 1.0 if k < accepted else 0.0


# Verify rows a copy may fill: dense where acceptance changes most, as the draft's widths.
COPY_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 15)


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
        self.ranges = PerContext()  # copy cycle times per range of context lengths, the sizer's
        self.recent_cycles = recent_cycles

    @property
    def times(self) -> Dict[int, float]:
        """verify width -> copy cycle seconds (sizer's load units), at the sizer's context range."""
        return self.ranges.of(self.sizer.context.bucket).times

    def cycle_time(self, width: int) -> Optional[float]:
        if width in self.times:
            return self.times[width]
        own = _interpolate(width, self.times)  # the draft policy's rule between measured widths
        drafted = self.sizer.cycle_time(width)
        if own is None:
            return drafted
        return min(own, drafted) if drafted else own

    def rate(self, length: int, n: int) -> float:
        t = self.cycle_time(n + 1)
        return (1.0 + self.record.expected_tokens(length, n)) / t if t else 0.0

    def choose(self, match: Optional[CopyMatch], remaining: int, draft_width: int) -> int:
        """How many copy tokens to verify this cycle (0: none, run the draft's choice)."""
        if match is None or remaining < 2:
            return 0
        limit = min(self.max_length, len(match.continuation), remaining - 1)
        lengths = [n for n in COPY_LENGTHS if n <= limit]
        if not lengths:
            return 0
        best = max(lengths, key=lambda n: self.rate(match.length, n))
        rival = self.sizer.rate(draft_width)
        if self.rate(match.length, best) > rival * (1 + self.margin):
            return best
        return 0

    def update(self, length: int, proposed: int, accepted: int, seconds: float):
        self.record.update(length, proposed, accepted)
        here = self.ranges.of(self.sizer.context.bucket)
        _keep_time(here.times, here.recent, proposed + 1, seconds / self.sizer.load, self.recent_cycles)


def copy_policy_for(sizer) -> CopyPolicy:
    """The `CopyPolicy` riding on a target/draft pair's `BlockSizer` (made on first use)."""
    policy = getattr(sizer, "copies", None)
    if policy is None:
        policy = sizer.copies = CopyPolicy(sizer, max_length=max(1, sizer.max_block - 1))
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
    Times are kept per range of the batch's context length (`at_context`), as a sizer's."""

    def __init__(self, record: CopyRecord, max_length: int, margin: float = 0.05, recent_cycles: int = 9):
        self.record = record
        self.max_length = max_length
        self.margin = margin
        self.recent_cycles = recent_cycles
        self.context = PerContext()

    def at_context(self, tokens: int):
        self.context.at(tokens)

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
        return _interpolate(rows, self.times)

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
                copied = 1.0 + self.record.expected_tokens(m.length, c) if c >= 1 else 0.0
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
        return best, value(best)[1]

    def update(self, rows: int, seconds: float):
        """The time of a batched verify of `rows` rows in all (copies or not)."""
        _keep_time(self.times, self.context.here.recent, rows, seconds, self.recent_cycles)


def _keep_time(times: Dict[int, float], recent: Dict[int, List[float]], key: int, seconds: float, keep: int):
    """`times[key]`: the median of its last `keep` samples, as `BlockSizer` times its widths."""
    samples = recent.setdefault(key, [])
    samples.append(seconds)
    del samples[:-keep]
    times[key] = statistics.median(samples)


def batch_copy_policy_for(sizer) -> BatchCopyPolicy:
    """The `BatchCopyPolicy` of a target/draft pair, sharing its lone rows' copy record."""
    policy = getattr(sizer, "batch_copies", None)
    if policy is None:
        lone = copy_policy_for(sizer)
        policy = sizer.batch_copies = BatchCopyPolicy(lone.record, lone.max_length)
    return policy
