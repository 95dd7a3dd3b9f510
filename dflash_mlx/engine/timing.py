"""Phase timers for a cycle's profile: `PhaseTimer` (wall time per phase, for benchmarks)
and `NoTimer` (profiling off, what every other run uses)."""

import time
from typing import Dict

import mlx.core as mx


class PhaseTimer:
    """Wall time per cycle phase. It evaluates at each phase boundary, which costs
    host syncs the engine otherwise avoids: for benchmarks only."""

    def start(self):
        self.t0 = self.t = time.perf_counter()
        self.times: Dict[str, float] = {}

    def mark(self, phase: str, arrays=None):
        """`arrays`: what the phase produced (or a function returning it) to wait for."""
        if arrays is not None:
            mx.eval(arrays() if callable(arrays) else arrays)
        now = time.perf_counter()
        self.times[phase] = now - self.t
        self.t = now

    def result(self) -> Dict[str, float]:
        self.times["other"] = max(0.0, time.perf_counter() - self.t0 - sum(self.times.values()))
        return dict(self.times)


def launched_seconds(launched) -> float:
    """A launched cycle's time for the policies (`ahead.Launched`, `batch_cycle.BatchLaunched`): from
    launch to now, or, launched ahead, its build and the wait once it was taken (the gap between
    cycles hid the rest)."""
    now = time.perf_counter()
    if launched.landing is None:
        return now - launched.started
    return (launched.built - launched.started) + (now - launched.landing)


class NoTimer:
    """Profiling off: no syncs, no times."""

    def start(self):
        pass

    def mark(self, phase, arrays=None):
        pass

    def result(self):
        return None
