"""Verify width per cycle for a batch of rows (`BatchWidths`): a `BlockSizer` (`sizer`) per
batch size, chosen with hysteresis as rows join and leave; the batch engine's width policy."""

from typing import Callable, Dict, Optional, Sequence

from dflash_mlx.policy.sizer import BlockSizer, sizer_for


class BatchWidths:
    """Verify width per cycle for a batch: one `BlockSizer` per batch size bucket (1, 2, 3-4,
    5-8, ...), keyed on decoding rows only. At B rows a cycle verifies B x width rows, so what
    pays at one row can lose at eight: each bucket learns its own cycle times (acceptance is
    the draft's and is observed from every row). The key moves to a new bucket only after
    `hold` cycles there, so rows joining and leaving do not flip the width every cycle.
    Bucket 1 is the target/draft pair's own sizer (`sizer_for`), shared with `stream_generate`."""

    def __init__(self, model, draft, hold: int = 4):
        self.model, self.draft = model, draft
        self.hold = hold
        self.sizers: Dict[int, BlockSizer] = {}
        self.key: Optional[int] = None
        self._candidate: Optional[int] = None
        self._seen = 0
        self.current: Optional[BlockSizer] = None
        self.chosen: Dict[int, Dict[int, int]] = {}  # bucket -> width -> cycles

    @staticmethod
    def bucket(rows: int) -> int:
        b = 1
        while b < rows:
            b *= 2
        return b

    def sizer(self, bucket: int) -> BlockSizer:
        if bucket not in self.sizers:
            # A probe (a drafted cycle while width 1 wins) costs every row a draft forward and
            # doubles the verify's rows: in big batches probes are rarer.
            self.sizers[bucket] = (sizer_for(self.model, self.draft) if bucket == 1
                                   else BlockSizer(self.draft.block_size if self.draft is not None else 1,
                                                   probe_every=8 * bucket, max_probe_every=32 * bucket))
        return self.sizers[bucket]

    def choose(self, rows: int, remaining: int, context: int) -> int:
        """`context`: the longest row's context (every row's verify attends that far, padded)."""
        bucket = self.bucket(rows)
        if self.key is None:
            self.key = bucket
        elif bucket == self.key:
            self._candidate, self._seen = None, 0
        else:
            self._seen = self._seen + 1 if bucket == self._candidate else 1
            self._candidate = bucket
            if self._seen >= self.hold:
                self.key, self._candidate, self._seen = bucket, None, 0
        self.current = self.sizer(self.key)
        self.current.trees_on = False  # batch cycles verify chains
        self.current.at_context(context)
        return self.current.choose(remaining)

    def tally(self, bucket: int, width: int):
        """A cycle of `width` at batch size `bucket`, for `chosen` (what /health reports)."""
        counts = self.chosen.setdefault(bucket, {})
        counts[width] = counts.get(width, 0) + 1

    def update(self, width: int, accept_lengths: Sequence[int], seconds: Optional[float]):
        """`accept_lengths`: of the rows that verified the draft's chain; `seconds`: the
        cycle's time, None when rows verified copies instead (a cycle cheaper than a drafted
        one of its width: it must not price the width)."""
        self.count(width, accept_lengths, timed=seconds is not None)(seconds)

    def count(self, width: int, accept_lengths: Sequence[int], timed: bool = True) -> Callable[[float], None]:
        """`update` in two halves (as `BlockSizer.count`): the accept lengths now, to the
        sizer that chose the width; the cycle's seconds when the returned function gets them."""
        sizer = self.current
        if not timed:
            for a in accept_lengths:
                sizer.observe(width, a)
            return lambda seconds: None
        for a in accept_lengths[1:]:
            sizer.observe(width, a)
        return sizer.count(width, accept_lengths[0] if accept_lengths else 0, chain=bool(accept_lengths))
