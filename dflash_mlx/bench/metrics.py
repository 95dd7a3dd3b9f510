"""Benchmark arithmetic on generation traces; no model runs here (tau is `dflash_mlx.generate.tau`).

Definitions used everywhere in the reports:

- tau: mean tokens committed per target forward = mean(accept_length + 1) over
  the DFlash cycles (each cycle is one verify forward; the +1 is the target's
  bonus token). The last cycle counts in full even when max_tokens cut it.
- generation tok/s: tokens produced after the first response, divided by the
  time from the first response to the last. The first response carries the
  prefill (its token(s) and time are reported apart), so prompt length does
  not leak into decode speed, for the baseline and DFlash alike.
- speed-up: DFlash generation tok/s / baseline generation tok/s.
- efficiency: speed-up / tau. 1.0 would mean a verify forward and the draft
  cost no more than one plain decode step.
- limit: tau * t(1-token forward) / t(B-token forward), both forward times
  measured on the same target, same machine. The speed-up DFlash would reach
  with a free draft and free rollback.
"""

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence


PHASES = ("draft", "verify", "rollback", "other")


@dataclass
class Trace:
    """What one generation produced, as seen by a client of the stream."""

    tokens: List[int]
    prompt_tokens: int
    first_tokens: int  # tokens that arrived with the first response (the prefill's)
    prefill_s: float  # call start -> first response
    generation_s: float  # first response -> last response
    accept_lengths: List[int] = field(default_factory=list)  # DFlash only
    cycle_times: Optional[Dict[str, float]] = None  # per-phase sums (profiled pass)
    profiled_cycles: int = 0  # cycles the cycle_times sums cover
    finish_reason: Optional[str] = None
    proposals: Optional[Dict[str, List[int]]] = None  # DFlash: kind -> [cycles, tokens committed]

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.first_tokens


def generation_tps(trace: Trace) -> float:
    if trace.generation_s <= 0 or trace.generated <= 0:
        return 0.0
    return trace.generated / trace.generation_s


def prefill_tps(trace: Trace) -> float:
    return trace.prompt_tokens / trace.prefill_s if trace.prefill_s > 0 else 0.0


def accept_histogram(accept_lengths: Iterable[int], block_size: int) -> List[int]:
    """counts[a] = number of cycles that accepted a drafted tokens, a in 0..B-1."""
    counts = [0] * block_size
    for a in accept_lengths:
        if not 0 <= a < block_size:
            raise ValueError(f"accept length {a} outside 0..{block_size - 1}")
        counts[a] += 1
    return counts


def speedup(dflash_tps: float, baseline_tps: float) -> float:
    return dflash_tps / baseline_tps if baseline_tps > 0 else 0.0


def efficiency(speed_up: float, tau_value: float) -> float:
    return speed_up / tau_value if tau_value > 0 else 0.0


def speedup_limit(tau_value: float, t_decode: float, t_verify: float) -> float:
    return tau_value * t_decode / t_verify if t_verify > 0 else 0.0


def strip_stop(tokens: Sequence[int], stop_ids: Iterable[int]) -> List[int]:
    """Tokens without trailing stop tokens: engines differ on whether they emit EOS."""
    stop = set(stop_ids)
    out = list(tokens)
    while out and out[-1] in stop:
        out.pop()
    return out


def first_mismatch(a: Sequence[int], b: Sequence[int],
                   stop_ids: Iterable[int] = ()) -> Optional[int]:
    """Index of the first differing token (stop tokens ignored at the end), else None."""
    a, b = strip_stop(a, stop_ids), strip_stop(b, stop_ids)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def per_cycle(cycle_times: Optional[Dict[str, float]], cycles: int) -> Optional[Dict[str, float]]:
    """Per-phase seconds per cycle from per-phase sums."""
    if not cycle_times or cycles <= 0:
        return None
    return {p: cycle_times.get(p, 0.0) / cycles for p in PHASES}


def aggregate(rows: List[dict]) -> dict:
    """Pooled summary of per-prompt DFlash records (one block size).

    Pooled, not averaged per prompt: tau = all committed tokens / all cycles,
    tok/s = all generated tokens / all generation time. A prompt that stops
    after 5 tokens then weighs 5 tokens, not as much as a 256-token one.
    """
    if not rows:
        return {}
    cycles = sum(len(r["accept_lengths"]) for r in rows)
    committed = sum(sum(a + 1 for a in r["accept_lengths"]) for r in rows)
    d_tok = sum(r["generated"] for r in rows)
    d_s = sum(r["generation_s"] for r in rows)
    b_tok = sum(r["baseline_generated"] for r in rows)
    b_s = sum(r["baseline_generation_s"] for r in rows)
    d_tps = d_tok / d_s if d_s > 0 else 0.0
    b_tps = b_tok / b_s if b_s > 0 else 0.0
    t = committed / cycles if cycles else 0.0
    s = speedup(d_tps, b_tps)
    block = len(rows[0]["accept_hist"])
    hist = [sum(r["accept_hist"][i] for r in rows) for i in range(block)]
    split_cycles = sum(r["profiled_cycles"] for r in rows if r.get("cycle_time_sums"))
    split = None
    if split_cycles:
        split = {
            p: sum((r.get("cycle_time_sums") or {}).get(p, 0.0) for r in rows) / split_cycles
            for p in PHASES
        }
    ratio = rows[0].get("forward_ratio")  # t(1) / t(B), one per block size
    return {
        "prompts": len(rows),
        "cycles": cycles,
        "tau": t,
        "dflash_tps": d_tps,
        "baseline_tps": b_tps,
        "speedup": s,
        "efficiency": efficiency(s, t),
        "limit": t * ratio if ratio else None,
        "accept_hist": hist,
        "cycle_split_s": split,
        "mismatches": sum(1 for r in rows if r.get("tokens_match") is False),
        "proposals": _pooled_proposals(rows),
        "prefill_tps": _ratio(sum(r["prompt_tokens"] for r in rows),
                              sum(r["prefill_s"] for r in rows)),
        "baseline_prefill_tps": _ratio(sum(r["prompt_tokens"] for r in rows),
                                       sum(r["baseline_prefill_s"] for r in rows)),
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0




def _pooled_proposals(rows: List[dict]) -> Optional[Dict[str, List[int]]]:
    """kind -> [cycles, tokens committed] over all rows (None when no row reports kinds)."""
    out: Dict[str, List[int]] = {}
    for r in rows:
        for kind, (cycles, tokens) in (r.get("proposals") or {}).items():
            counts = out.setdefault(kind, [0, 0])
            counts[0] += cycles
            counts[1] += tokens
    return out or None
