"""One option checked on every architecture of the quick check (`arch_check`), with progress, and its
report: the loop and the tables the option sweeps (`benchmarks/kv_bits_sweep.py`,
`benchmarks/kv_window_sweep.py`) share.

A check takes an architecture key and returns its outcome: a dict with a `status` ("exact", "refused",
"mismatch", ...), a `reason` where there is one, and `changed` (whether the option changed mlx-lm's own
answer, so that a case done wrong would have shown).
"""

import json
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple


def built(key: str):
    """(the quick check's tiny model of `key`, None), or (None, the outcome that says why there is none: not run
    on this machine, not built, refused as a target)."""
    from dflash_mlx.models.target.adapter import Target, UnsupportedTargetError
    from dflash_mlx.testing import arch_check
    from dflash_mlx.testing.more_archs import NOT_RUN

    if key in NOT_RUN:
        return None, dict(status="not run", reason=NOT_RUN[key])
    try:
        model = arch_check.build(key)
    except Exception as e:
        return None, dict(status="not built", reason=f"{type(e).__name__}: {e}"[:200])
    try:
        Target(model)
    except UnsupportedTargetError as e:
        return None, dict(status="refused", reason=f"(as a target) {e}")
    return model, None


def sweep(keys: List[str], check: Callable[[str], dict]) -> Tuple[Dict[str, dict], Dict[str, int], float]:
    """(each key's outcome, how many keys had each status, seconds); a check that raises is an "error"
    outcome, not the end of the sweep."""
    from dflash_mlx.progress import Progress

    results, t0 = {}, time.perf_counter()
    progress = Progress(len(keys), "architectures")
    for i, key in enumerate(keys):
        try:
            results[key] = check(key)
        except Exception as e:  # a crash is a finding
            results[key] = dict(status="error", reason=f"{type(e).__name__}: {e}"[:300])
        progress.update(i + 1, f"{key}: {results[key]['status']}", force=True)
    progress.close()
    counts: Dict[str, int] = {}
    for r in results.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    return results, counts, time.perf_counter() - t0


def write_report(out: Path, title: str, command_line: str, results: Dict[str, dict], counts: Dict[str, int],
                 changed_line: str, settings: dict) -> int:
    """README.md (`title`, `command_line`, the outcome counts, `changed_line`, a row per architecture) and
    results.json (`settings` and the outcomes) in `out`; prints the head; 0 unless something mismatched or
    raised."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(settings, results=results), indent=1))
    lines = [f"# {title}", "", command_line, "", "| outcome | architectures |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(counts.items())]
    lines += ["", changed_line, "", "| architecture | outcome | changed | reason |", "|---|---|---|---|"]
    for key, r in results.items():
        reason = r.get("reason", "").replace("|", "/").replace("\n", " ")
        lines.append(f"| {key} | {r['status']} | {'yes' if r.get('changed') else ''} | {reason} |")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:12]))
    return 0 if not counts.get("mismatch") and not counts.get("error") else 1


def exact_and_changed(results: Dict[str, dict]) -> int:
    """How many "exact" outcomes the option changed mlx-lm's answer in."""
    return sum(1 for r in results.values() if r["status"] == "exact" and r.get("changed"))
