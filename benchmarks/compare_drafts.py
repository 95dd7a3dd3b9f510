"""Engine tau of two or more drafts of one target on the same short prompts, in one process.

The gate a replacement draft must pass on the short suites: greedy, at the draft's own
width (block 16: tau there depends on the draft alone, not on timings as `auto`'s does),
128 tokens, benchmark prompts never trained on; suites and drafts interleaved prompt by
prompt, so both drafts see the same machine state.

    python benchmarks/compare_drafts.py --draft shipped=smollm2-135m --draft new=runs/d24/draft \\
        --limits gsm8k=20,humaneval=6,mtbench=6 --out benchmarks/results/<date>-draft-gate

`--auto N` adds the gate's second half: on N prompts a suite, each draft at `auto` against plain
decoding of the same target, the configurations interleaved prompt by prompt (speed-up in wall-clock
and CPU time, and tau; `auto_speed.json`, `auto_speed.md`).
"""

import argparse
import json
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", action="append", required=True, metavar="LABEL=DRAFT")
    p.add_argument("--limits", default="gsm8k=20,humaneval=6,mtbench=6")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--auto", type=int, default=0, metavar="N", help="prompts a suite for the speed-up at auto")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from dflash_mlx import load, load_draft
    from dflash_mlx.bench.suites import format_prompt, load_suite
    from dflash_mlx.cli.doctor import machine
    from dflash_mlx.generate import encode_prompt, stream_generate, tau

    model, tok = load(args.target, quiet=True)
    drafts = {}
    for item in args.draft:
        label, _, name = item.partition("=")
        drafts[label] = load_draft(name, model)
    rows = {}
    started = time.perf_counter()
    for item in args.limits.split(","):
        suite, n = item.split("=")
        accepts = {k: [] for k in drafts}
        identical = True
        for prompt in load_suite(suite, limit=int(n), seed=0):
            ids = encode_prompt(tok, format_prompt(tok, prompt))
            outputs = {}
            for label, draft in drafts.items():
                tokens, last = [], None
                for r in stream_generate(model, draft, tok, ids, max_tokens=args.max_tokens, block_size="draft"):
                    tokens.extend(r.tokens)
                    last = r
                accepts[label] += list(last.accept_lengths)
                outputs[label] = tokens
            identical &= len({tuple(t) for t in outputs.values()}) == 1
        rows[suite] = {k: {"tau": tau(a), "cycles": len(a)} for k, a in accepts.items()}
        rows[suite]["prompts"] = int(n)
        rows[suite]["identical"] = identical
        print(suite, " ".join(f"{k}: tau {v['tau']:.3f} ({v['cycles']} cycles)"
                              for k, v in rows[suite].items() if isinstance(v, dict)),
              f"[{time.perf_counter() - started:.0f}s]", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"target": args.target, "drafts": dict(d.partition("=")[::2] for d in args.draft),
           "block_size": "draft", "max_tokens": args.max_tokens, "machine": machine(),
           "elapsed_s": round(time.perf_counter() - started, 1), "suites": rows}
    (out / "draft_gate.json").write_text(json.dumps(doc, indent=1))
    labels = list(drafts)
    lines = ["| suite | prompts | " + " | ".join(f"tau {k}" for k in labels) + " | identical tokens |",
             "|---|---:|" + "---:|" * len(labels) + "---|"]
    for suite, r in rows.items():
        lines.append(f"| {suite} | {r['prompts']} | " + " | ".join(f"{r[k]['tau']:.3f} ({r[k]['cycles']})"
                                                             for k in labels)
                     + f" | {'yes' if r['identical'] else 'NO'} |")
    (out / "draft_gate.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.auto:
        auto_speed(model, tok, drafts, [item.split("=")[0] for item in args.limits.split(",")], args.auto,
                   args.max_tokens, out)


def auto_speed(model, tok, drafts, suites, n, max_tokens, out):
    """Each draft at `auto` against plain decoding, interleaved prompt by prompt (`engine_vs_reference`)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_vs_reference import compare, ours

    from dflash_mlx.bench.suites import format_prompt, load_suite
    from dflash_mlx.generate import encode_prompt

    doc = {"max_tokens": max_tokens, "prompts_a_suite": n, "suites": {}}
    for suite in suites:
        prompts = [(f"{suite}/{p.id}", encode_prompt(tok, format_prompt(tok, p))) for p in load_suite(suite, limit=n)]
        configs = {"plain": ours(model, None, tok, None, baseline=True)}
        configs.update({f"auto {label}": ours(model, draft, tok, "auto") for label, draft in drafts.items()})
        rows, mismatches = compare(configs, prompts, max_tokens)
        base = rows["plain"]
        doc["suites"][suite] = {k: dict(tok_s=round(v["tok_s"], 2), speedup=round(v["tok_s"] / base["tok_s"], 3),
                                        cpu_speedup=round(v["tok_cpu_s"] / base["tok_cpu_s"], 3), tau=v["tau"])
                                for k, v in rows.items()}
        doc["suites"][suite]["mismatches"] = mismatches
        print(suite, json.dumps(doc["suites"][suite]), flush=True)
    (out / "auto_speed.json").write_text(json.dumps(doc, indent=1))
    labels = list(drafts)
    lines = ["| suite | " + " | ".join(f"{k}: speed-up (tau)" for k in labels) + " | identical tokens |",
             "|---|" + "---:|" * len(labels) + "---|"]
    for suite, r in doc["suites"].items():
        lines.append(f"| {suite} | " + " | ".join(f"{r['auto ' + k]['speedup']:.2f}x ({r['auto ' + k]['tau']:.2f})"
                                                 for k in labels)
                     + f" | {'NO' if r['mismatches'] else 'yes'} |")
    (out / "auto_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
