"""Cycle times kept per range of context lengths.

Every verify row attends to the whole context, so what a wide verify costs next to one
row grows with it (on a 2-core CPU width 4 costs 1.03x width 1 at 100 tokens of context
and 1.33x at 3,500): times learned on short prompts would price wide widths too low in a
long document. So each policy that times its cycles (`BlockSizer`, `CopyPolicy`,
`BatchCopyPolicy`) keeps one `WidthTimes` per range (`context_bucket`), below
`CONTEXT_RANGE` tokens one range, above it one per doubling.
"""

from dataclasses import dataclass, field
from typing import Dict, List

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
