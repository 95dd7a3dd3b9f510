"""The GPU check's README and plots, from its results.json (rewritten after every part)."""

import json
from pathlib import Path


def host_calls_table(calls: dict) -> list:
    """Markdown rows: the host's waiting calls a step of mlx-lm's plain decode and a cycle of the
    engine at each width (`parts.host_calls`)."""
    rows = ["| decode | syncs a step | `mx.eval` | `mx.async_eval` | `item` | `tolist` |",
            "|---|---:|---:|---:|---:|---:|"]
    for key, c in calls.items():
        name = "mlx-lm's plain step" if key == "mlx_lm_step" else f"engine, width {key}"
        rows.append(f"| {name} | {c['syncs']} | {c['eval']} | {c['async_eval']} | {c['item']} | {c['tolist']} |")
    return rows


def write_report(results: dict, out: Path):
    from dflash_mlx.cli.doctor import machine_line

    p = results["parts"]
    lines = ["# GPU check", "", f"Machine: {machine_line(results['machine'])}.",
             f"Smoke run (tiny sizes): {results['smoke']}. Seconds per part: {json.dumps(results['seconds'])}.", ""]
    if "kernels" in p and "rows" in p["kernels"]:
        k = p["kernels"]
        lines += ["## dflash-mlx's CUDA kernels", "", f"Run on: {k['backend']}. Rows of an M-row product "
                  "equal, bit for bit, to the row alone through MLX's own product (`quantized_matmul`: its qmv; "
                  "dense: its gemv); and to the kernel's own row alone.", "",
                  "| kernel | shape | dtype | bits | M | kernel: rows equal | MLX at M: rows equal | kernel max diff "
                  "| kernel: rows equal to its own row alone |",
                  "|---|---|---|---|---:|---:|---:|---:|---:|"]
        for r in k["rows"]:
            lines.append(f"| {r['kernel']} | {r['shape']} | {r['dtype']} | {r['bits']} | {r['M']} | "
                         f"{r['kernel_equal']}/{r['M']} | {r['mlx_equal']}/{r['M']} | {r['kernel_max_abs_diff']:.3g} | "
                         f"{r['kernel_invariant']}/{r['M']} |")
        lines.append("")
        for key, what in (("times", "4-bit"), ("times_dense", "bf16")):
            if k.get(key):
                cols = [c for c in k[key][0] if c != "M"]
                lines += [f"One Qwen3-8B-shaped layer's seven {what} projections (bf16 activations), ms:", "",
                          "| M | " + " | ".join(cols) + " |", "|---:|" + "---:|" * len(cols)]
                lines += ["| " + " | ".join(str(r.get(c, "")) for c in ["M"] + cols) + " |" for r in k[key]]
                lines.append("")
    if "ops" in p and "error" not in p["ops"]:
        lines += ["## Row invariance of the products a verify widens", "",
                  "Row i of a k-row product against the same row alone: bitwise equal, largest difference; "
                  "'rows as a batch': the k rows as a batch of 1-row products.", "",
                  "| op | k | equal | max diff | rows as a batch equal |", "|---|---:|---|---:|---|"]
        for op, by_k in p["ops"].items():
            for k, r in by_k.items():
                lines.append(f"| {op} | {k} | {r['equal']} | {r['max_diff']:.3g} | {r.get('batch_equal', '')} |")
        lines.append("")
    if "exactness" in p and "rows" in p["exactness"]:
        lines += ["## (a) Divergence from mlx-lm's greedy decode", "",
                  "A draft proposing mlx-lm's own continuation (right for 0-15 tokens a cycle); a divergence is "
                  "an answer's first token that differs from mlx-lm's.", "",
                  "| model | width | deterministic | answers diverged | tokens compared | per 1,000 tokens |",
                  "|---|---|---|---:|---:|---:|"]
        for r in p["exactness"]["rows"]:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['width']} | {r['deterministic']} | refused: {r['error']} | | |")
            else:
                lines.append(f"| {r['model']} | {r['width']} | {r['deterministic']} | {r['diverged']}/{r['answers']} "
                             f"| {r['tokens']} | {r['per_1000']} |")
        lines.append("")
    if "kvcache" in p and "rows" in p["kvcache"]:
        lines += ["## (a) mlx-lm's KV cache options", "",
                  "'row-invariant width': the most verify rows that equal as many one-row steps bit for bit on a "
                  "quantized cache (a verify holds at most that many while one is or will be quantized); then "
                  "DFlash at `auto` against mlx-lm's greedy decode under the same option.", "",
                  "| model | option | row-invariant width | deterministic | first token parted (of) | tau |",
                  "|---|---|---|---|---|---:|"]
        for r in p["kvcache"]["rows"]:
            if "row_invariant_width" in r:
                lines.append(f"| {r['model']} | {r['setting']} | {r['row_invariant_width']} | | | |")
            elif "error" in r:
                lines.append(f"| {r['model']} | {r['setting']} | | {r['deterministic']} | refused: {r['error']} | |")
            else:
                parted = "none" if r["diverged_at"] is None else r["diverged_at"]
                lines.append(f"| {r['model']} | {r['setting']} | | {r['deterministic']} | {parted} ({r['tokens']}) "
                             f"| {r['tau']} |")
        lines.append("")
    for part, title in (("smollm2", "SmolLM2-135M + shipped draft"), ("gemma3", "Gemma 3 270M, no draft")):
        if part in p and "configs" in p[part]:
            s = p[part]
            lines += [f"## (b) {title} ({s['prompts']} prompts, {s['max_tokens']} tokens)", "",
                      "| config | tok/s | vs mlx-lm plain | tau | answers diverged from mlx-lm |",
                      "|---|---:|---:|---:|---:|"]
            for name, t in s["configs"].items():
                lines.append(f"| {name} | {t['tok_s']} | {t['speedup']} | {t['tau']} | {t['diverged']} |")
            lines.append("")
    if "batch" in p and "rows" in p["batch"]:
        lines += ["## (d) Batched steps launched ahead of their responses (tiny target)", "",
                  "| rows | cycles | ms a step, launched ahead | at its step | plain steps read first | speed-up | "
                  "same tokens |", "|---:|---|---:|---:|---:|---:|---|"]
        for r in p["batch"]["rows"]:
            ms = r["ms a step"]
            lines.append(f"| {r['batch']} | {r['kind']} | {ms['ahead']:.3f} | {ms['at its step']:.3f} "
                         f"| {ms['ahead, read first']:.3f} | {r['ratio']:.3f}x | {r['identical']} |")
        lines.append("")
    if "shapes" in p and "error" not in p["shapes"]:
        lines += ["## (c) Big 4-bit shapes, random weights, scripted draft at width tau (every block accepted)", ""]
        for label, res in p["shapes"].items():
            if "verify_ms" not in res:
                lines += [f"{label}: {res}", ""]
                continue
            lines += [f"### {label}", "", "t(k)/t(1) by context: " + "; ".join(
                f"{c} tokens: t(1) {t[min(t, key=int)]:.2f} ms, " + ", ".join(
                    f"k={k} {t[k] / t[min(t, key=int)]:.2f}" for k in sorted(t, key=int) if int(k) in (2, 4, 8, 16))
                for c, t in res["verify_ms"].items()), "",
                "| tau | speed-up vs plain (engine) | vs mlx-lm | ideal tau*t(1)/t(tau) | efficiency | exact "
                "| no chain queued on a guess | graph queued whole | every 4 layers | CUDA kernels on (exact) |",
                "|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
            for r in res["speedups"]:
                kernels = (f"{r['speedup_cuda_kernels']} ({r['exact_cuda_kernels']})"
                           if "speedup_cuda_kernels" in r else "")
                lines.append(f"| {r['tau']} | {r['speedup']} | {r['speedup_vs_mlx_lm']} | {r['ideal']} | "
                             f"{r['efficiency']} | {r['exact']} | {r.get('speedup_no_guess', '')} | "
                             f"{r.get('speedup_whole_graph', '')} | {r.get('speedup_every_4_layers', '')} | {kernels} |")
            lines.append("")
    if "host" in p and "cycles" in p["host"]:
        h = p["host"]
        lines += ["## (d) Host time: a target whose compute is nil, every block accepted", "",
                  f"mlx-lm's plain step {h['mlx_lm_step_ms']:.3f} ms; the engine's plain step "
                  f"{h['engine_plain_step_ms']:.3f} ms"
                  + (f" ({h['engine_plain_step_read_first_ms']:.3f} ms with each step queued only after the last "
                     "is read)" if "engine_plain_step_read_first_ms" in h else "") + ".", "",
                  "| width | ms a cycle | speed vs mlx-lm plain | ideal from the forwards' cost | efficiency "
                  "| ms a cycle, no chain queued on a guess | ms a cycle, graph queued whole |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        ceiling = h.get("ceiling", {}).get("ideal", {})
        for w, c in h["cycles"].items():
            no_guess, whole = (f"{c[k]:.3f}" if k in c else "" for k in ("cycle_ms_no_guess", "cycle_ms_whole_graph"))
            lines.append(f"| {w} | {c['cycle_ms']:.3f} | {c['speedup']} | {ceiling.get(w, '')} | "
                         f"{c.get('efficiency', '')} | {no_guess} | {whole} |")
        lines += ["", "Ideal: w * t(1) / t(w), t(k) the target's own forward of k tokens averaged over the "
                  "decode's contexts (`parts.compute_ceiling`).", ""]
        if "host_calls" in h:
            lines += host_calls_table(h["host_calls"]) + [""]
    for name, res in p.items():
        if isinstance(res, dict) and ("error" in res or "skipped" in res):
            lines.append(f"- {name}: {res.get('error') or res.get('skipped')}")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    _plots(p, out)


def _plots(p, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = p.get("shapes", {})
    series = [(label, res) for label, res in shapes.items() if isinstance(res, dict) and "verify_ms" in res]
    if series:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for label, res in series:
            for c, t in res["verify_ms"].items():
                ks = sorted(t, key=int)
                axes[0].plot([int(k) for k in ks], [t[k] / t[ks[0]] for k in ks], marker=".", label=f"{label}, ctx {c}")
            axes[1].plot([r["tau"] for r in res["speedups"]], [r["speedup"] for r in res["speedups"]], marker="o",
                         label=f"{label} measured")
            axes[1].plot([r["tau"] for r in res["speedups"]], [r["ideal"] for r in res["speedups"]], ls="--",
                         label=f"{label} ideal")
        axes[0].set(xlabel="verify rows k", ylabel="t(k) / t(1)", title="verify cost")
        axes[1].set(xlabel="tau (scripted)", ylabel="speed-up vs plain", title="speed-up")
        for a in axes:
            a.legend(fontsize=6)
            a.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "shapes.png", dpi=110)
        plt.close(fig)
    host = p.get("host", {})
    if "cycles" in host:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ws = list(host["cycles"])
        ax.plot([int(w) for w in ws], [host["cycles"][w]["speedup"] for w in ws], marker="o", label="measured")
        ax.plot([int(w) for w in ws], [int(w) for w in ws], ls="--", label="width")
        if "ceiling" in host:
            ax.plot([int(w) for w in ws], [host["ceiling"]["ideal"][w] for w in ws], ls=":",
                    label="ideal from the forwards' cost")
        ax.set(xlabel="width (every block accepted)", ylabel="speed vs mlx-lm plain", title="engine overhead")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "host.png", dpi=110)
        plt.close(fig)
