"""Engine tau of the shipped draft with its reduced vocabulary vs the full one (issue 26).

`export-draft --format zlab-full` (SGLang, z-lab's code) makes the shipped draft score
the target's whole vocabulary: it can then propose tokens outside the 8192 it was
trained to rank. This measures what that costs in tau, greedy, block 16, 128 tokens,
on held-out GSM8K / HumanEval / MT-Bench prompts; both runs in one process, the same
prompts, suites interleaved.

    nice -n 5 python benchmarks/full_vocab_tau.py --out benchmarks/results/20261202-full-vocab-tau
"""

import argparse
import json
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--limits", default="gsm8k=8,humaneval=6,mtbench=6")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()
    from dflash_mlx import load, load_draft
    from dflash_mlx.cli.doctor import machine
    from dflash_mlx.train.evaluate import measure_tau

    model, tok = load("smollm2-135m", quiet=True)
    draft = load_draft("smollm2-135m", model)
    reduced_ids = draft.vocab_ids
    results = {"machine": machine(), "block_size": args.block_size, "max_tokens": args.max_tokens,
               "draft_vocab": int(reduced_ids.shape[0]), "suites": {}}
    for item in args.limits.split(","):
        suite, n = item.split("=")
        row = {}
        for name, ids in (("reduced", reduced_ids), ("full", None)):
            draft.set_vocab(ids)
            t0 = time.perf_counter()
            row[name] = measure_tau(model, tok, draft, suites=(suite,), limit=int(n), max_tokens=args.max_tokens,
                                    block_size=args.block_size)[suite]
            print(f"{suite} {name}: tau {row[name]['tau']:.3f} ({row[name]['cycles']} cycles, "
                  f"{row[name]['tokens']} tokens, {time.perf_counter() - t0:.0f} s)", flush=True)
        row["change"] = row["full"]["tau"] / row["reduced"]["tau"] - 1
        results["suites"][suite] = row
    pooled = {}
    for name in ("reduced", "full"):
        tok_sum = sum(r[name]["tokens"] for r in results["suites"].values())
        cyc = sum(r[name]["cycles"] for r in results["suites"].values())
        pooled[name] = tok_sum / cyc  # tokens per target forward (first token from prefill counted like tau)
    results["all_tokens_per_cycle"] = pooled
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    _plot(results, out / "tau.png")
    print(json.dumps({s: {k: round(v["tau"], 3) for k, v in r.items() if k != "change"} | {"change": round(r["change"], 4)}
                      for s, r in results["suites"].items()}, indent=2))


def _plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = list(results["suites"])
    x = range(len(suites))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for off, name in ((-0.2, "reduced"), (0.2, "full")):
        ax.bar([i + off for i in x], [results["suites"][s][name]["tau"] for s in suites], width=0.4,
               label=f"{name} vocabulary" + (f" ({results['draft_vocab']})" if name == "reduced" else " (49152)"))
    ax.set_xticks(list(x), suites)
    ax.set_ylabel("engine tau (greedy, block 16)")
    ax.set_title("shipped SmolLM2 draft: reduced vs full vocabulary")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
