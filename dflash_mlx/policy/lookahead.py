"""Whether a cycle's successor is queued before the host reads the cycle, on a guess.

A plain step commits its one token whatever it is, so the next can be queued behind it before
the host reads it (`engine.ahead.before_reading`), as mlx-lm's `generate_step` queues its steps;
where copies are on, the successor goes where the step's token brings a copy that pays into sight
(`engine.ahead.copy_in_sight`). A drafted chain of width w commits a + 1 tokens, a only known once
read; but where every draft token is accepted (a = w - 1) the next cycle's inputs are known lazily
before the read: the bonus token committed[w - 1] and the features of all w rows. Queued on such a
guess, the next cycle runs on the device while the host reads this one and builds its response;
where the guess fails (fewer accepted, a stop token, a copy in sight) the queued cycle is rolled
back whole and its device time is lost.

With G the host's gap between reading a cycle and queuing the next (the device idles through
it) and D the device time of the queued cycle, guessing gains G where right and loses D - G where
wrong (the device is busy with the cycle thrown away while the host builds the right one):
it pays where P(kept) * G > (1 - P) * (D - G). On this CPU a small model's G is a few % of D and
the guess pays only near certainty (a plain step where copies rarely pay); where a verify row is
nearly free (a GPU, a tiny target) G is a good part of a cycle.

What is learnt belongs to the target/draft pair and the machine, as a width policy's
measurements (`sizer.sizer_for`): one `LookAhead` a pair for the life of the process, kept per
width (width 1: plain steps with copies on). A `BatchEngine` keeps one of its own for its batched
plain steps (width 1: the plan made once a step is read is another plain step; `engine.batch_ahead`).
"""

import threading
from typing import Dict, Optional

from dflash_mlx.identity import IdentityMap, pair


class LookAhead:
    """Decayed counts of successors kept per width, and the measured G and D (seconds)."""

    def __init__(self, decay: float = 0.97, prior_strength: float = 1.0, min_trials: float = 2.0,
                 follow: float = 0.2):
        self.decay = decay
        self.prior_strength = prior_strength  # a prior of "never kept", this strong
        self.min_trials = min_trials
        self.follow = follow  # weight of a new sample in the moving averages of G and D
        self.kept: Dict[int, float] = {}  # width -> decayed count of cycles whose successor a guess would keep
        self.trials: Dict[int, float] = {}  # width -> decayed count of cycles landed
        self.gap: Optional[float] = None  # G: from reading a cycle to its successor queued
        self.device: Dict[int, float] = {}  # width -> D: a cycle's time
        self.timed: Dict[int, int] = {}  # width -> cycles timed (the first runs cold: first graph, allocations)

    def kept_rate(self, width: int) -> float:
        """P(a guess after a cycle of `width` is kept), leaning on "never" until seen."""
        return self.kept.get(width, 0.0) / (self.trials.get(width, 0.0) + self.prior_strength)

    def pays(self, width: int) -> bool:
        """Whether to queue the successor of a cycle of `width` before its read, on the guess."""
        device = self.device.get(width)
        if self.trials.get(width, 0.0) < self.min_trials or self.gap is None or device is None:
            return False
        p = self.kept_rate(width)
        return p * self.gap > (1.0 - p) * max(device - self.gap, 0.0)

    def observe(self, width: int, kept: bool):
        """Whether a guess after a cycle of `width` would keep its successor (made or not): a drafted
        chain accepted whole; a plain step after which no copy pays."""
        self.kept[width] = self.kept.get(width, 0.0) * self.decay + kept
        self.trials[width] = self.trials.get(width, 0.0) * self.decay + 1.0

    def timed_gap(self, seconds: float):
        """A gap the device idled through: from a cycle's read to its successor queued."""
        self.gap = _follow(self.gap, seconds, self.follow)

    def timed_cycle(self, width: int, seconds: float):
        """A cycle's time from the read of the one before it to its own read: its device time, or more
        where the host's work was not hidden (the guess then errs on the safe side)."""
        self.timed[width] = self.timed.get(width, 0) + 1
        if self.timed[width] > 1:
            self.device[width] = _follow(self.device.get(width), seconds, self.follow)


def _follow(mean: Optional[float], sample: float, weight: float) -> float:
    return sample if mean is None else mean + weight * (sample - mean)


# (model, draft) -> its LookAhead, for as long as both live.
_LOOKAHEADS = IdentityMap()
_LOCK = threading.Lock()


def lookahead_for(model, draft) -> LookAhead:
    """The process's `LookAhead` for this target/draft pair (made on first use; `draft` None: the
    target without one)."""
    key = pair(model, draft)
    with _LOCK:
        policy = _LOOKAHEADS.get(key)
        if policy is None:
            policy = LookAhead()
            _LOOKAHEADS.put(key, policy)
        return policy


def adopt_lookahead(model, draft, policy: LookAhead) -> bool:
    """Make `policy` (what an earlier process learned, `policy.memory`) the pair's, unless the pair
    has one already. True when adopted."""
    with _LOCK:
        return _LOOKAHEADS.put_new(pair(model, draft), policy)


def forget_lookaheads():
    """Drop what every pair's `LookAhead` learnt."""
    with _LOCK:
        _LOOKAHEADS.clear()
