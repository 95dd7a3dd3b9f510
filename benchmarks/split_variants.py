"""Config variants of the seed families under every split mlx-lm gives them, on two ranks (issue 47).

    OPENBLAS_NUM_THREADS=1 python benchmarks/split_variants.py [--families gpt_oss,kimi_k25] [--ranks 3] [--out DIR]
        [--fuzz 500 --seed 0]

`--fuzz N`: instead of the variants, N option-fuzz cases on the families split
(`dflash_mlx.testing.option_fuzz.split_case`: random widths, prefill chunks, stops, copies, trees,
drafts and second turns, each against the split model's own greedy decode).

For each seed family that mlx-lm splits (or `--families`, any architecture), its own tiny config and
every config variant `dflash_mlx.testing.variants` gives it (one option, and the options together:
`combined_variants.combined`) is built, split over two ranks
(`mlx.launch -n 2 --backend ring` on this machine) under each parallelism mlx-lm gives it, and
decoded by DFlash at widths 1 and 16 (a random draft tapping layers on every rank) and 4 and `auto`
(a scripted draft right for a random number of tokens each cycle, every rollback length, tapping
every layer), and as three rows of one batch where the model batches, each
against the split model's own greedy decode. The two-rank launch in the tests runs each family's
own tiny config; this runs the options those configs leave off. `--ranks 3` splits over three
(a pipeline's middle rank, and ranks that hold only some kinds of layer). Writes `results.json` (every rank)
and `README.md` to `--out` (default `benchmarks/results/<UTC date>-split-variants/`). Exit status 1
when a case differs on either rank or hangs: where no case ends for `--case-timeout` seconds, the ranks
are stopped, the case is reported as hung and the sweep goes on past it in a new launch.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ["qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe", "gpt_oss", "minimax", "kimi_k25",
            "glm_moe_dsa"]
WIDTHS = (1, 4, 16, "auto")
PROMPT_LEN, MAX_TOKENS = 12, 14
NOT_RUN = "mlx-lm's own split model does not run"
REFUSED = "refused in one line"


def check_split(v, over, mode) -> str:
    """"exact", or the first width whose tokens part from the split model's greedy decode, and where."""
    from dflash_mlx.bench.metrics import first_mismatch
    from dflash_mlx.models.draft.checkpoints import random_draft
    from dflash_mlx.models.sharded import split
    from dflash_mlx.models.target.adapter import Target, UnsupportedTargetError
    from dflash_mlx.models.target.probe import error_line
    from dflash_mlx.policy.sizer import forget_sizers
    from dflash_mlx.testing import variants
    from dflash_mlx.testing.targets import ScriptedDraft, clean_case
    from dflash_mlx.engine.batch_caches import batch_support
    from dflash_mlx.testing import variant_check
    from dflash_mlx.testing.variant_check import _decode

    model = variants.build(v.key, v.config(over), 0)
    try:
        split(model, mode)
    except Exception as e:  # (one KV head cannot be split in two): nothing to compare with
        return f"{NOT_RUN}: {error_line(e)}"[:200]
    try:
        target = Target(model)  # (built on every rank together: its construction agrees over the split)
    except UnsupportedTargetError as refusal:
        try:  # where mlx-lm's own split model runs, a refusal is worth a look; where it does not, it is why
            clean_case(model, PROMPT_LEN, MAX_TOKENS, seed=1)
        except Exception as e:
            return f"{NOT_RUN}: {error_line(e)}"[:200]
        return f"{REFUSED}: {refusal}"[:200]
    try:  # the split model's own greedy decode, with the caches of each rank's own layers (`make_cache`)
        prompt, ref = clean_case(model, PROMPT_LEN, MAX_TOKENS, seed=1, make_cache=target.make_cache)
    except Exception as e:
        return f"{NOT_RUN}: {error_line(e)}"[:200]
    n = target.num_layers
    taps = sorted({0, n // 2, n - 1})
    for width in WIDTHS:
        forget_sizers()
        if width in (1, 16):
            draft = random_draft(model, num_layers=1, block_size=16, seed=3, target_layer_ids=taps)
            out = _decode(model, draft, prompt, len(ref), block_size=1 if width == 1 else "draft")
        else:
            rng = random.Random(7)
            right = [rng.randrange(0, 16) for _ in range(100)]
            draft = ScriptedDraft(Target(model), prompt + ref, lambda c: right[c],
                                  block_size=16 if width == "auto" else width, layer_ids="every")
            out = _decode(model, draft, prompt, len(ref), block_size="auto" if width == "auto" else "draft")
        if out != ref:
            i = first_mismatch(out, ref)
            return f"width {width}: first difference at token {i} of {len(ref)}"
    if batch_support(target) is None:  # three rows of different lengths in one batch, at width 4
        wrong = variant_check._batches(model, 5)
        if wrong is not None:
            return wrong
    return "exact"


def _cases(families):
    """Every (variant, config overrides, split mode) to run, in the same order on every rank."""
    from dflash_mlx.models.sharded import modes_of
    from dflash_mlx.testing import combined_variants, variant_check, variants

    bases = [variants.Variant(f, "base", {}) for f in families]  # each family's own tiny config too
    for v in bases + variants.all_variants(families) + combined_variants.all_combined(families):
        model, over, error = variant_check._built(v, 0)
        if model is None:
            continue
        tensor, pipeline = modes_of(model)
        for mode in [m for m, ok in (("tensor", tensor), ("pipeline", pipeline)) if ok]:
            yield v, over, mode


def _fuzz_cases(families, fuzz: int, seed: int):
    """(name, what it drew, check) of `fuzz` option-fuzz cases (`option_fuzz.split_case`), seeds from
    `seed`; what a case drew is known once it has run (`drawn`)."""
    from dflash_mlx.testing import option_fuzz

    def check(case_seed, drawn):
        row = option_fuzz.split_case(case_seed, families)
        drawn.append(f"{row['key']}/{row['mode']}, {row['options']}, prompt {row['prompt_len']}, "
                     f"{row['max_tokens']} tokens, draft {row['draft']}" + (", two turns" if row["turns"] else ""))
        if row["status"] == "no split":
            return f"{NOT_RUN}: mlx-lm gives it no split"
        if row["status"] == "not run":  # (mlx-lm's own split raised)
            return f"{NOT_RUN}: {row['reason']}"[:200]
        if row["status"] == "refused":
            return f"{REFUSED}: {row['reason']}"[:200]
        return "exact" if row["status"] == "exact" else f"{row['status']}: {row['reason'].strip().splitlines()[-1]}"[:300]

    for case_seed in range(seed, seed + fuzz):
        drawn = []
        yield f"fuzz/{case_seed}", drawn, lambda case_seed=case_seed, drawn=drawn: check(case_seed, drawn)


def rank_main(out_dir: str, families, fuzz: int = 0, seed: int = 0):
    """Run every case this rank's log (`rank<r>.jsonl`) has not ended; each is logged as it starts and
    as it ends, so that a launch stopped mid-case (a hang) can be resumed past it. `fuzz`: that many
    option-fuzz cases instead of the variants."""
    import dflash_mlx  # noqa: F401  (before mlx.core)
    import mlx.core as mx

    from dflash_mlx.models.target.probe import error_line
    from dflash_mlx.testing import variants

    rank = mx.distributed.init().rank()
    path = os.path.join(out_dir, f"rank{rank}.jsonl")
    ended = set(_read_log(path)[0]) if os.path.exists(path) else set()
    cases = _fuzz_cases(families, fuzz, seed) if fuzz else (
        (f"{v.name}/{mode}", variants.Variant(v.key, v.kind, over).option(),
         lambda v=v, over=over, mode=mode: check_split(v, over, mode)) for v, over, mode in _cases(families))
    with open(path, "a") as log:
        for index, (name, option, check) in enumerate(cases):
            if name in ended:
                continue
            log.write(json.dumps({"start": name, "index": index}) + "\n")
            log.flush()
            start = time.perf_counter()
            try:
                outcome = check()
            except Exception as e:  # failing where mlx-lm's split model runs: as wrong as a wrong token
                outcome = f"raised {error_line(e)}"[:200]
            option = option if isinstance(option, str) else "".join(option)  # (a fuzz case's: what it drew)
            log.write(json.dumps({"name": name, "option": option,
                                  "outcome": outcome, "seconds": round(time.perf_counter() - start, 2)}) + "\n")
            log.flush()
            if rank == 0:
                print(f"{name}: {outcome}", file=sys.stderr, flush=True)


def _read_log(path):
    """({case name: result} of the cases ended, (its place in the case list, name) of a case
    started and not ended, or None)."""
    done, open_case = {}, None
    with open(path) as f:
        for line in f:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a line the stopped launch left half-written
                continue
            if "start" in entry:
                open_case = (entry["index"], entry["start"])
            else:
                done[entry["name"]] = {k: entry[k] for k in ("option", "outcome", "seconds")}
                open_case = None
    return done, open_case


def _read_logs(out, ranks):
    """Each rank's `_read_log` (empty where it has none yet)."""
    paths = [os.path.join(out, f"rank{r}.jsonl") for r in range(ranks)]
    return [_read_log(p) if os.path.exists(p) else ({}, None) for p in paths]


def _ends_a_line(path) -> bool:
    """Whether the file is empty or ends with a newline (a stopped launch may leave half a line)."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _launch_until_done(cmd, out, ranks, case_timeout):
    """Launch the ranks; where no rank's log grows for `case_timeout` seconds, stop them, count
    the open case as hung on every rank and launch again (each rank skips what its log ended)."""
    while True:
        proc = subprocess.Popen(cmd, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"), start_new_session=True)
        paths = [os.path.join(out, f"rank{r}.jsonl") for r in range(ranks)]
        last_size, last_change = None, time.monotonic()
        while proc.poll() is None:
            time.sleep(min(2.0, case_timeout / 4))
            size = tuple(os.path.getsize(p) if os.path.exists(p) else 0 for p in paths)
            if size != last_size:
                last_size, last_change = size, time.monotonic()
            elif time.monotonic() - last_change > case_timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
        else:
            if proc.returncode != 0:
                raise SystemExit(f"the {ranks}-rank launch failed (exit {proc.returncode}); see its output above")
            return
        # the case some rank is still in: the earliest open one (a rank that went on waits further on)
        opened = [case for _, case in _read_logs(out, ranks) if case is not None]
        if not opened:
            raise SystemExit("the ranks stopped making progress between cases; see their output above")
        name = min(opened)[1]
        for r in range(ranks):  # the hung case, on every rank, so that the report names it
            whole = not os.path.exists(paths[r]) or _ends_a_line(paths[r])
            with open(paths[r], "a") as log:
                log.write(("" if whole else "\n") + json.dumps({"name": name, "option": "", "seconds": case_timeout,
                                      "outcome": f"hung: no rank ended it within {case_timeout:g} s"}) + "\n")
        print(f"{name}: hung; launching again past it", file=sys.stderr, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--out", default="")
    ap.add_argument("--ranks", type=int, default=2, help="processes to split over (default 2)")
    ap.add_argument("--case-timeout", type=float, default=600,
                    help="seconds without a case ending before the ranks are stopped and the case counted hung")
    ap.add_argument("--fuzz", type=int, default=0,
                    help="run this many option-fuzz cases (`option_fuzz.split_case`) instead of the variants")
    ap.add_argument("--seed", type=int, default=0, help="the first fuzz case's seed")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # what mlx.launch runs
    args = ap.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    out = args.out or os.path.join(HERE, "results", datetime.now(timezone.utc).strftime("%Y%m%d") + "-split-variants")
    if args.rank:
        return rank_main(out, families, args.fuzz, args.seed)
    os.makedirs(out, exist_ok=True)
    from dflash_mlx.testing.ports import free_starting_port

    launcher = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    port = free_starting_port(ranks=args.ranks)
    if port is None:
        raise SystemExit(f"no {args.ranks} free consecutive ports on localhost")
    start = time.perf_counter()
    cmd = [launcher, "-n", str(args.ranks), "--backend", "ring", "--starting-port", str(port),
           "--python", sys.executable,
           os.path.abspath(__file__), "--rank", "--families", ",".join(families), "--out", out,
           "--fuzz", str(args.fuzz), "--seed", str(args.seed)]
    for r in range(args.ranks):  # logs of an earlier run into this folder
        if os.path.exists(os.path.join(out, f"rank{r}.jsonl")):
            os.remove(os.path.join(out, f"rank{r}.jsonl"))
    _launch_until_done(cmd, out, args.ranks, args.case_timeout)
    ranks = []
    for done, _ in _read_logs(out, args.ranks):
        ranks.append(done)
    for r in range(args.ranks):
        os.remove(os.path.join(out, f"rank{r}.jsonl"))
    elapsed = time.perf_counter() - start
    names = sorted(ranks[0])
    not_run = [n for n in names if all(r.get(n, {}).get("outcome", "").startswith(NOT_RUN) for r in ranks)]
    refused = [n for n in names if n not in not_run and all(r.get(n, {}).get("outcome", "").startswith(REFUSED)
                                                            for r in ranks)]
    bad = [n for n in names if n not in not_run + refused
           and any(r.get(n, {}).get("outcome") != "exact" for r in ranks)]
    checked = len(names) - len(not_run)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"schema": "dflash-mlx-split-variants/1", "command": " ".join(sys.argv),
                   "widths": [str(w) for w in WIDTHS], "prompt_len": PROMPT_LEN, "max_tokens": MAX_TOKENS,
                   "elapsed_s": round(elapsed, 1), "ranks": ranks}, f, indent=1)
    from dflash_mlx.cli.doctor import machine_line

    exact = checked - len(bad) - len(refused)
    what = "Option-fuzz cases" if args.fuzz else "Config variants"
    lines = [f"# {what} on {args.ranks} ranks: {exact} of {checked} exact"
             + (f", {len(refused)} refused in one line" if refused else "")
             + (f" ({len(not_run)} more that mlx-lm's own split model does not run)" if not_run else ""),
             "", f"Command: `{' '.join(sys.argv)}`; {elapsed / 60:.1f} min. Machine: {machine_line()}.", "",
             (f"Each case: a seed that draws a family of {', '.join(families)}, one of the splits mlx-lm gives it, a width, a "
              f"prefill chunk, stops, logprobs, copies, trees, split head, a draft (random, scripted or none) and "
              f"maybe a second turn on the prompt cache (`dflash_mlx.testing.option_fuzz.split_case`), split over "
              f"{args.ranks} ranks (`mlx.launch --backend ring`), against the split model's own greedy decode with "
              f"the same prefill chunks (float32, MLX CPU backend). Every rank must agree." if args.fuzz else
              f"Each case: a family's own tiny config or a variant of it (`dflash_mlx.testing.variants`, single options "
              f"and `combined`), "
              f"split over {args.ranks} ranks (`mlx.launch --backend ring`), DFlash at widths "
              f"{', '.join(map(str, WIDTHS))} against the split model's own greedy decode (mlx-lm's "
              f"`generate_step`; on a pipeline rank with the caches of its own layers, `Target.make_cache`; "
              f"{PROMPT_LEN}-token prompt, "
              f"{MAX_TOKENS} tokens, float32, MLX CPU backend). Every rank must agree."), "",
             "| case | config | " + " | ".join(f"rank {r}" for r in range(args.ranks)) + " |",
             "|---|---|" + "---|" * args.ranks]
    for n in names:
        lines.append(f"| `{n}` | `{ranks[0][n]['option']}` | "
                     + " | ".join(r.get(n, {}).get("outcome", "missing") for r in ranks) + " |")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{exact} of {checked} exact on every rank, {len(refused)} refused in one line ({len(not_run)} not run "
          f"by mlx-lm); report in {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
