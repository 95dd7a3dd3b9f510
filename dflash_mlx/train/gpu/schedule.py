"""The learning-rate schedule (linear warm-up, cosine to 10%) and the time budget (`--minutes`).

With `--minutes N` everything (loading, generation, training, evaluation, export) fits N
minutes: generation stops between batches at `--gen-share` of the budget; training stops at
the end less a reserve for evaluation and export; the number of steps is fitted on the first
steps' measured time (the first step, which compiles, counted in full: its time is spent),
and refitted as the run goes, so the cosine ends where the time does.
"""

import math
import time
from dataclasses import dataclass
from typing import Optional


def lr_at(step, steps, lr, warmup, min_ratio=0.1):
    warm = max(1, int(warmup * steps))
    return Schedule(lr, warm, steps, min_ratio).at(step)


@dataclass
class Schedule:
    lr: float
    warm: int
    total: Optional[int]  # None while the budget is still being measured
    min_ratio: float = 0.1

    def at(self, step):
        if step < self.warm:
            return self.lr * (step + 1) / self.warm
        if self.total is None:
            return self.lr
        t = (step - self.warm) / max(1, self.total - self.warm)
        return self.lr * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


class Budget:
    """Deadlines (time.time()) of a run given `minutes` from `start` (None: no budget)."""

    def __init__(self, minutes, start=None, gen_share=0.4, reserve_s=15.0, reserve_frac=0.03):
        self.start = time.time() if start is None else start
        self.end = None if not minutes else self.start + 60.0 * minutes
        self.gen_share = gen_share
        # evaluation, checkpoint and export; a quarter of the budget at most (short runs)
        self.reserve = min(reserve_s + reserve_frac * 60.0 * (minutes or 0), 15.0 * (minutes or 0))

    @property
    def gen_deadline(self):
        return None if self.end is None else self.start + self.gen_share * (self.end - self.start)

    @property
    def train_deadline(self):
        return None if self.end is None else self.end - self.reserve

    def steps_that_fit(self, seconds_per_step, now=None):
        if self.end is None:
            return None
        left = self.train_deadline - (time.time() if now is None else now)
        return max(0, int(left / max(seconds_per_step, 1e-6)))
