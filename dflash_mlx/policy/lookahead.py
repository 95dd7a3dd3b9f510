"""Whether a drafted cycle's successor is queued before the host reads it.

A plain step commits its one token whatever it is, so the next can be queued behind it before
the host reads it (`engine.ahead.before_reading`), as mlx-lm's `generate_step` queues its steps.
A drafted chain of width w commits a + 1 tokens, a only known once read; but where every draft
token is accepted (a = w - 1) the next cycle's inputs are known lazily before the read: the
bonus token committed[w - 1] and the features of all w rows. Queued on that guess, the next
cycle's draft and verify run on the device while the host reads this one and builds its
response; where the guess fails (fewer accepted, a stop token) the queued cycle is rolled
back whole and its device time is lost.

With G the host's gap between reading a cycle and queuing the next (the device idles through
it) and D the device time of a cycle, guessing gains G where right and loses D - G where
wrong (the device is busy with the cycle thrown away while the host builds the right one):
it pays where P(all accepted) * G > (1 - P) * (D - G). On this CPU a small model's G is ~1%
of D and the guess never pays short of certainty; where a verify row is nearly free (a GPU,
a tiny target) G is a good part of a cycle.

What is learnt belongs to the target/draft pair and the machine, as a width policy's
measurements (`sizer.sizer_for`): one `LookAhead` a pair for the life of the process.
"""

import threading
from typing import Dict, Optional

from dflash_mlx.identity import IdentityMap


class LookAhead:
    """Decayed counts of fully accepted chains per width, and the measured G and D (seconds)."""

    def __init__(self, decay: float = 0.9, prior_strength: float = 1.0, min_trials: float = 2.0,
                 follow: float = 0.2):
        self.decay = decay
        self.prior_strength = prior_strength  # a prior of "never accepted whole", this strong
        self.min_trials = min_trials
        self.follow = follow  # weight of a new sample in the moving averages of G and D
        self.full: Dict[int, float] = {}  # width -> decayed count of chains accepted whole
        self.trials: Dict[int, float] = {}  # width -> decayed count of chains landed
        self.gap: Optional[float] = None  # G: from reading a cycle to its successor queued
        self.device: Optional[float] = None  # D: a drafted cycle's time
        self.cold = True  # the pair's first drafted cycle runs cold (first graph, allocations): not timed

    def full_rate(self, width: int) -> float:
        """P(a chain of `width` is accepted whole), leaning on "never" until seen."""
        return self.full.get(width, 0.0) / (self.trials.get(width, 0.0) + self.prior_strength)

    def pays(self, width: int) -> bool:
        """Whether to queue the successor of a chain of `width` on the guess that it is accepted whole."""
        if width < 2 or self.trials.get(width, 0.0) < self.min_trials or self.gap is None or self.device is None:
            return False
        p = self.full_rate(width)
        return p * self.gap > (1.0 - p) * max(self.device - self.gap, 0.0)

    def observe(self, width: int, accept_length: int):
        """What a drafted chain of `width` accepted (queued on the guess or not)."""
        if width < 2:
            return
        self.full[width] = self.full.get(width, 0.0) * self.decay + (accept_length == width - 1)
        self.trials[width] = self.trials.get(width, 0.0) * self.decay + 1.0

    def timed_gap(self, seconds: float):
        """A gap the device idled through: from a cycle's read to its successor queued."""
        self.gap = _follow(self.gap, seconds, self.follow)

    def timed_cycle(self, seconds: float):
        """A drafted cycle's time, as the width policy takes it (`ahead.Launched.seconds`): more
        than its device time where the host's work was not hidden, so the guess errs on the safe side."""
        if self.cold:
            self.cold = False
            return
        self.device = _follow(self.device, seconds, self.follow)


def _follow(mean: Optional[float], sample: float, weight: float) -> float:
    return sample if mean is None else mean + weight * (sample - mean)


# (model, draft) -> its LookAhead, for as long as both live.
_LOOKAHEADS = IdentityMap()
_LOCK = threading.Lock()


def lookahead_for(model, draft) -> LookAhead:
    """The process's `LookAhead` for this target/draft pair (made on first use)."""
    with _LOCK:
        policy = _LOOKAHEADS.get((model, draft))
        if policy is None:
            policy = LookAhead()
            _LOOKAHEADS.put((model, draft), policy)
        return policy


def forget_lookaheads():
    """Drop what every pair's `LookAhead` learnt."""
    with _LOCK:
        _LOOKAHEADS.clear()
