"""A depth result written out: results.json, the README table and the plot.

The README puts the per-depth summary first (speed-up over plain decoding, tau,
TTFT, the width the policy settled on against the best fixed width), then the
other drafts compared, the machine and command, then every document's numbers.
"""

import json
from pathlib import Path
from typing import List, Optional


def fmt(x, pattern="{:.2f}"):
    """`x` formatted, or a dash for a number that was not measured."""
    return "–" if x is None else pattern.format(x)


def markdown(doc: dict) -> str:
    cfg, env = doc["config"], doc["environment"]
    widths = cfg["widths"]
    lines = [
        f"# Depth benchmark: {cfg['model']} with draft {cfg['draft']}",
        "",
        f"Held-out documents: {', '.join(d['name'] for d in doc['documents'])}; each cut so the whole "
        f"prompt is the depth's length, then one question. {cfg['max_tokens']} tokens, greedy, "
        "plain decoding (`baseline=True`) and the default width (`block_size=\"auto\"`) from empty "
        "caches, interleaved; fixed widths from the auto run's prompt cache"
        + ("; plain decoding's prefill timed on each depth's first document, the others decode from "
           "the auto run's target cache" if cfg.get("shared_plain_prefill", True) else "")
        + (f"; decode speeds the median of {cfg['repeats']} runs" if cfg.get("repeats", 1) > 1 else "")
        + ". Geometric means over documents; the width policy reset at each depth.",
        "",
        "| depth | docs | plain tok/s | auto tok/s | speed-up | tau | TTFT plain s | TTFT auto s | TTFT auto / plain | "
        "speed-up (CPU time) | auto settled on | " + " | ".join(f"block {w}" for w in widths)
        + " | auto / best fixed | identical |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|" + "---:|" * len(widths) + "---:|---|",
    ]
    for depth, s in doc["summary"].items():
        settled = ", ".join(f"{w} ({n})" for w, n in s["settled_widths"].items()) or "–"
        fixed = " | ".join(f"{fmt(s['fixed_speedup'][str(w)])}x" for w in widths)
        lines.append(
            f"| {depth} | {s['documents']} | {fmt(s['plain_tps'])} | {fmt(s['auto_tps'])} | "
            f"**{fmt(s['speedup'])}x** | {fmt(s['tau'])} | {fmt(s['ttft_plain_s'])} | {fmt(s['ttft_auto_s'])} | "
            f"{fmt(s['ttft_ratio'])} | "
            f"{fmt(s['speedup_cpu'])}x | {settled} | {fixed} | "
            f"{fmt(s['auto_vs_best_fixed'], '{:.3f}')} (best: {s['best_fixed_width']}) | "
            f"{'yes' if not s['mismatches'] else 'NO: ' + str(s['mismatches'])} |")
    others = sorted({k for s in doc["summary"].values() for k in s.get("others", {})})
    if others:
        lines += ["", f"Other drafts beside the main draft (`{cfg['draft']}`, the table above), at the "
                  f"default width from empty caches: {', '.join(others)}.", "",
                  "| depth | draft | speed-up | speed-up (CPU time) | tau | TTFT s |", "|---:|---|---:|---:|---:|---:|"]
        for depth, s in doc["summary"].items():
            lines.append(f"| {depth} | {cfg['draft']} | {fmt(s['speedup'])}x | {fmt(s['speedup_cpu'])}x | "
                         f"{fmt(s['tau'])} | {fmt(s['ttft_auto_s'])} |")
            for k in others:
                o = s["others"].get(k)
                if o:
                    lines.append(f"| {depth} | {k} | {fmt(o['speedup'])}x | {fmt(o['speedup_cpu'])}x | "
                                 f"{fmt(o['tau'])} | {fmt(o['ttft_s'])} |")
    lines += [
        "",
        "Fixed-width columns: speed-up over plain decoding (geometric mean); tau at each: "
        + "; ".join(f"depth {d}: " + ", ".join(f"{w}: {fmt(s['fixed_tau'][str(w)])}" for w in widths)
                    for d, s in doc["summary"].items()) + ".",
        "",
        f"Machine: {env.get('platform')}, {env.get('cpu_count')} cores, MLX {env.get('mlx_version')}, "
        f"BLAS {env.get('blas')}, threads {env.get('thread_env')}, load average "
        f"{env.get('loadavg')} at start, {env.get('loadavg_end')} at end, {doc.get('elapsed_s')} s.",
        "",
        f"Command: `{cfg.get('command')}`",
        "",
        "## Per document",
        "",
        "| depth | document | plain tok/s | auto tok/s | tau | TTFT plain / auto s | settled | auto's tokens "
        "(draft / tree / copy / plain) | " + " | ".join(f"block {w} tok/s" for w in widths) + " |",
        "|---:|---|---:|---:|---:|---|---:|---|" + "---:|" * len(widths),
    ]
    for r in doc["records"]:
        p, a = r["runs"]["plain"], r["runs"]["auto"]
        kinds = a.get("proposals") or {}
        split = " / ".join(str(kinds.get(k, [0, 0])[1]) for k in ("draft", "tree", "copy", "plain")) if kinds else "–"
        lines.append(
            f"| {r['depth']} | {r['document']} | {fmt(p['decode_tps'])} | {fmt(a['decode_tps'])} | {fmt(a['tau'])} | "
            f"{fmt(p['ttft_s'])} / {fmt(a['ttft_s'])} | {r['settled_width']} | {split} | "
            + " | ".join(fmt(r["runs"][f"block {w}"]["decode_tps"]) for w in widths) + " |")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    s = doc["summary"]
    depths = [int(d) for d in s]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ax = axes[0]
    ax.plot(depths, [s[str(d)]["speedup"] for d in depths], "o-", label="auto")
    for w in doc["config"]["widths"]:
        ax.plot(depths, [s[str(d)]["fixed_speedup"][str(w)] for d in depths], ".--", alpha=0.6, label=f"block {w}")
    others = sorted({k for v in s.values() for k in v.get("others", {})})
    for k in others:
        ax.plot(depths, [s[str(d)]["others"].get(k, {}).get("speedup") for d in depths], "s-", label=f"auto, {k}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="prompt tokens", ylabel="speed-up over plain", title="decode speed-up")
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.plot(depths, [s[str(d)]["tau"] for d in depths], "o-", label=doc["config"]["draft"])
    for k in others:
        ax.plot(depths, [s[str(d)]["others"].get(k, {}).get("tau") for d in depths], "s-", label=k)
    ax.legend(fontsize=7)
    ax.set(xscale="log", xlabel="prompt tokens", ylabel="tau (auto)", title="tokens per target forward")
    ax = axes[2]
    ax.plot(depths, [s[str(d)]["ttft_plain_s"] for d in depths], "o-", label="plain")
    ax.plot(depths, [s[str(d)]["ttft_auto_s"] for d in depths], "s--", label="auto")
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="seconds", title="time to first token")
    ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(depths, [str(d) for d in depths], minor=False)
        ax.set_xticks([], minor=True)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"{doc['config']['model']} + {doc['config']['draft']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(doc: dict, out_dir: Path, with_plot: bool = True) -> List[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "README.md"]
    tmp = paths[0].with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(paths[0])
    paths[1].write_text(markdown(doc))
    if with_plot and doc["summary"]:
        p = plot(doc, out_dir / "depth.png")
        if p:
            paths.append(p)
    return paths
