"""`dflash-mlx bench`: DFlash against plain mlx-lm decoding on standard prompt suites.

Under `mlx.launch` with `--distributed`, every rank runs the same measurements on the split
target (each generation is a collective); rank 0 alone logs and writes the results.
"""

import argparse
import re
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from dflash_mlx.cli.common import (EXIT_USAGE, ArgumentParser, CLIError, add_distributed_arg, add_draft_bits_arg,
                                   add_model_load_args, checked_options, draft_for, launched, load_model_and_draft,
                                   model_load_kwargs, usage_error)
from dflash_mlx.options import GenerationOptions, add_generation_args, parse_block_size
from dflash_mlx.models.packaged import DEFAULT_MODEL

from dflash_mlx.bench.suites import SUITES, parse_suites


def _block_sizes(spec: str):
    """--block-sizes: a comma list of what --block-size takes, e.g. 4,8,16,auto."""
    try:
        sizes = [parse_block_size(x) for x in spec.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not sizes:
        raise argparse.ArgumentTypeError(f"no block sizes in {spec!r}")
    return sizes


def _int_list(spec: str):
    try:
        values = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of whole numbers, got {spec!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected a comma list of whole numbers >= 0, got {spec!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="dflash-mlx bench",
        description="Benchmark DFlash speculative decoding against plain decoding of the "
        "same target (mlx-lm stream_generate): tau, accept lengths, tok/s, speed-up, "
        "time split per cycle. Writes results.json, results.md and PNG plots.",
    )
    p.add_argument("--suite", default="gsm8k,humaneval,mtbench",
                   help=f"comma list of {', '.join(SUITES)}, or 'all' (default: %(default)s); "
                   "or 'depth' alone: long held-out documents at growing prompt lengths "
                   "(dflash_mlx/bench/depth.py; --limit = documents per depth, default 3; "
                   "--max-tokens default 32)")
    p.add_argument("--limit", type=int, default=10, help="prompts per suite (seeded subset)")
    add_generation_args(p, GenerationOptions(seed=0))
    p.add_argument("--block-sizes", type=_block_sizes, default=None,
                   help="sweep, e.g. 4,8,16 or 4,8,16,auto (overrides --block-size)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="packaged name | folder | .gguf | hub id")
    p.add_argument("--draft", default=None, help="DFlash draft: packaged name, folder or hub id "
                   "(default: the packaged draft of a packaged --model)")
    add_draft_bits_arg(p)
    add_model_load_args(p)
    add_distributed_arg(p)
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="weights dtype (default: the loader's, float32 on CPU)")
    p.add_argument("--out", default=None,
                   help="output folder (default: benchmarks/results/<date>-<model>)")
    p.add_argument("--data-dir", default=None, help="folder with the suite files")
    p.add_argument("--no-profile", action="store_true",
                   help="skip the profiled pass (no draft/verify/rollback split)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--depths", type=_int_list, default=None,
                   help="depth suite: prompt lengths, 0 = the context window less the answer "
                   "(default: 256,1024,2048,4096,0)")
    p.add_argument("--depth-widths", type=_int_list, default=None,
                   help="depth suite: fixed widths to compare the default width with (default: 2,4,8)")
    p.add_argument("--depth-repeats", type=int, default=1, metavar="N",
                   help="depth suite: decode runs per setting and document, speeds their median "
                   "(prefills are not repeated; default: 1)")
    p.add_argument("--compare-draft", action="append", default=[], metavar="LABEL=DRAFT",
                   help="depth suite: another draft run beside --draft at the default width "
                   "(before/after in one process); repeatable")
    p.add_argument("--resume", action="store_true",
                   help="depth suite: keep the records already in --out's results.json, measure the rest")
    p.add_argument("--from-json", metavar="RESULTS_JSON", default=None,
                   help="run nothing: rewrite results.md and the plots next to an existing "
                   "results.json (e.g. of an interrupted run)")
    p.add_argument("--forward-reps", type=int, default=5,
                   help="repetitions per direct forward timing (median is kept)")
    return p


def _command(argv) -> str:
    import os
    import shlex

    argv = list(sys.argv[1:] if argv is None else argv)
    env = " ".join(f"{k}={os.environ[k]}" for k in ("OPENBLAS_NUM_THREADS", "DFLASH_MLX_DTYPE")
                   if os.environ.get(k))
    return (env + " " if env else "") + shlex.join(["dflash-mlx", "bench", *argv])


def rerender(path: Path, with_plots: bool = True) -> int:
    import json

    from dflash_mlx.bench import report

    doc = json.loads(path.read_text())
    errors = report.validate(doc)
    if errors:
        print(f"{path}: not a benchmark result:\n  " + "\n  ".join(errors), file=sys.stderr)
        return 2
    paths = report.write_all(doc, path.parent, with_plots=with_plots, json_too=False)
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.from_json:
        return rerender(Path(args.from_json), with_plots=not args.no_plots) if launched(args.distributed) else 0
    if args.suite.strip() == "depth":
        return depth_main(args, argv)
    if "depth" in args.suite.split(","):
        raise usage_error("the depth suite runs alone: --suite depth")
    options = checked_options(args)
    try:
        suites = parse_suites(args.suite)
    except ValueError as e:
        raise usage_error(e) from None
    if args.limit is not None and args.limit < 1:
        raise CLIError(f"--limit must be at least 1, got {args.limit}", EXIT_USAGE)
    draft_name = None if args.draft_model is not None else draft_for(args.model, args.draft)
    blocks = args.block_sizes or [options.block_size]
    out = args.out or str(
        Path("benchmarks") / "results" / (
            datetime.now(timezone.utc).strftime("%Y%m%d-%H%M") + "-"
            + re.sub(r"[^A-Za-z0-9._-]+", "_", Path(args.model).name)))

    from dflash_mlx.bench import report, runner

    speaks = launched(args.distributed)  # rank 0 (or the only process) logs and writes
    log = runner._log if speaks else _quiet
    log(f"loading {args.model} and draft {draft_name}")
    model, tokenizer, draft, label = load_model_and_draft(args.model, draft_name, dtype=args.dtype,
                                                          draft_bits=args.draft_bits, distributed=args.distributed,
                                                          **model_load_kwargs(args))
    cfg = runner.BenchConfig(
        suites=suites, limit=args.limit, max_tokens=options.max_tokens, block_sizes=blocks,
        temperature=options.temperature, top_p=options.top_p, top_k=options.top_k,
        min_p=options.min_p, draft_sampling=options.draft_sampling, seed=options.seed,
        penalties=options.penalties(), warmup=not args.no_warmup,
        profile=not args.no_profile, forward_reps=args.forward_reps,
        model=args.model, draft=label if args.draft_bits is not None or args.draft_model else draft_name,
        data_dir=args.data_dir,
        command=_command(argv),
    )
    out_dir = Path(out)
    if speaks:
        out_dir.mkdir(parents=True, exist_ok=True)
    # The JSON is rewritten after every prompt, so a long run that is stopped
    # still leaves its measurements behind.
    doc = runner.run(model, draft, tokenizer, cfg, log=log,
                     on_prompt=(lambda d: report.write_json(d, out_dir / "results.json")) if speaks else None)
    mismatches = sum(s["mismatches"] for per in doc["summary"].values() for k, s in per.items()
                     if k == "all")
    if not speaks:
        return 1 if mismatches else 0
    errors = report.validate(doc)
    if errors:  # a bug in this package, but the measurements are still worth keeping
        print("result schema errors:\n  " + "\n  ".join(errors), file=sys.stderr)
    paths = report.write_all(doc, out_dir, with_plots=not args.no_plots)
    print(report.markdown(doc).split("## Per prompt")[0])
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 1 if mismatches or errors else 0


def _quiet(msg: str):
    """The log of a rank other than 0: rank 0 reports."""


def depth_main(args, argv) -> int:
    """`--suite depth`: the depth benchmark (dflash_mlx/bench/depth.py)."""
    from dflash_mlx.bench import depth, depth_report, depth_summary

    raw = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--max-tokens" or a.startswith("--max-tokens=") for a in raw):
        args.max_tokens = depth.DepthConfig.max_tokens
    if not any(a == "--limit" or a.startswith("--limit=") for a in raw):
        args.limit = depth.DepthConfig.documents
    options = checked_options(args)
    if options.penalties():
        raise CLIError("the depth suite measures the draft's acceptance by depth, without penalties: leave "
                       "--repetition-penalty, --presence-penalty and --frequency-penalty out", EXIT_USAGE)
    if args.limit < 1:
        raise CLIError(f"--limit must be at least 1, got {args.limit}", EXIT_USAGE)
    if args.depth_repeats < 1:
        raise CLIError(f"--depth-repeats must be at least 1, got {args.depth_repeats}", EXIT_USAGE)
    if args.draft_model is not None:
        raise CLIError("the depth suite measures a DFlash draft's acceptance by depth: pass --draft, not "
                       "--draft-model", EXIT_USAGE)
    draft_name = draft_for(args.model, args.draft)
    if draft_name is None:
        raise CLIError("the depth suite needs a draft: pass --draft", EXIT_USAGE)
    cfg = depth.DepthConfig(
        depths=args.depths or list(depth.DEFAULT_DEPTHS), documents=args.limit,
        max_tokens=options.max_tokens, widths=[2, 4, 8] if args.depth_widths is None else
        [w for w in args.depth_widths if w > 0],
        compare=dict(c.split("=", 1) if "=" in c else (c, c) for c in args.compare_draft),
        repeats=args.depth_repeats, warmup=not args.no_warmup, model=args.model, draft=draft_name,
        command=_command(argv))
    out = Path(args.out or Path("benchmarks") / "results" / (
        datetime.now(timezone.utc).strftime("%Y%m%d") + "-depth-"
        + re.sub(r"[^A-Za-z0-9._-]+", "_", Path(draft_name).name)))
    speaks = launched(args.distributed)  # rank 0 (or the only process) logs and writes
    if speaks:
        print(f"loading {args.model} and draft {draft_name}", file=sys.stderr)
    model, tokenizer, draft, _ = load_model_and_draft(args.model, draft_name, dtype=args.dtype,
                                                      draft_bits=args.draft_bits, distributed=args.distributed,
                                                      **model_load_kwargs(args))
    from dflash_mlx import load_draft
    from dflash_mlx.models.sharded import share

    others = {label: load_draft(name, model, quiet=True) for label, name in cfg.compare.items()}
    previous = None
    if args.resume and speaks:
        import json

        path = out / "results.json"
        previous = json.loads(path.read_text()) if path.exists() else None
        keep = depth_summary.MEASURED_WITH
        if previous and any(k in previous["config"] and previous["config"][k] != asdict(cfg).get(k) for k in keep):
            raise CLIError(f"--resume: {path} was measured with other settings ({', '.join(keep)}); "
                           "give the same ones or another --out", EXIT_USAGE)
    if args.distributed:
        previous = share(previous)  # every rank resumes where rank 0's file says
    try:
        doc = depth.run(model, draft, tokenizer, cfg, others=others, resume=previous,
                        on_record=(lambda d: depth_report.write_all(d, out, with_plot=False)) if speaks else None,
                        log=depth._log if speaks else _quiet)
    except ValueError as e:
        raise CLIError(str(e), EXIT_USAGE) from None
    if not speaks:
        return 1 if depth_summary.mismatches(doc) else 0
    paths = depth_report.write_all(doc, out, with_plot=not args.no_plots)
    print(depth_report.markdown(doc).split("## Per document")[0])
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 1 if depth_summary.mismatches(doc) else 0


if __name__ == "__main__":
    sys.exit(main())
