"""`dflash-mlx train`: data generation, training and export in one resumable command.

    dflash-mlx train --target smollm2-135m --out drafts/smollm2

Everything lives in a run folder (default `<out>.run`): the target's responses
(token ids), the fp16 feature cache, checkpoints, snapshots and the curve.
Generation always skips prompts already answered; `--resume` continues training
from the run's checkpoint. The defaults (45 min of generation, then at most
60 min or 1000 steps of training) fit about two hours on a 2-core CPU; on a
faster machine raise --gen-minutes/--minutes/--steps and --batch-tokens.

The stages, in order: where the draft starts (train/run_draft.py), the data
(train/run_data.py), the draft itself, training (train/run.py), the export
(train/export.py); the flags are in train/options.py.
"""

import sys

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)
from dflash_mlx.train.options import build_parser


def load_target(spec: str):
    """(model, tokenizer) for a target spec; uses dflash_mlx.load."""
    from dflash_mlx import load

    out = load(spec)
    return out[0], out[1]


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--export-for" or a.startswith("--export-for=") for a in argv):
        # data + settings for a GPU trainer (speculators, SpecForge): dflash_mlx/train/export_for.py
        from dflash_mlx.train.export_for import main as export_for

        return export_for(argv, build_parser())
    args = build_parser().parse_args(argv)
    from dflash_mlx.train import run_data
    from dflash_mlx.train.export import export_run
    from dflash_mlx.train.run import open_run, overfit_check, train_leg
    from dflash_mlx.train.run_draft import build_draft, starting_point

    model, tokenizer = load_target(args.target)  # a bad target fails before anything is written
    run = open_run(args, model, tokenizer)
    start = starting_point(run)
    if args.data:
        run_data.merge_packed(args.data, run.responses, tokenizer, run.log)
    if args.pack:
        run_data.pack(run, args.pack)
        return 0
    if not args.skip_gen and not args.overfit:
        run_data.generate(run, start.layer_ids)
    records = run_data.read_run_records(run)
    draft = build_draft(run, start, records.train)
    if args.overfit:
        overfit_check(run, draft, records)
        return 0
    trainer = train_leg(run, draft, records)
    export_run(run, trainer, draft, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
