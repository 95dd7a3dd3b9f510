"""How often the draft is right at each depth of its block, from the drafted cycles seen.

alpha_j: the probability that draft position j is accepted given that the positions
before it were. A chain of width w then commits E(w) = 1 + sum_{k<w} prod_{j<=k} alpha_j
tokens a cycle (`DraftAcceptance.chain_tokens`), what `BlockSizer` weighs against the
width's cycle time. Acceptance drifts with the text, so old cycles fade. Two memories: a
long one (steady estimates: a short memory's noise alone costs a few percent against the
best fixed width) and a short one that takes over while the two disagree on the first
draft position (the draft got better or worse).
"""

from typing import List


class DraftAcceptance:
    """Decayed hit/trial counts per draft depth, in a short and a long memory."""

    def __init__(self, depths: int, decay: float = 0.85, slow_decay: float = 0.95, change: float = 0.2,
                 prior: float = 0.5, prior_strength: float = 1.0):
        self.decay = decay
        self.slow_decay = slow_decay
        self.change = change
        self.prior = prior
        self.prior_strength = prior_strength
        self.hits: List[float] = [0.0] * depths  # hits[k]: draft token k+1 accepted (decayed count)
        self.trials: List[float] = [0.0] * depths  # trials[k]: draft token k+1 was reached
        self.slow_hits: List[float] = [0.0] * depths  # the same, long memory
        self.slow_trials: List[float] = [0.0] * depths

    def alpha(self) -> List[float]:
        """Acceptance rate per depth. A depth seen rarely leans on the depth above it
        (a draft right at depth k is usually about as right at k+1), so untried
        depths look neither perfect nor hopeless, and one observation moves them."""
        hits, trials = self.hits, self.trials
        if hits:
            drift = self._rate(hits, trials) - self._rate(self.slow_hits, self.slow_trials)
            if abs(drift) <= self.change:
                hits, trials = self.slow_hits, self.slow_trials
        out, above = [], self.prior
        s = self.prior_strength
        for h, t in zip(hits, trials):
            above = (h + s * above) / (t + s)
            out.append(above)
        return out

    def _rate(self, hits, trials) -> float:
        """First-position acceptance of one memory (the prior when it saw nothing)."""
        return (hits[0] + self.prior_strength * self.prior) / (trials[0] + self.prior_strength)

    def chain_tokens(self, width: int) -> float:
        """Tokens a cycle verifying the draft's chain at `width` is expected to commit."""
        total, survive = 1.0, 1.0
        for a in self.alpha()[: width - 1]:
            survive *= a
            total += survive
        return total

    def observe(self, width: int, accept_length: int):
        """What one drafted chain of `width` accepted."""
        if width <= 1:
            return
        # Depth k (draft token k+1) was reached when every token before it was
        # accepted. Evidence fades with drafted cycles only (width-1 cycles say
        # nothing about the draft), and at every depth, reached or not: what
        # deep positions did while the draft was good must not outlive it.
        reached = min(width - 1, accept_length + 1)
        for hits, trials, d in ((self.hits, self.trials, self.decay),
                                (self.slow_hits, self.slow_trials, self.slow_decay)):
            for k in range(len(hits)):
                hits[k] = hits[k] * d + (1.0 if k < min(reached, accept_length) else 0.0)
                trials[k] = trials[k] * d + (1.0 if k < reached else 0.0)
