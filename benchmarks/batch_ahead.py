"""Batched cycles launched ahead against each launched at its own step, interleaved in one process.

    nice -n 10 python benchmarks/batch_ahead.py [--batches 2,4] [--reps 5] [--max-tokens 64] [--out DIR]

`BatchEngine` queues a batch's next cycle before a step's responses are built (`_ahead`); the
comparison runs the same engine with `batch_ahead.launch_ahead` patched out (every cycle launched when
its step starts, as before 2026-12-05), and with only `batch_ahead.before_reading` patched out (plain
steps read before the next is queued). Two parts:

- the tiny target of the oracle probe (`gpu/parts.TINY`, random weights), B rows of a 32-token
  prompt each, all joining at once: plain batched steps (no draft, width 1) and drafted cycles
  (a random draft at width 4): ms a batched step, best of `--reps`, both decodes in each rep;
- SmolLM2-135M-Instruct with its shipped draft at `auto`, greedy: waves of B short-suite prompts
  (GSM8K, HumanEval, MT-Bench) joining at once: aggregate tok/s, prefill included; every run must
  commit the same tokens.

Writes `results.json`, `README.md` and `speed.png` to `--out`.
"""

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path
from unittest import mock

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import parts  # noqa: E402

from dflash_mlx import load, load_draft  # noqa: E402
from dflash_mlx.bench.suites import format_prompt, load_suite  # noqa: E402
from dflash_mlx.cli.doctor import machine  # noqa: E402
from dflash_mlx.engine import batch_ahead  # noqa: E402
from dflash_mlx.engine.engine import BatchEngine  # noqa: E402
from dflash_mlx.engine.rows import BatchRequest  # noqa: E402
from dflash_mlx.generate import encode_prompt  # noqa: E402
from dflash_mlx.models.draft.checkpoints import random_draft  # noqa: E402
from dflash_mlx.options import GenerationOptions  # noqa: E402
from dflash_mlx.policy.sizer import forget_sizers  # noqa: E402
from dflash_mlx.progress import Progress  # noqa: E402

MODES = ("ahead", "at its step", "ahead, read first")


class Counter:
    """`Progress` advanced one unit at a time."""

    def __init__(self, total, label):
        self.progress, self.done = Progress(total, label), 0

    def advance(self):
        self.done += 1
        self.progress.update(self.done)

    def close(self):
        self.progress.close()


def serve_wave(model, draft, tok, prompts, max_tokens, block_size, mode):
    """Every prompt's tokens, the seconds of the batched steps and their count, the wall time (`mode`:
    one of MODES)."""
    engine = BatchEngine(model, draft, tok, max_batch=len(prompts), block_size=block_size)
    index, outs = {}, [[] for _ in prompts]
    for i, ids in enumerate(prompts):
        index[engine.add(BatchRequest(ids, GenerationOptions(max_tokens=max_tokens))).uid] = i
    batched_seconds, batched_steps = 0.0, 0
    patches = contextlib.ExitStack()
    if mode != MODES[0]:  # no plain step queued before its read
        patches.enter_context(mock.patch.object(batch_ahead, "before_reading", lambda engine, launched: False))
    if mode == MODES[1]:  # nor any cycle launched before its step
        patches.enter_context(mock.patch.object(batch_ahead, "launch_ahead", lambda engine, chosen=None: None))
    t0 = time.perf_counter()
    with patches:
        while not engine.idle:
            together = engine.batched and not engine.joining
            s0 = time.perf_counter()
            for row, r in engine.step():
                outs[index[row.uid]] += r.tokens
            if together and engine.batched:
                batched_seconds += time.perf_counter() - s0
                batched_steps += 1
    return outs, batched_seconds, batched_steps, time.perf_counter() - t0


def tiny_part(batches, reps, max_tokens, progress=None):
    """The tiny target's rows: ms a batched step launched ahead and at its step, per batch size and kind
    (also the GPU check's `batch` part)."""
    model = parts.build(parts.TINY, parts.default_dtype())
    tok = parts.tokenizer_for(parts.TINY["vocab_size"])
    draft = random_draft(model, num_layers=1, block_size=4, seed=0)
    rows = []
    for b in batches:
        prompts = [list(range(10 + i, 42 + i)) for i in range(b)]
        for kind, d, width in (("plain steps", None, 1), ("drafted, width 4", draft, 4)):
            best = {m: math.inf for m in MODES}
            outs = {}
            for rep in range(reps):
                for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                    forget_sizers()
                    o, sec, n, _ = serve_wave(model, d, tok, prompts, max_tokens, width, mode)
                    best[mode] = min(best[mode], sec / max(n, 1) * 1e3)
                    outs[mode] = o
                if progress is not None:
                    progress.advance()
            rows.append({"batch": b, "kind": kind, "ms a step": best, "ratio": best[MODES[1]] / best[MODES[0]],
                         "ratio read first": best[MODES[2]] / best[MODES[0]],
                         "identical": all(outs[m] == outs[MODES[0]] for m in MODES)})
    return rows


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def smollm_part(batches, rounds, max_tokens, progress):
    model, tok = load("smollm2-135m", quiet=True)
    draft = load_draft("smollm2-135m", model)
    texts = [format_prompt(tok, p) for s in ("gsm8k", "humaneval", "mtbench") for p in load_suite(s, 4)]
    prompts = [encode_prompt(tok, t) for t in texts]
    serve_wave(model, draft, tok, prompts[:2], 16, "auto", MODES[0])  # warm-up
    rows = []
    for b in batches:
        waves = [prompts[i : i + b] for i in range(0, len(prompts) - b + 1, b)]
        totals = {m: [0, 0.0] for m in MODES}
        ratios, ratios_read_first, identical = [], [], True
        for rnd in range(rounds):
            for w, wave in enumerate(waves):
                outs, tps = {}, {}
                for mode in (MODES if (w + rnd) % 2 == 0 else MODES[::-1]):
                    o, _, _, wall = serve_wave(model, draft, tok, wave, max_tokens, "auto", mode)
                    n = sum(len(x) for x in o)
                    totals[mode][0] += n
                    totals[mode][1] += wall
                    outs[mode], tps[mode] = o, n / wall
                identical &= all(outs[m] == outs[MODES[0]] for m in MODES)
                ratios.append(tps[MODES[0]] / tps[MODES[1]])
                ratios_read_first.append(tps[MODES[0]] / tps[MODES[2]])
                progress.advance()
        rows.append({"batch": b, "waves": len(waves) * rounds,
                     "tok/s": {m: totals[m][0] / totals[m][1] for m in MODES},
                     "ratio": geomean(ratios), "ratio read first": geomean(ratios_read_first), "identical": identical})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="2,4")
    ap.add_argument("--reps", type=int, default=5, help="tiny target: runs of each decode (best taken)")
    ap.add_argument("--rounds", type=int, default=1, help="SmolLM2: rounds over the waves")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tiny-tokens", type=int, default=128)
    ap.add_argument("--no-smollm", action="store_true")
    ap.add_argument("--out", default=f"benchmarks/results/{time.strftime('%Y%m%d')}-batch-ahead")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    smollm_waves = 0 if args.no_smollm else sum(12 // b for b in batches) * args.rounds
    progress = Counter(len(batches) * 2 * args.reps + smollm_waves, "batch ahead bench")
    started = time.perf_counter()
    tiny = tiny_part(batches, args.reps, args.tiny_tokens, progress)
    smollm = [] if args.no_smollm else smollm_part(batches, args.rounds, args.max_tokens, progress)
    progress.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    m = machine()
    (out / "results.json").write_text(json.dumps({"tiny": tiny, "smollm2": smollm, "machine": m, "args": vars(args),
                                                  "seconds": time.perf_counter() - started}, indent=1))
    lines = [f"# Batched cycles launched ahead ({time.strftime('%Y-%m-%d')})", "",
             f"Backend: MLX {mx.__version__}, {mx.default_device()}; `python benchmarks/batch_ahead.py "
             f"--batches {args.batches} --reps {args.reps} --rounds {args.rounds}`.", "",
             f"Tiny target ({parts.TINY['num_hidden_layers']} layers, hidden {parts.TINY['hidden_size']}), B rows "
             f"joining at once, {args.tiny_tokens} tokens each, ms a batched step (best of {args.reps}, interleaved):",
             "", "| B | cycles | launched ahead | at its step | ahead, plain steps read first | speed-up | "
             "speed-up over read first | same tokens |", "|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in tiny:
        ms = r["ms a step"]
        lines.append(f"| {r['batch']} | {r['kind']} | {ms[MODES[0]]:.3f} | {ms[MODES[1]]:.3f} | {ms[MODES[2]]:.3f} "
                     f"| {r['ratio']:.3f}x | {r['ratio read first']:.3f}x | {r['identical']} |")
    if smollm:
        lines += ["", f"SmolLM2-135M-Instruct + shipped draft, `auto`, {args.max_tokens} tokens, waves of B short-suite "
                  "prompts joining at once, aggregate tok/s (prefill included):", "",
                  "| B | waves | launched ahead | at its step | ahead, plain steps read first | speed-up | "
                  "speed-up over read first | same tokens |", "|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in smollm:
            t = r["tok/s"]
            lines.append(f"| {r['batch']} | {r['waves']} | {t[MODES[0]]:.1f} | {t[MODES[1]]:.1f} | {t[MODES[2]]:.1f} "
                         f"| {r['ratio']:.3f}x | {r['ratio read first']:.3f}x | {r['identical']} |")
        lines += ["", "Speed-ups: geometric means over waves, launched ahead (plain steps queued before their read "
                  "where the look-ahead finds it pays) against each alternative."]
    lines += ["", f"Machine: {m}", ""]
    (out / "README.md").write_text("\n".join(lines))
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2))
        labels = [f"tiny B{r['batch']}\n{r['kind']}" for r in tiny] + [f"SmolLM2 B{r['batch']}" for r in smollm]
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], [r["ratio"] for r in tiny + smollm], 0.4, label="vs at its step")
        ax.bar([i + 0.2 for i in x], [r["ratio read first"] for r in tiny + smollm], 0.4, label="vs plain steps read first")
        ax.legend(fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel("speed-up of launching ahead")
        ax.set_title(f"Batched cycles launched ahead ({mx.default_device()})")
        fig.tight_layout()
        fig.savefig(out / "speed.png", dpi=120)
    except ImportError:
        print("(matplotlib not installed: no plot)")


if __name__ == "__main__":
    main()
