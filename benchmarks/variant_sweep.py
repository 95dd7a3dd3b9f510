"""Every config variant of every architecture (`dflash_mlx.testing.variants`), checked exact
against mlx-lm's greedy decode (`dflash_mlx.testing.variant_check`), with a report.

    OPENBLAS_NUM_THREADS=1 nice -n 10 python benchmarks/variant_sweep.py [--keys llama,gpt_oss]
        [--kinds window,rope] [--out DIR] [--docs] [--resume]

Variants are generated from the fields each model's `ModelArgs` has (windows and chunks shorter
than the prompt, every RoPE scaling type its code reads, partial rotary, q/k norms, sinks,
soft-caps, KV sharing, no-RoPE layers, MoE on some layers). Each is checked at widths 1, 4, 16 and
`auto`, over two chat turns, under token trees and in a batch where the model takes them; a variant
the target refuses gives its one line. Writes `results.json` (after every variant: an interrupted
run keeps its rows, `--resume` skips them) and `README.md` (the generated table and the run) to
`--out` (default `benchmarks/results/<UTC date>-variant-sweep/`); `--docs` rewrites the variant
section of docs/targets.md. Exit status 1 when a variant mismatches.
"""

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
from dflash_mlx.bench.environment import environment, loadavg
from dflash_mlx.cli.doctor import results_footer
from dflash_mlx.progress import Progress, format_duration
from dflash_mlx.testing import arch_check, combined_variants, variant_check, variant_table, variants

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", default="", help="comma list of architectures (default: all)")
    ap.add_argument("--kinds", default="", help="comma list of option kinds or prefixes (default: all)")
    ap.add_argument("--out", default="")
    ap.add_argument("--docs", action="store_true", help="rewrite the variant section of docs/targets.md")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in --out")
    ap.add_argument("--combined", action="store_true",
                    help="the options of each architecture switched on together (`combined_variants.combined`)")
    args = ap.parse_args(argv)

    keys = [k for k in args.keys.split(",") if k] or list(arch_check.ARCHITECTURES)
    unknown = [k for k in keys if k not in arch_check.ARCHITECTURES]
    if unknown:
        sys.exit(f"unknown architectures: {', '.join(unknown)}")
    kinds = [k for k in args.kinds.split(",") if k]
    generate = combined_variants.all_combined if args.combined else variants.all_variants
    todo = [v for v in generate(keys) if not kinds or any(v.kind.startswith(k) for k in kinds)]
    out = args.out or os.path.join(HERE, "results", datetime.now(timezone.utc).strftime("%Y%m%d")
                                            + ("-variant-combined" if args.combined else "-variant-sweep"))
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "results.json")
    rows = []
    if args.resume and os.path.exists(path):
        with open(path) as f:
            rows = json.load(f)["results"]
    done = {r["name"] for r in rows}
    doc = {"schema": "dflash-mlx-variant-sweep/1", "environment": environment(), "command": " ".join(sys.argv),
           "widths": [str(w) for w in variant_check.WIDTHS], "max_tokens": variant_check.MAX_TOKENS,
           "prompt_len": arch_check.PROMPT_LEN, "results": rows}
    start, load_start = time.perf_counter(), os.getloadavg()
    progress = Progress(len(todo), "variants", every=0.0)
    for i, v in enumerate(todo):
        if v.name not in done:
            r = variant_check.check(v)
            rows.append(r.row())
            if r.status == "mismatch":
                sys.stderr.write(f"\nMISMATCH {r.name} ({r.option}): {r.reason}\n")
            doc["elapsed_s"] = round(time.perf_counter() - start, 1)
            with open(path + ".tmp", "w") as f:
                json.dump(doc, f, indent=1)
            os.replace(path + ".tmp", path)
        progress.update(i + 1, v.name)
    progress.close()
    doc["loadavg_end"] = loadavg()
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    elapsed = time.perf_counter() - start
    rel = os.path.relpath(path, os.path.dirname(HERE))
    ran = len(rows) - len(done)  # with --resume, the rows checked by this run (the rest were kept)
    lines = [f"# Config variants: {len(rows)} checked"
             + (f" ({ran} by this run, in {format_duration(elapsed)})" if done else f" in {format_duration(elapsed)}"),
             "",
             f"Command: `{doc['command']}`. Prompt {arch_check.PROMPT_LEN} tokens, {variant_check.MAX_TOKENS} "
             f"generated; seconds per variant in `results.json`.", "",
             variant_table.markdown(rows, rel, args.combined)] + results_footer(load_start, os.getloadavg())
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(lines))
    if args.docs:
        variant_table.write(rows, source=rel, combined=args.combined)
    bad = [r for r in rows if r["status"] == "mismatch"]
    print(f"{len(rows)} variants in {format_duration(elapsed)}: "
          + ", ".join(f"{sum(r['status'] == s for r in rows)} {s}" for s in variant_check.STATUSES)
          + f"; report in {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
