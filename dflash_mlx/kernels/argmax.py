"""The greedy choice without the log-probabilities, where that is exact and pays.

mlx-lm's `generate_step` picks the argmax of `logits - logsumexp(logits)`; the acceptance does the
same (`speculation.accept.greedy_choice`). Its `exp` over the vocabulary is most of that cost on
MLX's CPU backend (~11 ns an element: 0.7 ms a row of SmolLM2's 49,152 logits, 11 ms for a
16-row verify, against 0.06 ms a row for the bare argmax).

Rounding is monotone, so subtracting one number from a row never reorders it: the argmax of the
log-probabilities is the first argmax of the raw logits unless the subtraction rounds a smaller
logit onto the largest, and then the first of them wins. In float32 that needs the two within one
ulp of the result, |logit - logsumexp| <= log(vocabulary) < 16 for any vocabulary below 8.8M
tokens: 2**-20. `argmax_or_unsure` returns the raw argmax with a flag for the rows that have
another logit within NEAR (2**-16) of their largest, or a non-finite one; the caller recomputes
those rows the exact way (`speculation.accept`: a second host sync in such a rare cycle).

Selection (`pays`): float32 logits on the CPU, of at least MIN_LOGITS values. On a GPU the `exp`
costs next to nothing and the second sync would cost more; in bfloat16 and float16 the ulp is too
coarse for the flag to be rare; below MIN_LOGITS the flag's own ops cost more than the `exp` saves
(a 512-token vocabulary: 0.16 ms a step more, in the oracle probe). `DFLASH_MLX_KERNELS=reference`
turns it off (the log-probabilities everywhere).
"""

import mlx.core as mx

from dflash_mlx.kernels import selection

NEAR = 2.0 ** -16
MIN_LOGITS = 32768  # ~0.35 ms of exp on this project's CPU, against ~0.1 ms for the flag's ops


def pays(logits: mx.array) -> bool:
    return (logits.dtype == mx.float32 and logits.size >= MIN_LOGITS and mx.default_device() == mx.cpu
            and selection.mode() != "reference")


def argmax_or_unsure(logits: mx.array):
    """logits [..., V] -> (first argmax [...] int32, unsure [...] bool): where `unsure` is False
    the argmax equals `greedy_choice`'s; where True it may not."""
    top = mx.max(logits, axis=-1, keepdims=True)  # (NaN where the row has one)
    near = (logits >= top - NEAR).sum(axis=-1)  # the largest counts itself
    unsure = (near > 1) | ~mx.isfinite(top[..., 0])
    return mx.argmax(logits, axis=-1).astype(mx.int32), unsure
