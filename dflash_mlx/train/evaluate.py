"""tau of a draft measured with the engine (greedy), on held-out benchmark prompts.

tau = tokens committed per target forward, pooled over all cycles of all prompts
of a suite (the prefill forward excluded), exactly as `DFlashResponse.tau`.
Prompts come from the benchmark suites (evaluation splits: never used in training).
"""

import time
from typing import Dict, List, Optional, Sequence, Union

import mlx.core as mx


def measure_tau(model, tokenizer, draft, suites: Sequence[str] = ("gsm8k", "humaneval", "mtbench"),
                limit: int = 4, max_tokens: int = 128, block_size: Union[int, str] = "draft",
                seed: int = 0, log=None) -> Dict[str, dict]:
    """{suite: {"tau", "prompts", "tokens", "cycles", "seconds"}}, greedy. At the draft's
    own width by default: tau there measures the draft alone, where `auto`'s widths
    depend on timings."""
    from dflash_mlx.bench.suites import format_prompt, load_suite
    from dflash_mlx.generate import encode_prompt, stream_generate, tau as pooled_tau

    out = {}
    for suite in suites:
        accepts: List[int] = []
        tokens = 0
        t0 = time.perf_counter()
        prompts = load_suite(suite, limit=limit, seed=seed)
        for p in prompts:
            ids = encode_prompt(tokenizer, format_prompt(tokenizer, p))
            last = None
            for r in stream_generate(model, draft, tokenizer, ids, max_tokens=max_tokens,
                                     block_size=block_size, temperature=0.0):
                last = r
            if last is not None:
                accepts += list(last.accept_lengths)
                tokens += last.generation_tokens
        tau = pooled_tau(accepts) if accepts else float("nan")
        out[suite] = {"tau": tau, "prompts": len(prompts), "tokens": tokens, "cycles": len(accepts),
                      "seconds": time.perf_counter() - t0}
        if log:
            log(f"{suite}: tau {tau:.2f} over {len(accepts)} cycles, {tokens} tokens, {len(prompts)} prompts")
    return out


def tau_trend(points: Sequence[Dict], min_tokens: int = 0) -> Optional[Dict[str, float]]:
    """Least-squares fit tau = a + b * log2(supervised tokens) over the learning-curve points.

    Returns {"per_doubling": b, "intercept": a, "n": points used} (None with fewer
    than 3 points). `tokens_for(tau)` follows from it: 2 ** ((tau - a) / b).
    Early points (before `min_tokens`) can be left out: the first few hundred
    steps are warm-up, not the trend.
    """
    import numpy as np

    pts = [p for p in points if p["tokens"] >= max(min_tokens, 1) and p["tau"] == p["tau"]]
    if len(pts) < 3:
        return None
    x = np.log2([p["tokens"] for p in pts])
    y = np.array([p["tau"] for p in pts])
    b, a = np.polyfit(x, y, 1)
    return {"per_doubling": float(b), "intercept": float(a), "n": len(pts)}


def tokens_for_tau(trend: Dict[str, float], tau: float) -> float:
    """Supervised tokens the log-linear trend needs to reach `tau` (inf if it is not rising)."""
    if trend["per_doubling"] <= 0:
        return float("inf")
    return float(2.0 ** ((tau - trend["intercept"]) / trend["per_doubling"]))
