"""Progress with ETA for long work (data generation, training, benchmarks): one
definition of the ETA and of how a duration is printed."""

import sys
import time
from typing import Optional


def eta_seconds(done: float, total: float, elapsed: float) -> Optional[float]:
    """Remaining time if the remaining units cost what the finished ones did."""
    if done <= 0:
        return None
    return elapsed / done * (total - done)


def format_duration(seconds: Optional[float]) -> str:
    """H:MM:SS; '?' when unknown."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """One-line progress with rate and ETA on stderr."""

    def __init__(self, total: int, label: str, unit: str = "", every: float = 2.0, stream=None):
        self.total, self.label, self.unit, self.every = total, label, unit, every
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self.last = 0.0

    def update(self, done: int, extra: str = "", force: bool = False):
        now = time.perf_counter()
        if not force and now - self.last < self.every:
            return
        self.last = now
        el = now - self.start
        rate = done / el if el > 0 else 0.0
        self.stream.write(
            f"\r{self.label} {done}/{self.total} {self.unit} | {rate:.1f}/s | "
            f"elapsed {format_duration(el)} | ETA {format_duration(eta_seconds(done, self.total, el))} {extra}   "
        )
        self.stream.flush()

    def close(self):
        self.stream.write("\n")
        self.stream.flush()
