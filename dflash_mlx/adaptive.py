"""Adaptive verify width: pick each cycle's block size from what has been measured.

A wide verify is only worth its cost if the draft is usually right deep into the
block. On CPUs (and for quantized/MoE targets on Apple GPUs) a 16-token verify
costs 1.5-2x a 1-token decode, so a weak draft at full width is slower than
plain decoding. The objective is tokens committed per second:

    E(B) / t(B),   E(B) = 1 + sum_{k<B} prod_{j<=k} alpha_j

where alpha_j is the measured probability that draft position j is accepted
given that positions before it were, and t(B) the measured cycle time at width
B (linear fit over the widths tried). The output never depends on the width:
every width is exact, only the speed changes.
"""

from typing import Dict, List


class FixedWidth:
    """The same verify width every cycle (fewer when fewer tokens remain)."""

    def __init__(self, width: int):
        self.width = width

    def choose(self, remaining: int) -> int:
        return min(self.width, remaining)

    def update(self, width: int, accept_length: int, seconds: float):
        pass


class BlockSizer:
    def __init__(self, max_block: int, probe_every: int = 16, decay: float = 0.98):
        self.max_block = max_block
        self.probe_every = probe_every
        self.decay = decay  # forget old cycles slowly: acceptance drifts with the text
        n = max(max_block - 1, 0)
        self.hits: List[float] = [0.0] * n
        self.trials: List[float] = [0.0] * n
        self.times: Dict[int, float] = {}  # width -> EMA of seconds per cycle
        self.cycle = 0
        self.last_choice = max_block

    def alpha(self, prior: float = 0.5, strength: float = 2.0) -> List[float]:
        """Acceptance rate per depth. A depth seen rarely leans on the depth above it
        (a draft right at depth k is usually about as right at k+1), so depths never
        tried neither look perfect nor hopeless."""
        out, above = [], prior
        for h, t in zip(self.hits, self.trials):
            above = (h + strength * above) / (t + strength)
            out.append(above)
        return out

    def expected_tokens(self, width: int) -> float:
        total, survive = 1.0, 1.0
        for a in self.alpha()[: width - 1]:
            survive *= a
            total += survive
        return total

    def cycle_time(self, width: int) -> float:
        """Linear model t(B) = c0 + c1*B through the measured widths."""
        if width in self.times:
            return self.times[width]
        pts = sorted(self.times.items())
        if len(pts) < 2:
            return 1.0 + 0.05 * width  # before measurements: roughly "verify cost grows slowly"
        n = len(pts)
        mx_ = sum(w for w, _ in pts) / n
        my = sum(t for _, t in pts) / n
        var = sum((w - mx_) ** 2 for w, _ in pts)
        slope = max(0.0, sum((w - mx_) * (t - my) for w, t in pts) / var) if var else 0.0
        return max(1e-6, my + slope * (width - mx_))

    def choose(self, remaining: int) -> int:
        limit = min(self.max_block, remaining)
        self.cycle += 1
        if limit <= 1:
            return 1
        if self.cycle <= 2:
            # full width first (every depth, the widest cost), then width 2, so the
            # cost line has two points
            return limit if self.cycle == 1 else 2
        if self.cycle % self.probe_every == 0:
            # look a little deeper than the current choice: cheap, and it keeps
            # the acceptance of the next depths measured
            return min(limit, max(2, 2 * self.last_choice))
        best, best_rate = 1, 0.0
        for width in range(1, limit + 1):
            rate = self.expected_tokens(width) / self.cycle_time(width)
            if rate > best_rate:
                best, best_rate = width, rate
        self.last_choice = best
        return best

    def update(self, width: int, accept_length: int, seconds: float):
        d = self.decay
        # depth k (draft token k+1) was tried when every token before it was accepted
        for k in range(min(width - 1, accept_length + 1, len(self.hits))):
            self.hits[k] = self.hits[k] * d + (1.0 if k < accept_length else 0.0)
            self.trials[k] = self.trials[k] * d + 1.0
        old = self.times.get(width)
        self.times[width] = seconds if old is None else 0.7 * old + 0.3 * seconds
