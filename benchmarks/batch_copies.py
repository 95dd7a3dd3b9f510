"""Copies in batched cycles: requests decoding together with and without them, and one at a time.

    nice -n 10 python benchmarks/batch_copies.py [--batches 2,4,8] [--max-tokens 128] [--rounds 2] [--out DIR]

The embedded default target and its shipped draft, greedy, on the `copy` suite of
`dflash-mlx bench` (text edits, code renames, quotes, multi-turn repeats, held-out texts)
and, with `--chat N`, N prompts of each short suite. For every batch size B the prompts go
in waves of B requests to a `BatchEngine` of `max_batch` B (all joining at once, as
parallel clients do): with the batch's copy policy (the default) and without it (batched
cycles verify draft chains or plain steps only); and the same prompts one at a time
(`stream_generate`). The three runs of a wave are interleaved, in an order that rotates
from wave to wave, `--rounds` times; all must commit the same tokens. Aggregate tok/s =
all generated tokens / wall time of the wave, prefill included (as a server sees it).
Writes `results.json`, `README.md` and `throughput.png` to `--out`.
"""

import argparse
import json
import math
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.engine.rows import BatchRequest
from dflash_mlx.bench.suites import format_prompt, load_suite
from dflash_mlx.cli.doctor import machine
from dflash_mlx.generate import encode_prompt
from dflash_mlx.options import GenerationOptions
from dflash_mlx.progress import Progress

MODES = ("batched, copies", "batched, no copies", "one at a time")


def one_at_a_time(model, draft, tok, prompts, max_tokens):
    outs, kinds = [], {}
    for text in prompts:
        tokens = []
        for r in stream_generate(model, draft, tok, text, max_tokens=max_tokens):
            tokens += r.tokens
            if r.proposal:
                kinds[r.proposal] = kinds.get(r.proposal, 0) + len(r.tokens)
        outs.append(tokens)
    return outs, kinds, {}


def batched(model, draft, tok, prompts, max_tokens, copies: bool):
    engine = BatchEngine(model, draft, tok, max_batch=len(prompts))
    if not copies:
        engine.batch_copies = None
    index, outs, kinds = {}, [[] for _ in prompts], {}
    for i, text in enumerate(prompts):
        row = engine.add(BatchRequest(encode_prompt(tok, text), GenerationOptions(max_tokens=max_tokens)))
        index[row.uid] = i
    while not engine.idle:
        together = engine.batched
        for row, r in engine.step():
            outs[index[row.uid]] += r.tokens
            if r.proposal:
                key = r.proposal + (" (batched)" if together else "")
                kinds[key] = kinds.get(key, 0) + len(r.tokens)
    return outs, kinds, engine.widths.chosen


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="2,4,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chat", type=int, default=0, help="prompts of each short suite (GSM8K, HumanEval, MT-Bench)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    args.out = args.out or f"benchmarks/results/{time.strftime('%Y%m%d')}-batch-copies"

    model, tok = load("smollm2-135m", quiet=True)
    draft = load_draft("smollm2-135m", model)
    prompts = load_suite("copy") + [p for s in ("gsm8k", "humaneval", "mtbench") for p in load_suite(s, args.chat)]
    texts = [format_prompt(tok, p) for p in prompts]
    # warm-up: graphs for every batch size, and the width and copy policies' first lessons
    warm = format_prompt(tok, load_suite("copy")[0])
    for b in batches:
        batched(model, draft, tok, [warm] * b, 32, True)
    waves = [(b, texts[i : i + b]) for b in batches for i in range(0, len(texts) - b + 1, b)]
    progress = Progress(len(waves) * args.rounds, "batch copies bench")
    records, started, step = [], time.perf_counter(), 0
    for rnd in range(args.rounds):
        for w, (b, wave) in enumerate(waves):
            order = list(MODES[(w + rnd) % 3:] + MODES[: (w + rnd) % 3])
            rec = {"batch": b, "round": rnd}
            outputs = {}
            for mode in order:
                t0 = time.perf_counter()
                if mode == "one at a time":
                    outs, kinds, widths = one_at_a_time(model, draft, tok, wave, args.max_tokens)
                else:
                    outs, kinds, widths = batched(model, draft, tok, wave, args.max_tokens, mode == MODES[0])
                seconds = time.perf_counter() - t0
                n = sum(len(o) for o in outs)
                outputs[mode] = outs
                rec[mode] = {"tokens": n, "seconds": seconds, "tps": n / seconds, "proposals": kinds,
                             "widths": {str(k): v for k, v in widths.items()}}
            rec["identical"] = len({json.dumps(o) for o in outputs.values()}) == 1
            records.append(rec)
            step += 1
            progress.update(step)

    summary = {}
    for b in batches:
        rs = [r for r in records if r["batch"] == b]
        tps = {m: sum(r[m]["tokens"] for r in rs) / sum(r[m]["seconds"] for r in rs) for m in MODES}
        summary[b] = {"tps": tps,
                      "copies / no copies": geomean([r[MODES[0]]["tps"] / r[MODES[1]]["tps"] for r in rs]),
                      "copies / one at a time": geomean([r[MODES[0]]["tps"] / r[MODES[2]]["tps"] for r in rs]),
                      "no copies / one at a time": geomean([r[MODES[1]]["tps"] / r[MODES[2]]["tps"] for r in rs]),
                      "waves": len(rs),
                      "batched copy tokens": sum(r[MODES[0]]["proposals"].get("copy (batched)", 0) for r in rs),
                      "tokens": sum(r[MODES[0]]["tokens"] for r in rs)}
    identical = all(r["identical"] for r in records)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    m = machine()
    (out / "results.json").write_text(json.dumps({"records": records, "summary": summary, "identical": identical,
                                                  "machine": m, "args": vars(args) | {"out": str(args.out)},
                                                  "seconds": time.perf_counter() - started}, indent=1))
    suites = "the copy suite" + (f" and {args.chat} prompts of each short suite" if args.chat else "")
    lines = [f"# Copies in batched cycles ({time.strftime('%Y-%m-%d')})", "",
             f"SmolLM2-135M-Instruct with its shipped draft, greedy, {args.max_tokens} tokens, {suites} "
             f"({len(texts)} prompts) in waves of B requests joining at once, {args.rounds} rounds, the three runs "
             "of a wave interleaved. Aggregate tok/s = generated tokens / wall time, prefill included. "
             f"Tokens identical in every run: {identical}. `python benchmarks/batch_copies.py`.", "",
             "| B | waves | batched, copies | batched, no copies | one at a time | copies / no copies "
             "| copies / one at a time | no copies / one at a time | tokens from batched copies |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b, s in summary.items():
        t = s["tps"]
        lines.append(f"| {b} | {s['waves']} | {t[MODES[0]]:.1f} | {t[MODES[1]]:.1f} | {t[MODES[2]]:.1f} "
                     f"| **{s['copies / no copies']:.2f}x** | {s['copies / one at a time']:.2f}x "
                     f"| {s['no copies / one at a time']:.2f}x | {s['batched copy tokens']} of {s['tokens']} |")
    lines += ["", "Ratios: geometric means over waves.", "", f"Machine: {m}", ""]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not args.no_plots:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 3.5))
            width = 0.27
            for k, mode in enumerate(MODES):
                ax.bar([i + (k - 1) * width for i in range(len(batches))],
                       [summary[b]["tps"][mode] for b in batches], width, label=mode)
            ax.set_xticks(range(len(batches)), [str(b) for b in batches])
            ax.set_xlabel("requests at once (B)")
            ax.set_ylabel("aggregate tok/s")
            ax.set_title("Copy-heavy requests: batched with and without copies")
            ax.legend()
            fig.tight_layout()
            fig.savefig(out / "throughput.png", dpi=120)
        except ImportError:
            print("(matplotlib not installed: no plot)")


if __name__ == "__main__":
    main()
