"""Copies without a draft: `auto` with `draft=None` against plain decoding (`baseline=True`).

    OPENBLAS_NUM_THREADS=1 nice -n 5 python benchmarks/no_draft_copies.py \
        [--models smollm2-135m,gemma3-270m] [--max-tokens 128] [--short 4] [--repeats 3] [--out DIR]

Prompts: the `copy` suite of `dflash-mlx bench` (text edits, code renames, quotes, multi-turn
repeats) and `--short` prompts of each of GSM8K, HumanEval and MT-Bench. SmolLM2 gets them
through its chat template; Gemma 3 270M is a base model, so each becomes a completion prompt
(`completion_text`). Greedy. For each prompt the two configurations run `--repeats` times
each in an ABBA order that flips from prompt to prompt, and each keeps its faster run (the
machine is shared: a neighbour's job only ever slows a run down). Both must commit the same
tokens. Writes `results.json`, `README.md` and `speedup.png` to `--out`.
"""

import argparse
import json
import math
import os
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
from dflash_mlx import load, stream_generate
from dflash_mlx.bench.suites import Prompt, format_prompt, load_suite
from dflash_mlx.cli.doctor import machine, results_footer
from dflash_mlx.policy.sizer import forget_sizers
from dflash_mlx.progress import Progress

CONFIGS = {"plain": dict(baseline=True), "copies (no draft)": dict()}
SHORT = ("gsm8k", "humaneval", "mtbench")


def completion_text(p: Prompt) -> str:
    """A prompt for a base model: the instruction and its input, then where the answer starts."""
    if len(p.messages) > 1:  # a conversation: its turns as a transcript
        turns = [f"{'User' if m['role'] == 'user' else 'Assistant'}: {m['content']}" for m in p.messages]
        return "\n\n".join(turns) + "\n\nAssistant:"
    instruction, _, body = p.text.partition("\n\n")
    if p.suite == "copy" and body:
        return f"{instruction}\n\nInput:\n{body}\n\nOutput:\n"
    return f"{p.text}\n\nAnswer:"


def run(model, tok, prompt, max_tokens, **kw):
    """(tokens, last response, tokens after the first per second of this process's CPU time)."""
    tokens, last, cpu0 = [], None, None
    for last in stream_generate(model, None, tok, prompt, max_tokens=max_tokens, **kw):
        tokens += last.tokens
        if cpu0 is None:
            cpu0 = time.process_time()  # the first response ends the prefill
    cpu = time.process_time() - cpu0
    return tokens, last, (len(tokens) - 1) / cpu if cpu > 0 and len(tokens) > 1 else 0.0


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def bench_model(name, args):
    model, tok = load(name, quiet=True)
    render = (lambda p: format_prompt(tok, p)) if getattr(tok, "chat_template", None) else completion_text
    prompts = load_suite("copy") + [p for s in SHORT for p in load_suite(s, args.short)]
    forget_sizers()
    # the policy's first cycles (and graphs) on a copy task not measured: an MBPP task repeated
    task = load_suite("mbpp", 1)[0]
    warm = Prompt("copy", "warm-up", [{"role": "user", "content": "Repeat the text below word for word.\n\n"
                                                                     + task.text}], {"task": "warm-up"})
    for kw in CONFIGS.values():
        run(model, tok, render(warm), 96, **kw)
    records = []
    progress = Progress(len(prompts), f"{name}")
    names = list(CONFIGS)
    for i, p in enumerate(prompts):
        text = render(p)
        first, second = names if i % 2 == 0 else names[::-1]
        order = ([first, second, second, first] * args.repeats)[: 2 * args.repeats]
        rec = {"suite": p.suite, "id": p.id, "task": p.meta.get("task", p.suite)}
        outputs = {}
        for cfg in order:
            tokens, last, cpu_tps = run(model, tok, text, args.max_tokens, **CONFIGS[cfg])
            outputs.setdefault(cfg, set()).add(tuple(tokens))
            best = rec.get(cfg)
            if best is None or last.generation_tps > best["tps"]:
                rec[cfg] = {"tps": last.generation_tps, "tokens": len(tokens), "tau": last.tau,
                            "proposals": last.proposal_counts, "prompt_tokens": last.prompt_tokens,
                            "cpu_tps": 0.0}
            rec[cfg]["cpu_tps"] = max(rec[cfg]["cpu_tps"], cpu_tps)
        rec["identical"] = len(set.union(*outputs.values())) == 1
        rec["speedup"] = rec[names[1]]["tps"] / rec["plain"]["tps"]
        rec["cpu_speedup"] = rec[names[1]]["cpu_tps"] / rec["plain"]["cpu_tps"]
        records.append(rec)
        progress.update(i + 1)
    return records


def summarise(records):
    groups = {}
    for rec in records:
        groups.setdefault(rec["task"] if rec["suite"] == "copy" else rec["suite"], []).append(rec)
    groups["copy suite"] = [r for r in records if r["suite"] == "copy"]
    groups["short suites"] = [r for r in records if r["suite"] != "copy"]
    cfg = list(CONFIGS)[1]
    return {g: {"n": len(rs), "speedup": geomean([r["speedup"] for r in rs]),
                "worst": min(r["speedup"] for r in rs), "tau": sum(r[cfg]["tau"] for r in rs) / len(rs),
                "cpu_speedup": geomean([r["cpu_speedup"] for r in rs]), "cpu_worst": min(r["cpu_speedup"] for r in rs),
                "copy_tokens": sum(r[cfg]["proposals"].get("copy", [0, 0])[1] for r in rs),
                "plain_tokens": sum(r[cfg]["proposals"].get("plain", [0, 0])[1] for r in rs)}
            for g, rs in groups.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--short", type=int, default=4, help="prompts of each short suite")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each configuration per prompt (best kept)")
    ap.add_argument("--out", default=f"benchmarks/results/{time.strftime('%Y%m%d')}-no-draft-copies")
    args = ap.parse_args()
    started, load_start = time.perf_counter(), os.getloadavg()
    results = {}
    for name in args.models.split(","):
        records = bench_model(name, args)
        results[name] = {"records": records, "summary": summarise(records)}
    load_end = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"models": results, "machine": machine(), "max_tokens": args.max_tokens, "repeats": args.repeats,
           "load_start": load_start, "load_end": load_end, "seconds": time.perf_counter() - started,
           "env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS",)}}
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out / "results.json")
    lines = [f"# Copies without a draft ({time.strftime('%Y-%m-%d')})", "",
             f"`draft=None` at `auto` against `baseline=True` (plain decoding), greedy, {args.max_tokens} tokens, "
             f"best of {args.repeats} runs each (ABBA order), speed-up = tok/s after the first token over plain "
             "decoding of the same prompt (geometric mean; worst prompt in brackets), by the wall clock and by "
             "this process's CPU time (steadier on a shared machine: time other jobs hold the cores is not "
             "counted). The width policy learns on a held-out copy task first (an MBPP task repeated).", ""]
    for name, res in results.items():
        identical = all(r["identical"] for r in res["records"])
        lines += [f"## {name}", "", f"Tokens identical on every prompt: {identical}.", "",
                  "| prompts | n | speed-up, wall (worst) | speed-up, CPU time (worst) | tau | "
                  "tokens from copies / plain steps |", "|---|---:|---:|---:|---:|---|"]
        for g, s in res["summary"].items():
            lines.append(f"| {g} | {s['n']} | **{s['speedup']:.2f}x** ({s['worst']:.2f}x) | "
                         f"{s['cpu_speedup']:.2f}x ({s['cpu_worst']:.2f}x) | {s['tau']:.2f} | "
                         f"{s['copy_tokens']} / {s['plain_tokens']} |")

        lines.append("")
    lines += results_footer(load_start, load_end)
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, out / "speedup.png")


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 3.8), squeeze=False)
    for ax, (name, res) in zip(axes[0], results.items()):
        recs = res["records"]
        colours = ["tab:orange" if r["suite"] == "copy" else "tab:blue" for r in recs]
        ax.bar(range(len(recs)), [r["speedup"] for r in recs], color=colours, label="wall clock")
        ax.plot(range(len(recs)), [r["cpu_speedup"] for r in recs], "k.", label="CPU time")
        ax.legend(fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(0.97, color="red", lw=0.6, ls="--")
        ax.set_xticks(range(len(recs)), [r["id"].split("/", 1)[-1] for r in recs], rotation=90, fontsize=6)
        ax.set_ylabel("tok/s vs plain decoding")
        ax.set_title(f"{name}: copy suite (orange), short suites (blue)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
