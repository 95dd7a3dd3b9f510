"""DFlash with mlx-lm's quantized KV cache: `auto` against plain decoding, each with the same `kv_bits`.

    python benchmarks/kv_bits_speed.py [--model smollm2-135m] [--bits none,8,4] [--start 0] [--short 2]
                                       [--max-tokens 96] [--repeats 2] [--out DIR]

The packaged target and its shipped draft; `--short` prompts of each of GSM8K, HumanEval and MT-Bench
through the chat template, greedy. For each cache setting (`none`: full precision; a number: `kv_bits`
with groups of 64, quantized once the cache holds `--start` tokens) plain decoding (`baseline=True`) and
`auto` run each prompt `--repeats` times in an ABBA order, each keeping its faster run; both must commit
the same tokens, and under a quantized cache the tokens are checked against mlx-lm's own `generate_step`
with the same arguments. The settings run one after the other, each with the width policy forgotten and
taught again on a held-out prompt. Writes results.json, README.md and speedup.png.
"""

import argparse
import json
import math
import os
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.bench.suites import format_prompt, load_suite
from dflash_mlx.cli.doctor import machine, results_footer
from dflash_mlx.engine.responses import wrap_tokenizer
from dflash_mlx.generate import encode_prompt
from dflash_mlx.policy.sizer import forget_sizers
from dflash_mlx.progress import Progress
from dflash_mlx.testing.targets import greedy_reference

SHORT = ("gsm8k", "humaneval", "mtbench")


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bits", default="none,8,4")
    ap.add_argument("--start", type=int, default=0, help="quantized_kv_start (default 0: from the first chunk on)")
    ap.add_argument("--short", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=f"benchmarks/results/{time.strftime('%Y%m%d')}-kv-bits-speed")
    args = ap.parse_args()
    started, load_start = time.perf_counter(), os.getloadavg()
    model, tok = load(args.model, quiet=True)
    draft = load_draft(args.model, model)
    prompts = [p for s in SHORT for p in load_suite(s, args.short)]
    settings = [None if b == "none" else int(b) for b in args.bits.split(",")]

    def kv(bits):
        return {} if bits is None else dict(kv_bits=bits, kv_group_size=64, quantized_kv_start=args.start)

    def run(ids, bits, plain):
        tokens, last = [], None
        for last in stream_generate(model, None if plain else draft, tok, ids, max_tokens=args.max_tokens,
                                    baseline=plain, **kv(bits)):
            tokens += last.tokens
        return tokens, last

    warm = encode_prompt(wrap_tokenizer(tok), format_prompt(tok, load_suite("mbpp", 1)[0]))
    records = []
    progress = Progress(len(prompts) * len(settings), "prompts x cache settings")
    for bits in settings:
        # each setting learns its own widths (a quantized cache holds a verify to fewer rows, and what the
        # pair's policy learns under one setting would steer the next): forgotten, then taught on a
        # held-out prompt, with the first graphs
        forget_sizers()
        for plain in (True, False):
            run(warm, bits, plain)
        for i, p in enumerate(prompts):
            ids = encode_prompt(wrap_tokenizer(tok), format_prompt(tok, p))
            rec = {"suite": p.suite, "id": p.id, "bits": bits, "prompt_tokens": len(ids)}
            order = [True, False, False, True] if i % 2 == 0 else [False, True, True, False]
            outputs = set()
            for plain in (order * args.repeats)[: 2 * args.repeats]:
                tokens, last = run(ids, bits, plain)
                outputs.add(tuple(tokens))
                name = "plain" if plain else "auto"
                if name not in rec or last.generation_tps > rec[name]["tps"]:
                    rec[name] = {"tps": last.generation_tps, "tau": last.tau, "tokens": len(tokens),
                                 "peak_gb": last.peak_memory}
            rec["identical"] = len(outputs) == 1
            if bits is not None:
                ref = greedy_reference(model, ids, args.max_tokens, stop_ids=tuple(tok.eos_token_ids), **kv(bits))
                rec["mlx_lm_equal"] = all(list(o) == ref[: len(o)] for o in outputs)
            rec["speedup"] = rec["auto"]["tps"] / rec["plain"]["tps"]
            records.append(rec)
            progress.update(len(records), force=True)
    progress.close()
    load_end = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for bits in settings:
        rs = [r for r in records if r["bits"] == bits]
        summary[str(bits)] = dict(n=len(rs), speedup=geomean([r["speedup"] for r in rs]),
                                  worst=min(r["speedup"] for r in rs),
                                  plain_tps=geomean([r["plain"]["tps"] for r in rs]),
                                  auto_tps=geomean([r["auto"]["tps"] for r in rs]),
                                  tau=sum(r["auto"]["tau"] for r in rs) / len(rs),
                                  identical=all(r["identical"] for r in rs),
                                  mlx_lm_equal=all(r.get("mlx_lm_equal", True) for r in rs))
    doc = dict(records=records, summary=summary, machine=machine(), args=vars(args), load_start=load_start,
               load_end=load_end, seconds=time.perf_counter() - started)
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    lines = [f"# DFlash with a quantized KV cache ({time.strftime('%Y-%m-%d')})", "",
             f"`python benchmarks/kv_bits_speed.py --bits {args.bits} --start {args.start}`: {args.model} + its "
             f"shipped draft, {len(prompts)} prompts ({', '.join(SHORT)}, {args.short} each), {args.max_tokens} "
             f"tokens, greedy, best of {args.repeats} runs each (ABBA). Each row: `auto` against plain decoding "
             "with the same cache (tok/s after the first token; geometric means, worst prompt in brackets).", "",
             "| KV cache | plain tok/s | auto tok/s | speed-up (worst) | tau | auto = plain "
             "| = mlx-lm's generate_step |",
             "|---|---:|---:|---:|---:|---|---|"]
    for bits, s in summary.items():
        name = "full precision" if bits == "None" else f"{bits}-bit from token {args.start}"
        lines.append(f"| {name} | {s['plain_tps']:.2f} | {s['auto_tps']:.2f} | **{s['speedup']:.2f}x** "
                     f"({s['worst']:.2f}x) | {s['tau']:.2f} | {s['identical']} | "
                     f"{'–' if bits == 'None' else s['mlx_lm_equal']} |")
    lines += [""] + results_footer(load_start, load_end)
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k, bits in enumerate(settings):
        rs = [r for r in records if r["bits"] == bits]
        ax.bar([i * (len(settings) + 1) + k for i in range(len(rs))], [r["speedup"] for r in rs],
               label="full precision" if bits is None else f"{bits}-bit KV")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([i * (len(settings) + 1) + 1 for i in range(len(prompts))], [p.id for p in prompts],
                  rotation=60, fontsize=6)
    ax.set_ylabel("auto tok/s / plain tok/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)


if __name__ == "__main__":
    main()
