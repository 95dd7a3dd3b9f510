"""Copy proposals: `auto` with and without copies vs plain decoding, interleaved (only ratios count).

    python benchmarks/copy_bench.py [--max-tokens 128] [--short 4] [--out DIR]

The embedded default target and its shipped draft, greedy. Prompts: the `copy` suite of
`dflash-mlx bench` (text edits, code renames, quotes, multi-turn repeats, from held-out
documents) and `--short` prompts of each of GSM8K, HumanEval and MT-Bench (where copies
should cost nothing). Each prompt runs plain decoding, `auto` without copies and `auto` with
copies, in an order that rotates from prompt to prompt; all three must commit the same
tokens. Writes `results.json`, `README.md` and `speedup.png` to `--out`.
"""

import argparse
import json
import math
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.bench.suites import format_prompt, load_suite
from dflash_mlx.doctor import machine
from dflash_mlx.progress import Progress

CONFIGS = {"plain": dict(baseline=True), "auto, no copies": dict(copy_proposals=False), "auto": dict()}


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
    ap.add_argument("--out", default=f"benchmarks/results/{time.strftime('%Y%m%d')}-copy-proposals")
    args = ap.parse_args()

    model, tok = load("smollm2-135m", quiet=True)
    draft = load_draft("smollm2-135m", model)
    prompts = load_suite("copy") + [p for s in ("gsm8k", "humaneval", "mtbench") for p in load_suite(s, args.short)]
    # warm-up: the first calls build graphs; the policy learns on a prompt not measured
    run(model, draft, tok, format_prompt(tok, prompts[-1]), 16)
    records = []
    progress = Progress(len(prompts), "copy bench")
    for i, p in enumerate(prompts):
        text = format_prompt(tok, p)
        order = list(CONFIGS)[i % 3:] + list(CONFIGS)[: i % 3]
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
    summary = {g: {name: geomean([ratio(r, name) for r in rs]) for name in ("auto, no copies", "auto")}
               for g, rs in groups.items()}
    for name, sel in (("copy suite", lambda r: r["suite"] == "copy"), ("short suites", lambda r: r["suite"] != "copy")):
        rs = [r for r in records if sel(r)]
        summary[name] = {n: geomean([ratio(r, n) for r in rs]) for n in ("auto, no copies", "auto")}
    copies = {g: sum(r["auto"]["proposals"].get("copy", [0, 0])[1] for r in rs) for g, rs in groups.items()}
    tokens = {g: sum(r["auto"]["tokens"] for r in rs) for g, rs in groups.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"records": records, "summary": summary, "machine": machine(),
                                                  "max_tokens": args.max_tokens}, indent=1))
    lines = [f"# Copy proposals ({time.strftime('%Y-%m-%d')})", "",
             f"SmolLM2-135M-Instruct with its shipped draft, greedy, {args.max_tokens} tokens, "
             "`python benchmarks/copy_bench.py`; speed-up = tok/s over plain decoding of the same prompt "
             "(geometric mean), the three runs of a prompt interleaved. Tokens identical on every prompt: "
             f"{all(r['identical'] for r in records)}.", "",
             "| prompts | n | auto, no copies | auto (copies on) | tokens from copies |", "|---|---:|---:|---:|---:|"]
    for g in list(groups) + ["copy suite", "short suites"]:
        n = len(groups[g]) if g in groups else sum(len(rs) for k, rs in groups.items()
                                                   if (k in ("gsm8k", "humaneval", "mtbench")) == (g == "short suites"))
        share = f"{copies[g]}/{tokens[g]}" if g in groups else ""
        lines.append(f"| {g} | {n} | {summary[g]['auto, no copies']:.2f}x | {summary[g]['auto']:.2f}x | {share} |")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = list(groups)
        fig, ax = plt.subplots(figsize=(7, 3.4))
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [summary[g]["auto, no copies"] for g in names], 0.4, label="auto, no copies")
        ax.bar([x + 0.2 for x in xs], [summary[g]["auto"] for g in names], 0.4, label="auto (copies on)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(list(xs), names, rotation=20)
        ax.set_ylabel("speed-up vs plain")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "speedup.png", dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
