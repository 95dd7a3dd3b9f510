"""Random engine options on random architectures against mlx-lm's greedy decode, with a report
(`dflash_mlx.testing.option_fuzz`).

    OPENBLAS_NUM_THREADS=1 nice -n 10 python benchmarks/option_fuzz.py [--stream 3000] [--batch 1500]
        [--seed 0] [--out DIR]

Each case is a seed: an architecture (every tiny config of `testing.arch_check` this machine runs),
a width, a prefill chunk, stops, logprobs, copies, trees, split head, deterministic mode, a second
turn on the prompt cache (`stream_generate`); or 2-5 requests joining one `BatchEngine` at random
steps, with a batch size, prefill chunk and budget, width, stops, second turns joining together
and the index of earlier answers. Writes `results.json` (after every case) and `README.md` to
`--out` (default `benchmarks/results/<UTC date>-option-fuzz/`). Exit status 1 when a case
mismatches or raises.
"""

import argparse
import json
import os
import sys
import time
from collections import Counter
from datetime import datetime, timezone

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
from dflash_mlx.bench.environment import environment
from dflash_mlx.cli.doctor import results_footer
from dflash_mlx.progress import Progress, format_duration
from dflash_mlx.testing import option_fuzz

HERE = os.path.dirname(os.path.abspath(__file__))
# what results.json keeps of an exact case (its seed makes it again: `option_fuzz.stream_case(seed)`)
KEPT = ("seed", "kind", "key", "status", "seconds")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stream", type=int, default=3000, help="stream_generate cases")
    ap.add_argument("--batch", type=int, default=1500, help="batch engine cases")
    ap.add_argument("--guess", type=int, default=0, help="stream cases whose drafted chains' successors are "
                    "queued before their read, on the guess that they are accepted whole")
    ap.add_argument("--guess-batch", type=int, default=0, help="batch engine cases, the same while a row "
                    "decodes alone")
    ap.add_argument("--seed", type=int, default=0, help="the first case's seed (case i: seed + i)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    out = args.out or os.path.join(HERE, "results", datetime.now(timezone.utc).strftime("%Y%m%d") + "-option-fuzz")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "results.json")
    todo = ([(option_fuzz.stream_case, args.seed + i) for i in range(args.stream)]
            + [(option_fuzz.batch_case, args.seed + i) for i in range(args.batch)]
            + [(lambda seed: option_fuzz.stream_case(seed, guess=True), args.seed + i) for i in range(args.guess)]
            + [(lambda seed: option_fuzz.batch_case(seed, guess=True), args.seed + i) for i in range(args.guess_batch)])
    rows = []
    doc = {"schema": "dflash-mlx-option-fuzz/1", "environment": environment(), "command": " ".join(sys.argv),
           "results": rows}
    start, load_start = time.perf_counter(), os.getloadavg()
    progress = Progress(len(todo), "cases", every=1.0)
    for i, (case, seed) in enumerate(todo):
        row = case(seed)
        rows.append(row if row["status"] != "exact" else {k: row[k] for k in KEPT})
        if row["status"] in ("mismatch", "raised"):
            sys.stderr.write(f"\n{row['status'].upper()} {row['kind']} seed {seed} {row['key']}: {row['reason'][-300:]}\n")
        if i % 50 == 0 or i == len(todo) - 1:
            doc["elapsed_s"] = round(time.perf_counter() - start, 1)
            with open(path + ".tmp", "w") as f:
                json.dump(doc, f, separators=(",", ":"))
            os.replace(path + ".tmp", path)
        progress.update(i + 1, f"{row['kind']} {row['key']}")
    progress.close()
    elapsed = time.perf_counter() - start
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(report(rows, doc["command"], elapsed) + results_footer(load_start, os.getloadavg())))
    counts = Counter(r["status"] for r in rows)
    print(f"{len(rows)} cases in {format_duration(elapsed)}: "
          + ", ".join(f"{counts[s]} {s}" for s in option_fuzz.STATUSES) + f"; report in {out}")
    return 1 if counts["mismatch"] or counts["raised"] else 0


def report(rows, command: str, elapsed: float):
    lines = [f"# Option fuzz: {len(rows)} cases in {format_duration(elapsed)}", "",
             f"Command: `{command}`. Each case against mlx-lm's own greedy decode of the same tiny model (float32, "
             "or bfloat16 in deterministic mode, 4- or 8-bit where drawn; `dflash_mlx/testing/option_fuzz.py`); "
             "its options in `results.json`.", "",
             "| cases | " + " | ".join(option_fuzz.STATUSES) + " | architectures |",
             "|---|" + "---:|" * (len(option_fuzz.STATUSES) + 1)]
    for kind in ("stream", "batch", "guess", "batch guess"):
        these = [r for r in rows if r["kind"] == kind]
        if these:
            counts = Counter(r["status"] for r in these)
            lines.append(f"| {kind} ({len(these)}) | " + " | ".join(str(counts[s]) for s in option_fuzz.STATUSES)
                         + f" | {len({r['key'] for r in these})} |")
    refusals = Counter(r["reason"] for r in rows if r["status"] == "refused")
    if refusals:
        lines += ["", "Refusals (the one line, how many cases):", ""]
        lines += [f"- {n} x {reason}" for reason, n in refusals.most_common()]
    bad = [r for r in rows if r["status"] in ("mismatch", "raised")]
    lines += ["", "Mismatches and raises:" if bad else "No mismatch, nothing raised.", ""]
    for r in bad:
        lines.append(f"- {r['kind']} seed {r['seed']}, `{r['key']}`, {r['status']}: "
                     + r["reason"].strip().splitlines()[-1][:300])
    return lines + [""]


if __name__ == "__main__":
    sys.exit(main())
