"""README, plot and summary of `distributed_bench.py --repeats R` (part 2 run R times, plain and DFlash
interleaved): medians and ranges over the repeats, collectives and bytes per committed token on each
rank, and what the pipeline's three ways of moving the draft's features would send per cycle."""

import json
import time
from pathlib import Path
from collections import Counter
from statistics import median
from typing import List

from distributed_report import HOPS, _git, pooled, read_about

RUN = "auto"
# The pipeline target's draft (distributed_bench.make_draft: random_draft(num_layers=2)) taps 2 target
# layers, and its hidden size is the target's (512): what a carried fc product would be wide.
DRAFT = {"moe": {"taps": 2, "hidden": 512}}


def _range(xs: List[float], fmt="{:.2f}") -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    return f"{fmt.format(median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def repeats(result: dict) -> List[dict]:
    """Per repeat: plain and DFlash pooled over the prompts, and DFlash's speed-up."""
    out = []
    for s in result["settings"]:
        p, d = pooled(s["prompts"], "plain"), pooled(s["prompts"], RUN)
        out.append({"plain": p, "dflash": d, "speedup": d["tps"] / p["tps"] if p["tps"] and d["tps"] else None,
                    "load": (s.get("loadavg_start"), s.get("loadavg_end"))})
    return out


def _all_runs(result: dict, run: str) -> List[dict]:
    return [p[run] for s in result["settings"] for p in s["prompts"] if run in p]


def counts(result: dict, rank: int) -> dict:
    """Collectives, trips and bytes per committed token (and per DFlash cycle) over every repeat."""
    if rank == 0:
        prompts = [p for s in result["settings"] for p in s["prompts"]]
    else:
        prompts = [p for s in result.get("rank1", []) for p in s]
    out = {}
    for run in ("plain", RUN):
        recs = [p[run] for p in prompts if run in p and p[run].get("collectives")]
        tokens = sum(r["ops_per_token"] and r["collectives"]["ops"] / r["ops_per_token"] for r in recs)
        calls = {}
        for r in recs:
            for k, v in r["collectives"]["calls"].items():
                calls[k] = calls.get(k, 0) + v
        ops = sum(calls.values())
        out[run] = {"calls": calls, "ops": ops / tokens, "bytes": sum(r["collectives"]["bytes"] for r in recs) / tokens,
                    "trips": sum(HOPS.get(k, 1) * v for k, v in calls.items()) / tokens}
    runs = _all_runs(result, RUN)
    cycles = sum(r.get("cycles") or 0 for r in runs)
    tokens = sum(r["tokens"] - 1 for r in runs)
    out["tau"] = sum(a + 1 for r in runs for a in r.get("accepts", [])) / cycles if cycles else None
    out["dflash_per_cycle"] = {"ops": out[RUN]["ops"] * tokens / cycles, "trips": out[RUN]["trips"] * tokens / cycles}
    return out


def pipeline_bytes(result: dict, kind: str, hidden: int) -> dict:
    """Bytes rank 0 sends per DFlash cycle (float32 rows, 2 ranks: its all_gather sends its input once)
    for each transport, over the cycles' measured widths: the taps gathered by an all_sum beside the
    forward (the first design, with the cycle time's own all_sum), the taps carried (with the rider
    row), each rank's share of the draft's `fc` carried instead of its inputs (a rider row too); the
    run's own (`features` in its results; runs before it was recorded carried the taps) marked."""
    taps, dh = DRAFT[kind]["taps"], DRAFT[kind]["hidden"]
    widths = [w for r in _all_runs(result, RUN) for w in r.get("widths", [])]
    row = sum(widths) / len(widths) * hidden * 4  # one [1, w, H] float32 block, mean over the cycles
    used = result.get("features", "taps")
    return {"mean_width": sum(widths) / len(widths),
            "plain step (1 row)": hidden * 4,
            "gather: all_sum of the taps + the time's all_sum": row + taps * row + 8,
            "carry the taps" + (" (this run)" if used == "taps" else ""): (1 + taps + 1) * row,
            "carry fc's share" + (" (this run)" if used == "fc" else ""): (1 + dh / hidden + 1) * row}


def _widths(result: dict) -> str:
    seen = Counter(w for r in _all_runs(result, RUN) for w in r.get("widths", []))
    return ", ".join(f"{w}: {n}" for w, n in sorted(seen.items()))


def write_carry_report(out: Path):
    out = Path(out)
    res = json.loads((out / "results.json").read_text())
    split = res["split"]
    kinds = [k for k in ("dense", "moe") if k in split and "two" in split[k]]
    summary = {}
    for kind in kinds:
        one, two = split[kind]["one"], split[kind]["two"]
        r1, r2 = repeats(one), repeats(two)
        summary[kind] = {"mode": two["mode"], "one": r1, "two": r2, "rank0": counts(two, 0), "rank1": counts(two, 1),
                         "speedup_one": median(r["speedup"] for r in r1), "speedup_two": median(r["speedup"] for r in r2),
                         "identical": all(r["dflash"]["identical"] for r in r1 + r2)}
        if two["mode"] == "pipeline":
            summary[kind]["bytes_per_cycle"] = pipeline_bytes(two, kind, res["targets"][kind]["hidden_size"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    n_rep = res["config"]["repeats"]
    m0, m1 = res.get("machine_start", {}), res.get("machine_end", {})
    when = m0.get("date") or time.strftime("%Y-%m-%dT%H:%M:%S")
    about = read_about(out)
    L = [about[0] if about else
         "# DFlash on a split target, with nothing added to the verify's collectives (issue 40, second round)", ""]
    L.append(f"`{res['command']}`, {when}, {_git(res.get('git'))}; {res.get('seconds', 0):.0f} s in all; "
             f"MLX {m0.get('mlx_version', '?')} on its CPU backend, mlx-lm {m0.get('mlx_lm_version', '?')}, "
             "float32, OPENBLAS_NUM_THREADS=1, every two-rank run under the shared benchmark lock; a 2-core "
             "machine shared with other agents' jobs (load below).")
    ranks = ("`mlx.launch -n 2 --backend ring` (localhost)" if res["config"].get("ranks", "launch") == "launch"
             else "two ranks started directly with the ring hostfile `mlx.launch` writes (localhost; no launcher)")
    L += ["", "Same targets, draft, prompts and accept-length draws as the first round "
          "([20261203-distributed](../20261203-distributed/README.md), part 1 reused from there: SmolLM2-135M's "
          "block-16 accept lengths, tau 1.47): a llama of SmolLM2's shape (8/2 heads, 30 layers) tensor parallel and "
          "a tiny Qwen3-MoE (8 layers, 64 experts) pipeline parallel, random float32 weights, a scripted draft that "
          "runs a real draft forward and is right for k tokens a cycle, k drawn from those accept lengths. DFlash at "
          "`auto`, chains only. Plain decoding is mlx-lm's `stream_generate` on the same model. "
          f"Each setting runs the 3 prompts {n_rep} times, plain and DFlash interleaved (which goes first flips "
          f"every prompt and every repeat), in one process or in one run of {ranks}; "
          "each repeat learns its widths afresh (`forget_sizers`) and pools its tok/s over the prompts (all "
          "tokens / all time). Medians over the repeats, (min–max) beside them. "
          "Every DFlash answer was compared with plain decoding's, token by token.", "",
          about[1] if about else
          "What changed since the first round: a pipeline's taps ride on the model's own hand-off and final "
          "all_gather (`models/target/pipeline_carry.py`), and so does rank 0's cycle time (one more row); on a "
          "tensor split the cycle times go 8 at a time in one all_sum (`engine/distributed.py`).", ""]
    L += ["## Speed", "",
          "| target | processes | plain tok/s | DFlash tok/s | speed-up | tau | widths (cycles, all repeats) | identical |",
          "|---|---:|---:|---:|---:|---:|---|---|"]
    for kind in kinds:
        s = summary[kind]
        for label, rr in (("1", s["one"]), ("2", s["two"])):
            taus = [r["dflash"].get("tau") for r in rr]
            L.append(f"| {kind} ({'whole' if label == '1' else s['mode']}) | {label} | "
                     f"{_range([r['plain']['tps'] for r in rr])} | {_range([r['dflash']['tps'] for r in rr])} | "
                     f"{_range([r['speedup'] for r in rr], '{:.2f}x')} | {_range(taus)} | "
                     f"{_widths(split[kind]['one' if label == '1' else 'two'])} | "
                     f"{'yes' if all(r['dflash']['identical'] for r in rr) else '**no**'} |")
    L += ["", "## Collectives and bytes per committed token, 2 ranks", "",
          "Counted as the graphs are built (every `mx.distributed` op wrapped), between the first token and the "
          "last, over every repeat (each answer's one all_sum of its shared seed included); bytes as the ring "
          "backend sends them. Trips: one-way transfers on rank 0's path (an all_sum 2, a hop or all_gather 1).",
          "",
          "| target | rank | collectives / token, plain → DFlash | fall | tau | DFlash collectives / cycle (trips) | "
          "plain trips / token | bytes / token, plain → DFlash |",
          "|---|---:|---|---:|---:|---|---:|---|"]
    for kind in kinds:
        for rank in (0, 1):
            c = summary[kind][f"rank{rank}"]
            p, d = c["plain"], c[RUN]
            L.append(f"| {kind} ({summary[kind]['mode']}) | {rank} | {p['ops']:.2f} → {d['ops']:.2f} | "
                     f"{p['ops'] / d['ops']:.2f}x | {c['tau']:.2f} | {c['dflash_per_cycle']['ops']:.2f} "
                     f"({c['dflash_per_cycle']['trips']:.2f}) | {p['trips']:.2f} | "
                     f"{p['bytes']:,.0f} → {d['bytes']:,.0f} |")
    for kind in kinds:
        b = summary[kind].get("bytes_per_cycle")
        if not b:
            continue
        L += ["", f"## {kind}: bytes rank 0 sends per cycle, by how the features travel", "",
              f"At this run's mean verify width ({b['mean_width']:.2f} rows; float32, hidden "
              f"{res['targets'][kind]['hidden_size']}, {DRAFT[kind]['taps']} tapped layers, draft hidden "
              f"{DRAFT[kind]['hidden']}); rank 1 sends the same again on its hand-off. Trips per cycle: gather 6, "
              "either carry 2.", "", "| transport | bytes / cycle | trips / cycle |", "|---|---:|---:|"]
        for name, v in b.items():
            if name != "mean_width":
                trips = 6 if name.startswith("gather") else 2
                L.append(f"| {name} | {v:,.0f} | {trips} |")
    L += ["", "## Against the issue's goals", ""]
    for kind in kinds:
        s = summary[kind]
        c = s["rank0"]
        fall, tau = c["plain"]["ops"] / c[RUN]["ops"], c["tau"]
        L.append(f"- **{kind} ({s['mode']}), collectives**: per committed token they fall {fall:.2f}x with tau "
                 f"{tau:.2f}; a DFlash cycle builds {c['dflash_per_cycle']['ops']:.2f} collectives against a plain "
                 f"step's {c['plain']['ops']:.2f}.")
        two = [r["speedup"] for r in s["two"]]
        one = [r["speedup"] for r in s["one"]]
        met = s["speedup_two"] >= s["speedup_one"]
        overlap = max(two) >= min(one) and max(one) >= min(two)
        L.append(f"- **{kind} ({s['mode']}), speed-up**: 2 ranks {_range(two, '{:.2f}x')}, 1 process "
                 f"{_range(one, '{:.2f}x')}: {'met' if met else '**not met**'} on the medians"
                 + ("" if met else f" (by {s['speedup_one'] / s['speedup_two'] - 1:.0%}"
                    + ("; the repeats' ranges overlap" if overlap else "; the ranges do not overlap") + ")") + ".")
    L += ["", "![speed-up, 1 process vs 2 ranks; collectives per token](carry.png)", ""]
    notes = out / "notes.md"  # the reading of these numbers, by hand (kept when the report is written again)
    if notes.exists():
        L += [notes.read_text().rstrip(), ""]
    from dflash_mlx.cli.doctor import results_footer

    # (the results' environment keeps the 1-minute load alone)
    L += results_footer(*[[m.get("loadavg")] if isinstance(m.get("loadavg"), float) else m.get("loadavg") or []
                          for m in (m0, m1)])
    (out / "README.md").write_text("\n".join(L) + "\n")
    _plot(summary, kinds, out / "carry.png")


def _plot(summary: dict, kinds: List[str], path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for i, kind in enumerate(kinds):
        s = summary[kind]
        for j, (label, rr) in enumerate((("1 process", s["one"]), ("2 ranks", s["two"]))):
            xs = [r["speedup"] for r in rr]
            m = median(xs)
            a.bar(i * 3 + j, m, yerr=[[m - min(xs)], [max(xs) - m]], capsize=4, color=f"C{j}",
                  label=label if i == 0 else None)
            a.scatter([i * 3 + j] * len(xs), xs, color="k", s=8, zorder=3)
        c = s["rank0"]
        b.bar(i * 3, c["plain"]["ops"], color="C2", label="plain" if i == 0 else None)
        b.bar(i * 3 + 1, c[RUN]["ops"], color="C3", label="DFlash" if i == 0 else None)
    for ax in (a, b):
        ax.set_xticks([i * 3 + 0.5 for i in range(len(kinds))],
                      [f"{k} ({summary[k]['mode']})" for k in kinds])
        ax.legend()
    a.axhline(1.0, color="grey", lw=0.8)
    a.set_ylabel("DFlash tok/s / plain tok/s (median, range, repeats)")
    ops = [summary[k]["rank0"][r]["ops"] for k in kinds for r in ("plain", RUN)]
    if max(ops) > 10 * min(ops):  # a tensor split's 60 beside a pipeline's 2
        b.set_yscale("log")
    else:
        b.set_ylim(0, max(ops) * 1.15)
    b.set_ylabel("collectives per committed token (rank 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
