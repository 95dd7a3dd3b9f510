"""mlx-lm's XTC sampling filter ("exclude top choices"), one coin a verify row."""

from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx


@dataclass(frozen=True)
class XTC:
    """mlx-lm's XTC ("exclude top choices", `make_sampler(xtc_probability=, xtc_threshold=,
    xtc_special_tokens=)`): with probability `probability` a step drops every token above `threshold` but
    the least likely of them (never `special_tokens`). mlx-lm draws that coin once a step; here each row of
    a verify stands for a step and draws its own, so a row's distribution is the same mixture of the two
    filtered ones, and exact speculative sampling keeps it (each position's decision reads its row once)."""

    probability: float
    threshold: float = 0.1
    special_tokens: Tuple[int, ...] = ()

    def __post_init__(self):
        if not (isinstance(self.probability, (int, float)) and 0 <= self.probability <= 1):
            raise ValueError(f"xtc_probability must be in [0, 1] (0: off), got {self.probability!r}")
        if not (isinstance(self.threshold, (int, float)) and 0 <= self.threshold <= 0.5):
            raise ValueError(f"xtc_threshold must be in [0, 0.5], got {self.threshold!r}")

    def apply(self, logprobs: mx.array) -> mx.array:
        """logprobs [..., V] -> the same with the top choices dropped on the rows whose coin says so."""
        probs = mx.softmax(logprobs, axis=-1)
        least_above = mx.where(probs > self.threshold, probs, mx.inf).min(axis=-1, keepdims=True)
        drop = probs > least_above
        if self.special_tokens:
            drop = drop & ~(mx.arange(probs.shape[-1]) == mx.array(self.special_tokens)[:, None]).any(axis=0)
        coin = mx.random.uniform(shape=probs.shape[:-1] + (1,)) <= self.probability
        return mx.where(coin & drop, -mx.inf, logprobs)


def make_xtc(xtc_probability: float = 0.0, xtc_threshold: float = 0.1, xtc_special_tokens=()) -> Optional[XTC]:
    """The XTC setting for mlx-lm's three arguments; None where `xtc_probability` is 0 (off)."""
    spec = XTC(xtc_probability, xtc_threshold, tuple(int(t) for t in xtc_special_tokens or ()))
    return spec if spec.probability > 0 else None


def front_end_special_tokens(tokenizer) -> Tuple[int, ...]:
    """The tokens mlx-lm's generate CLI and server keep out of XTC: a newline's encoding and the end tokens."""
    eos = getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id]
    return tuple(int(t) for t in list(tokenizer.encode("\n")) + [t for t in eos if t is not None])
