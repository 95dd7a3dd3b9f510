"""A depth result's numbers: per-depth summaries, results merged across processes.

A result (`depth.run`) holds one record per depth and document with every setting's
runs; the summary per depth is geometric means over documents. Results measured in
separate processes (one depth each, one per core) merge into one when they were
measured with the same settings (`MEASURED_WITH`).
"""

import math
from collections import Counter
from typing import Dict, List, Optional, Sequence

# What two results must share to be merged (`merge`) or one continued (`--resume`).
MEASURED_WITH = ("max_tokens", "widths", "compare", "documents", "shared_plain_prefill", "repeats")


def geomean(xs: Sequence[float]) -> Optional[float]:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def merge(docs: Sequence[dict]) -> dict:
    """One result from runs that measured different depths with the same settings (a
    benchmark split across processes, one per core): records in depth order, summary
    recomputed, the elapsed time the longest run's."""
    keep = MEASURED_WITH + ("model", "draft")
    first = docs[0]
    for d in docs[1:]:
        differ = [k for k in keep if _setting(d, k) != _setting(first, k)]
        if differ or d["documents"] != first["documents"]:
            raise ValueError(f"depth results measured with other settings ({', '.join(differ) or 'documents'}) "
                             "do not merge")
    seen = set()
    records = []
    for d in docs:
        for r in d["records"]:
            if (r["depth"], r["document"]) in seen:
                raise ValueError(f"depth {r['depth']}, {r['document']} is measured twice")
            seen.add((r["depth"], r["document"]))
            records.append(r)
    records.sort(key=lambda r: r["depth"])
    depths = sorted({r["depth"] for r in records})
    out = dict(first)
    out["config"] = dict(first["config"], resolved_depths=depths,
                         command=" & ".join(d["config"].get("command", "") for d in docs))
    out["records"] = records
    out["elapsed_s"] = max(d.get("elapsed_s", 0.0) for d in docs)
    out["summary"] = summarize(records, first["config"]["widths"])
    return out


def _setting(doc: dict, key: str):
    """A result's setting; results from before `repeats` existed ran each setting once."""
    return doc["config"].get(key, 1 if key == "repeats" else None)


def _others(records: List[dict]) -> List[str]:
    return sorted({k[len("auto "):] for r in records for k in r["runs"] if k.startswith("auto ")})


def summarize(records: List[dict], widths: Sequence[int]) -> Dict[str, dict]:
    out = {}
    for depth in sorted({r["depth"] for r in records}):
        rows = [r for r in records if r["depth"] == depth]

        def speed(name, key="decode_tps"):
            return [r["runs"][name][key] / r["runs"]["plain"][key] for r in rows
                    if r["runs"][name][key] and r["runs"]["plain"][key]]

        fixed = {w: geomean(speed(f"block {w}")) for w in widths}
        best = max((w for w in widths if fixed[w]), key=lambda w: fixed[w], default=None)
        auto = geomean(speed("auto"))
        settled = Counter(r["settled_width"] for r in rows if r["settled_width"] is not None)
        out[str(depth)] = {
            "documents": len(rows),
            "plain_tps": geomean([r["runs"]["plain"]["decode_tps"] for r in rows]),
            "auto_tps": geomean([r["runs"]["auto"]["decode_tps"] for r in rows]),
            "speedup": auto,
            "speedup_cpu": geomean(speed("auto", "decode_tps_cpu")),
            "tau": geomean([r["runs"]["auto"]["tau"] for r in rows]),
            "ttft_plain_s": geomean([r["runs"]["plain"]["ttft_s"] for r in rows]),
            "ttft_auto_s": geomean([r["runs"]["auto"]["ttft_s"] for r in rows]),
            # on the documents whose plain prefill was timed too
            "ttft_ratio": geomean([r["runs"]["auto"]["ttft_s"] / r["runs"]["plain"]["ttft_s"] for r in rows
                                   if r["runs"]["plain"]["ttft_s"] and r["runs"]["auto"]["ttft_s"]]),
            "settled_widths": dict(sorted(settled.items())),
            "fixed_speedup": {str(w): fixed[w] for w in widths},
            "fixed_tau": {str(w): geomean([r["runs"][f"block {w}"]["tau"] for r in rows]) for w in widths},
            "best_fixed_width": best,
            "auto_vs_best_fixed": (auto / fixed[best]) if auto and best else None,
            "mismatches": sum(not run["identical"] for r in rows for run in r["runs"].values()),
            "others": {k: {"speedup": geomean(speed(f"auto {k}")),
                           "speedup_cpu": geomean(speed(f"auto {k}", "decode_tps_cpu")),
                           "tau": geomean([r["runs"][f"auto {k}"]["tau"] for r in rows]),
                           "ttft_s": geomean([r["runs"][f"auto {k}"]["ttft_s"] for r in rows])}
                       for k in _others(rows)},
        }
    return out


def mismatches(doc: dict) -> int:
    return sum(s["mismatches"] for s in doc["summary"].values())
