"""Proposals: `auto` with chains only, with token trees, and with trees and copies, vs plain decoding.

    python benchmarks/proposals_bench.py [--max-tokens 128] [--short 4] [--out DIR]

The embedded default target and its shipped draft, greedy. Prompts: the `copy` suite of
`dflash-mlx bench` (text edits, code renames, quotes, multi-turn repeats, from held-out
documents) and `--short` prompts of each of GSM8K, HumanEval and MT-Bench. Each prompt runs
every configuration, in an order that rotates from prompt to prompt (only ratios within one
run count); all must commit the same tokens. Writes `results.json`, `README.md` and
`speedup.png` to `--out`.
"""

import argparse
import json
import math
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.bench.suites import format_prompt, load_suite
from dflash_mlx.cli.doctor import machine
from dflash_mlx.progress import Progress

CONFIGS = {
    "plain": dict(baseline=True),
    "chains": dict(copy_proposals=False, token_trees=False),
    "chains + trees": dict(copy_proposals=False),
    "auto (trees + copies)": dict(),
}
COMPARED = [name for name in CONFIGS if name != "plain"]
KINDS = ("draft", "tree", "copy", "plain")


def run(model, draft, tok, prompt, max_tokens, **kw):
    tokens, last = [], None
    for last in stream_generate(model, draft, tok, prompt, max_tokens=max_tokens, **kw):
        tokens += last.tokens
    return tokens, last


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--short", type=int, default=4, help="prompts of each short suite")
    ap.add_argument("--random-draft", action="store_true",
                    help="a random draft of the shipped one's shape instead (what a useless draft costs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.out = args.out or (f"benchmarks/results/{time.strftime('%Y%m%d')}-proposals"
                            + ("-random-draft" if args.random_draft else ""))

    model, tok = load("smollm2-135m", quiet=True)
    draft = load_draft("smollm2-135m", model)
    if args.random_draft:
        from dflash_mlx.models.draft.checkpoints import random_draft

        draft = random_draft(model, num_layers=len(draft.layers), block_size=draft.block_size, seed=0)
    prompts = load_suite("copy") + [p for s in ("gsm8k", "humaneval", "mtbench") for p in load_suite(s, args.short)]
    # warm-up: the first calls build graphs; the policy learns on a prompt not measured
    for name in COMPARED:
        run(model, draft, tok, format_prompt(tok, prompts[-1]), 32, **CONFIGS[name])
    records = []
    progress = Progress(len(prompts), "proposals bench")
    started = time.perf_counter()
    names = list(CONFIGS)
    for i, p in enumerate(prompts):
        text = format_prompt(tok, p)
        order = names[i % len(names):] + names[: i % len(names)]
        rec = {"suite": p.suite, "id": p.id, "task": p.meta.get("task", p.suite)}
        outputs = {}
        for name in order:
            tokens, last = run(model, draft, tok, text, args.max_tokens, **CONFIGS[name])
            outputs[name] = tokens
            rec[name] = {"tps": last.generation_tps, "tokens": len(tokens), "tau": last.tau,
                         "proposals": last.proposal_counts}
        rec["identical"] = len({tuple(t) for t in outputs.values()}) == 1
        records.append(rec)
        progress.update(i + 1)

    def ratio(rec, name):
        return rec[name]["tps"] / rec["plain"]["tps"]

    groups = {}
    for rec in records:
        groups.setdefault(rec["task"] if rec["suite"] == "copy" else rec["suite"], []).append(rec)
    groups["copy suite"] = [r for r in records if r["suite"] == "copy"]
    groups["short suites"] = [r for r in records if r["suite"] != "copy"]
    summary = {g: {name: geomean([ratio(r, name) for r in rs]) for name in COMPARED} for g, rs in groups.items()}
    worst = {g: {name: min(ratio(r, name) for r in rs) for name in COMPARED} for g, rs in groups.items()}
    taus = {g: {name: sum(r[name]["tau"] for r in rs) / len(rs) for name in COMPARED} for g, rs in groups.items()}
    auto = COMPARED[-1]
    shares = {g: {k: sum(r[auto]["proposals"].get(k, [0, 0])[1] for r in rs) for k in KINDS}
              for g, rs in groups.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"records": records, "summary": summary, "worst": worst,
                                                  "tau": taus, "machine": machine(),
                                                  "max_tokens": args.max_tokens,
                                                  "seconds": time.perf_counter() - started}, indent=1))
    which = "a random draft of the shipped one's shape" if args.random_draft else "its shipped draft"
    lines = [f"# Proposals ({time.strftime('%Y-%m-%d')})", "",
             f"SmolLM2-135M-Instruct with {which}, greedy, {args.max_tokens} tokens, "
             "`python benchmarks/proposals_bench.py`; speed-up = tok/s over plain decoding of the same prompt "
             "(geometric mean; worst prompt and mean tau in brackets), the runs of a prompt interleaved. "
             f"Tokens identical on every prompt: {all(r['identical'] for r in records)}.", "",
             "| prompts | n | " + " | ".join(COMPARED) + f" | {auto}: tokens from draft / tree / copy / plain |",
             "|---|---:|" + "---:|" * len(COMPARED) + "---|"]
    for g, rs in groups.items():
        cells = [f"**{summary[g][n]:.2f}x** ({worst[g][n]:.2f}x, {taus[g][n]:.2f})" for n in COMPARED]
        lines.append(f"| {g} | {len(rs)} | " + " | ".join(cells) + " | "
                     + " / ".join(str(shares[g][k]) for k in KINDS) + " |")
    lines += ["", f"Machine: {machine()}", ""]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = list(groups)
        fig, ax = plt.subplots(figsize=(8, 3.6))
        width = 0.8 / len(COMPARED)
        for j, name in enumerate(COMPARED):
            ax.bar([x + (j - (len(COMPARED) - 1) / 2) * width for x in range(len(names))],
                   [summary[g][name] for g in names], width, label=name)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(list(range(len(names))), names, rotation=20)
        ax.set_ylabel("speed-up vs plain")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "speedup.png", dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
