"""Copy trees without a draft: how often `auto` verifies a copy tree, what it commits, and
what it does to speed, against chain copies only (`token_trees=False`) and plain decoding.

    OPENBLAS_NUM_THREADS=1 nice -n 5 python benchmarks/copy_trees.py \
        [--model smollm2-135m] [--max-tokens 160] [--repeats 2] [--out DIR]

Prompts with varied repeats: answers whose lines repeat a pattern with a slot filled from a
few values (a class, a flag, a unit), where the same n-gram went on differently before, plus
a held-out one the policy learns on first. Greedy, through the model's chat template. For each
prompt the three configurations run `--repeats` times each in an order that rotates from prompt
to prompt, and each keeps its fastest run (wall clock, and this process's CPU time). All must
commit the same tokens. Writes `results.json`, `README.md` and `ratios.png` to `--out`.
"""

import argparse
import json
import os
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
from dflash_mlx import load
from dflash_mlx.cli.doctor import machine, results_footer
from dflash_mlx.policy.sizer import forget_sizers
from no_draft_copies import geomean, run  # (benchmarks/ is the script's own folder on sys.path)

CONFIGS = {"plain": dict(baseline=True), "chain copies": dict(token_trees=False), "copy trees": dict()}

WARM = ("Label each word as noun or verb, one per line as 'word: label': run, table, eat, chair, "
        "jump, window, sing, bottle, write, garden.")
PROMPTS = {
    "animal classes": "Here is a list of animals with their class:\ndog: mammal\neagle: bird\nsalmon: fish\n"
                      "snake: reptile\n\nWrite the same list for these animals, one per line: cat, sparrow, tuna, "
                      "lizard, horse, owl, shark, turtle, cow, parrot, trout, crocodile.",
    "json flags": "Convert to JSON, one object per line like {\"name\": \"Alice\", \"active\": true}:\n"
                  "Alice active\nBob inactive\nCarol active\nDan active\nEve inactive\nFrank inactive\n"
                  "Grace active\nHeidi inactive\nIvan active\nJudy active",
    "code branches": "Write a Python function `kind(x)` with one if/elif branch per value that returns "
                     "'small', 'medium' or 'large': 1 small, 2 small, 3 medium, 4 large, 5 medium, 6 small, "
                     "7 large, 8 medium, 9 large, 10 small.",
    "csv continents": "Rewrite this table as CSV lines 'city,country,continent':\nParis France Europe\n"
                      "Lima Peru America\nRome Italy Europe\nCairo Egypt Africa\nQuito Ecuador America\n"
                      "Oslo Norway Europe\nLagos Nigeria Africa\nBogota Colombia America\nMadrid Spain Europe\n"
                      "Nairobi Kenya Africa",
}


def render(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def bench(args):
    model, tok = load(args.model, quiet=True)
    forget_sizers()
    for kw in CONFIGS.values():  # the policy's first cycles (and graphs) not measured
        run(model, tok, render(tok, WARM), args.max_tokens, **kw)
    names = list(CONFIGS)
    records = []
    for i, (pid, text) in enumerate(PROMPTS.items()):
        prompt = render(tok, text)
        order = [names[(i + j) % len(names)] for j in range(len(names))]
        order = (order + order[::-1]) * args.repeats
        rec = {"id": pid}
        outputs = set()
        for cfg in order[: len(names) * args.repeats]:
            tokens, last, cpu_tps = run(model, tok, prompt, args.max_tokens, **CONFIGS[cfg])
            outputs.add(tuple(tokens))
            cycles = sum(n for n, _ in last.proposal_counts.values())
            best = rec.get(cfg)
            if best is None or last.generation_tps > best["tps"]:
                rec[cfg] = {"tps": last.generation_tps, "tokens": len(tokens), "tau": last.tau, "cycles": cycles,
                            "proposals": last.proposal_counts, "cpu_tps": 0.0}
            rec[cfg]["cpu_tps"] = max(rec[cfg]["cpu_tps"], cpu_tps)
        rec["identical"] = len(outputs) == 1
        rec["text"] = tok.decode(list(next(iter(outputs))))
        trees = rec["copy trees"]
        n, committed = trees["proposals"].get("copy_tree", [0, 0])
        rec["copy_tree_cycles"], rec["copy_tree_tokens"] = n, committed
        rec["copy_tree_share"] = n / trees["cycles"] if trees["cycles"] else 0.0
        for cfg in ("plain", "chain copies"):
            rec[f"vs {cfg}"] = trees["tps"] / rec[cfg]["tps"]
            rec[f"vs {cfg}, cpu"] = trees["cpu_tps"] / rec[cfg]["cpu_tps"]
        records.append(rec)
        print(pid, {k: v for k, v in rec.items() if k.startswith("vs") or k.startswith("copy_tree")}, flush=True)
    return records


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each configuration per prompt (best kept)")
    ap.add_argument("--out", default=f"benchmarks/results/{time.strftime('%Y%m%d')}-copy-trees")
    args = ap.parse_args()
    started, load_start = time.perf_counter(), os.getloadavg()
    records = bench(args)
    load_end = os.getloadavg()
    summary = {k: geomean([r[k] for r in records]) for k in ("vs plain", "vs chain copies", "vs plain, cpu",
                                                              "vs chain copies, cpu")}
    summary.update(copy_tree_cycles=sum(r["copy_tree_cycles"] for r in records),
                   copy_tree_tokens=sum(r["copy_tree_tokens"] for r in records),
                   cycles=sum(r["copy trees"]["cycles"] for r in records),
                   identical=all(r["identical"] for r in records))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"model": args.model, "records": records, "summary": summary, "machine": machine(),
           "max_tokens": args.max_tokens, "repeats": args.repeats, "load_start": load_start, "load_end": load_end,
           "seconds": time.perf_counter() - started, "env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS",)}}
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    lines = [f"# Copy trees without a draft ({time.strftime('%Y-%m-%d')})", "",
             f"{args.model}, no draft, `auto`, greedy, {args.max_tokens} tokens, best of {args.repeats} runs of "
             "each configuration (rotating order); copy trees (the default) against chain copies only "
             "(`token_trees=False`) and plain decoding (`baseline=True`). Ratios are tok/s after the first token, "
             "by the wall clock and by this process's CPU time. Script: `benchmarks/copy_trees.py`.", "",
             f"Tokens identical on every prompt: {summary['identical']}.", "",
             "| prompt | copy-tree cycles / all | tokens from copy trees (per cycle) | tokens from chain copies | "
             "vs chain copies, wall / CPU | vs plain, wall / CPU |", "|---|---:|---:|---:|---:|---:|"]
    for r in records:
        t = r["copy trees"]
        per = r["copy_tree_tokens"] / r["copy_tree_cycles"] if r["copy_tree_cycles"] else 0.0
        lines.append(f"| {r['id']} | {r['copy_tree_cycles']} / {t['cycles']} | {r['copy_tree_tokens']} ({per:.1f}) | "
                     f"{t['proposals'].get('copy', [0, 0])[1]} | {r['vs chain copies']:.2f}x / "
                     f"{r['vs chain copies, cpu']:.2f}x | {r['vs plain']:.2f}x / {r['vs plain, cpu']:.2f}x |")
    lines.append(f"| all (geomean) | {summary['copy_tree_cycles']} / {summary['cycles']} | "
                 f"{summary['copy_tree_tokens']} | | {summary['vs chain copies']:.2f}x / "
                 f"{summary['vs chain copies, cpu']:.2f}x | {summary['vs plain']:.2f}x / "
                 f"{summary['vs plain, cpu']:.2f}x |")
    lines += ["", *results_footer(load_start, load_end)]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(records, out / "ratios.png")


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(records))
    ax.bar([i - 0.2 for i in x], [r["vs chain copies"] for r in records], 0.4, label="vs chain copies")
    ax.bar([i + 0.2 for i in x], [r["vs plain"] for r in records], 0.4, label="vs plain decoding")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(x), [r["id"] for r in records], fontsize=7)
    ax.set_ylabel("tok/s ratio, copy trees on")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
