"""The oracle probe: what a cycle costs beyond the forwards, where the target's compute is nil.

    python benchmarks/engine_overhead.py [--tokens 256] [--reps 5] [--layers 2]

A 2-layer (`--layers`), hidden-64 random target (`benchmarks/gpu/parts.TINY`) and a scripted draft whose
every block is accepted: mlx-lm's plain decode (`generate_step`, and `stream_generate`, which
detokenizes as the engine does) against the engine's plain step and its cycles at widths
1-16, best of `reps`, interleaved. Width w commits w tokens a cycle; the ideal it is measured
against is w * t(1) / t(w), from the target's own forwards of 1 and w tokens (`parts.compute_ceiling`).
Results: benchmarks/results/<date>-engine-overhead/ (README, results.json, overhead.png).
"""

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "gpu"))

import dflash_mlx  # noqa: E402,F401  (before mlx.core)
import mlx.core as mx  # noqa: E402

import parts  # noqa: E402
import report  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the tiny target (graph-building "
                    "host work grows with them, as a deep model's on a GPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from mlx_lm.generate import stream_generate as lm_stream

    from dflash_mlx.cli.doctor import machine, machine_line

    cfg = dict(parts.TINY, num_hidden_layers=args.layers)
    model = parts.build(cfg, parts.default_dtype())
    tok = parts.tokenizer_for(cfg["vocab_size"])
    prompt = list(range(10, 42))
    best = {}

    def lm_streamed():
        t0, n = None, 0
        for _ in lm_stream(model, tok, mx.array(prompt), max_tokens=args.tokens,
                           sampler=lambda x: mx.argmax(x, axis=-1)):
            n += 1
            if n == 1:
                t0 = time.perf_counter()
        return 1000 * (time.perf_counter() - t0) / (n - 1)

    widths = (1, 2, 4, 8, 16)
    runs = {"mlx_lm_stream": [], "probe": []}
    for rep in range(args.reps):  # interleaved: load drift hits every configuration alike
        runs["probe"].append(parts.host(widths=widths, tokens=args.tokens, reps=1, layers=args.layers))
        runs["mlx_lm_stream"].append(lm_streamed())
        print(f"rep {rep + 1}/{args.reps}: {runs['probe'][-1]['mlx_lm_step_ms']:.3f} ms plain (mlx-lm)", flush=True)
    best["mlx_lm_step_ms"] = min(r["mlx_lm_step_ms"] for r in runs["probe"])
    best["mlx_lm_stream_ms"] = min(runs["mlx_lm_stream"])
    best["engine_plain_step_ms"] = min(r["engine_plain_step_ms"] for r in runs["probe"])
    best["cycle_ms"] = {w: min(r["cycles"][w]["cycle_ms"] for r in runs["probe"]) for w in widths}
    best["speedup"] = {w: round(best["mlx_lm_step_ms"] * w / best["cycle_ms"][w], 2) for w in widths}
    # the forwards' own cost: a w-token forward is not free on this backend (`parts.compute_ceiling`)
    best["verify_ms"] = {w: min(r["ceiling"]["verify_ms"][w] for r in runs["probe"]) for w in widths}
    best["ideal"] = {w: round(w * best["verify_ms"][1] / best["verify_ms"][w], 2) for w in widths}
    best["efficiency"] = {w: round(best["speedup"][w] / best["ideal"][w], 3) for w in widths}
    best["cycle_ms_not_ahead"] = not_ahead(cfg, widths, args.tokens, args.reps)
    # (each rep's own decode with no chain queued on a guess, `parts.no_guess`: interleaved with the rest)
    best["cycle_ms_no_guess"] = {w: min(r["cycles"][w]["cycle_ms_no_guess"] for r in runs["probe"]) for w in widths}
    best["cycle_ms_whole_graph"] = {w: min(r["cycles"][w]["cycle_ms_whole_graph"] for r in runs["probe"]) for w in widths}
    out = Path(args.out or HERE / "results" / f"{datetime.date.today():%Y%m%d}-engine-overhead")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"machine": machine(), "best": best, "runs": runs}, indent=1))
    lines = [f"# Engine overhead: the oracle probe ({datetime.date.today()})", "",
             f"Machine: {machine_line()}.", "",
             f"Target: {args.layers} decoder layers, hidden 64 (random weights). "
             f"Best of {args.reps} interleaved runs, {args.tokens} tokens. mlx-lm's plain step: "
             f"{best['mlx_lm_step_ms']:.3f} ms (`generate_step`), {best['mlx_lm_stream_ms']:.3f} ms "
             f"(`stream_generate`, detokenizing); the engine's plain step {best['engine_plain_step_ms']:.3f} ms.", "",
             "| width | ms a cycle | above the engine's width-1 step | tokens/s vs mlx-lm's plain step "
             "| ideal from the forwards' cost | efficiency | ms a cycle, none launched ahead "
             "| ms a cycle, none queued on a guess | ms a cycle, graph queued whole |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w in widths:
        lines.append(f"| {w} | {best['cycle_ms'][w]:.3f} | {best['cycle_ms'][w] - best['cycle_ms'][1]:+.3f} | "
                     f"{best['speedup'][w]}x | {best['ideal'][w]}x | {best['efficiency'][w]:.0%} | "
                     f"{best['cycle_ms_not_ahead'][w]:.3f} | {best['cycle_ms_no_guess'][w]:.3f} | "
                     f"{best['cycle_ms_whole_graph'][w]:.3f} |")
    lines += ["", "Ideal: w * t(1) / t(w), where t(k) is the target's own forward of k tokens (mlx-lm's model, "
              "evaluated), averaged over the contexts the decode passes through "
              f"({', '.join(map(str, runs['probe'][0]['ceiling']['contexts']))} tokens), best of the runs: "
              "" + ", ".join(f"t({w}) {best['verify_ms'][w]:.3f} ms" for w in widths) + "."]
    lines += ["", "Calls through which the host may wait for the device, a step (`parts.host_calls`; the mean over "
              "a 64-token answer, past the first token; a sync is an evaluation, or a read with none before it "
              "in the step):", ""] + report.host_calls_table(runs["probe"][0]["host_calls"])
    (out / "README.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(widths, [best["speedup"][w] for w in widths], marker="o", label="engine")
    ax.plot(widths, widths, ls="--", label="width")
    ax.plot(widths, [best["ideal"][w] for w in widths], ls=":", label="ideal from the forwards' cost")
    ax.set(xlabel="width (every block accepted)", ylabel="speed vs mlx-lm's plain step", title="oracle probe")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "overhead.png", dpi=110)
    print((out / "README.md").read_text())


def not_ahead(cfg, widths, tokens: int, reps: int) -> dict:
    """The same cycles with none launched ahead of its response (`engine.ahead`): what that buys."""
    from dflash_mlx.engine import cycle

    model = parts.build(cfg, parts.default_dtype())
    tok = parts.tokenizer_for(cfg["vocab_size"])
    prompt = list(range(10, 42))
    ref = parts.greedy_reference(model, prompt, tokens + 16)
    with mock.patch.object(cycle, "may_launch", lambda *args: False):  # this process only, for the comparison
        return parts.oracle_cycles(model, tok, prompt, ref, widths, tokens, reps)


if __name__ == "__main__":
    main()
