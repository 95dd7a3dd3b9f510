"""One `dflash-mlx train` run: its folder on disk, and its training stage.

Everything a run keeps lives in its folder (default `<out>.run`): the target's
responses (token ids), the fp16 feature cache, the draft's config, feature scale
and vocabulary, checkpoints, snapshots, the log and the curve. The training stage
is either the overfit check (a throwaway trainer on N records) or one resumable leg:
`--resume` continues from the run's checkpoint, SIGTERM finishes the step,
checkpoints and goes on to the export.
"""

import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

from dflash_mlx.models.target.adapter import Target
from dflash_mlx.train.checkpoint import CHECKPOINT
from dflash_mlx.train.config import TrainConfig
from dflash_mlx.train.run_data import Records, follow_responses
from dflash_mlx.train.run_draft import Draft
from dflash_mlx.train.trainer import Trainer
from dflash_mlx.train.vocab import index_map


@dataclass
class Run:
    """The flags, target and folder of one `dflash-mlx train` call, and its log."""

    args: object  # the parsed flags (train/options.py)
    model: object
    tokenizer: object
    target: Target
    out: Path  # the exported draft
    dir: Path  # the run folder
    log: Callable[[str], None]  # stderr and <run>/train.log

    @property
    def responses(self) -> Path:
        return self.dir / "responses.jsonl"

    @property
    def feature_dir(self) -> Optional[Path]:
        return None if self.args.no_feature_cache else self.dir / "features"

    @property
    def draft_config(self) -> Path:
        return self.dir / "draft_config.json"


def open_run(args, model, tokenizer) -> Run:
    """The run folder of `args` (made if new), its log appended to."""
    out = Path(args.out)
    folder = Path(args.run_dir or str(out) + ".run")
    folder.mkdir(parents=True, exist_ok=True)
    log_file = (folder / "train.log").open("a")

    def log(s):
        print(s, file=sys.stderr, flush=True)
        log_file.write(s + "\n")
        log_file.flush()

    return Run(args, model, tokenizer, Target(model), out, folder, log)


def train_config(args) -> TrainConfig:
    return TrainConfig(
        steps=args.steps, batch_tokens=args.batch_tokens, blocks_per_seq=args.blocks_per_seq, lr=args.lr,
        warmup=args.warmup, grad_clip=args.grad_clip, gamma=args.gamma, seed=args.seed,
        weight_decay=args.weight_decay, distill=args.distill, dropout=args.dropout,
        max_seq_len=args.max_seq_len,
        checkpoint_every=args.checkpoint_every,
        snapshot_every=args.snapshot_every, eval_every=0 if args.overfit else args.eval_every,
        log_every=args.log_every,
    )


def overfit_check(run: Run, draft: Draft, records: Records):
    """--overfit: train on the N records and report accuracy on those same records."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(draft.model, records.train, records.held, draft.features, train_config(run.args), tmp,
                          log=run.log, feature_scale=draft.scale)
        before = trainer.evaluate()
        trainer.train()
        after = trainer.evaluate()
    run.log(overfit_report(len(records.train), trainer.step, before, after))


def overfit_report(n_records: int, steps: int, before: dict, after: dict) -> str:
    """Per-position top-1 accuracy on the training sequences themselves, before and after."""
    lines = [f"overfit check: {n_records} sequences, {steps} steps",
             f"  loss {before['val_loss']:.3f} -> {after['val_loss']:.3f}   "
             f"top-1 {before['val_acc']:.3f} -> {after['val_acc']:.3f}   "
             f"tau^ {before['val_tau_hat']:.2f} -> {after['val_tau_hat']:.2f}",
             "  position  " + " ".join(f"{k:>5d}" for k in range(1, len(after["val_pos_acc"]) + 1)),
             "  before    " + " ".join(f"{a:5.2f}" for a in before["val_pos_acc"]),
             "  after     " + " ".join(f"{a:5.2f}" for a in after["val_pos_acc"])]
    return "\n".join(lines)


def train_leg(run: Run, draft: Draft, records: Records) -> Trainer:
    """One leg of training in the run folder (none with --export-only); the trainer after it."""
    args, log = run.args, run.log
    tcfg = train_config(args)
    trainer = Trainer(draft.model, records.train, records.held, draft.features, tcfg, run.dir, log=log,
                      feature_scale=draft.scale)
    trainer.depth_eval_records = records.depth_eval
    if args.resume and trainer.resume():
        log(f"resumed at step {trainer.step} ({trainer.tokens} supervised tokens)")
        if draft.vocab is not None:  # the run folder's vocabulary is the current one
            draft.model.set_vocab(mx.array(draft.vocab))
            trainer.vocab_index = index_map(draft.vocab, draft.config.vocab_size)
    elif draft.grown and args.grow_from:
        n = trainer.adopt_moments(Path(args.grow_from) / CHECKPOINT)
        log(f"Adam moments of {n} tensors taken from {args.grow_from} (new layers start at zero)")
    n_resp = sum(len(r["response"]) for r in records.all)
    log(f"{len(records.train)} training / {len(records.held)} held-out records, {n_resp} response tokens; "
        f"{trainer.seqs_per_step} sequences x {tcfg.blocks_per_seq} blocks per step")
    if args.follow_data:
        trainer.refresh, trainer.refresh_every = follow_responses(run, records), args.follow_data
    deadline = time.time() + 60 * args.minutes if args.minutes else None

    def stop(signum, frame):  # SIGTERM: finish the step, checkpoint, export
        trainer.stop_requested = True

    signal.signal(signal.SIGTERM, stop)
    if args.init_from and trainer.step == 0 and tcfg.eval_every:
        _evaluate_export(trainer, records.depth_eval, log)
    if not args.export_only:
        trainer.train(deadline=deadline)
    return trainer


def _evaluate_export(trainer: Trainer, depth_eval, log):
    """Where the exported draft starts (--init-from), short and deep: the curve's step 0."""
    ev = trainer.evaluate()
    if ev:
        if depth_eval:
            ev["depth"] = trainer.evaluate(depth_eval)
        trainer.evals.append(ev)
        log(f"eval step 0 (the exported draft): loss {ev['val_loss']:.3f} acc {ev['val_acc']:.3f} "
            f"tau^ {ev['val_tau_hat']:.2f} pos 1-4 {ev['val_pos_acc'][:4]}"
            + (f" | depth: loss {ev['depth']['val_loss']:.3f} acc {ev['depth']['val_acc']:.3f} "
               f"pos 1-4 {ev['depth']['val_pos_acc'][:4]}" if depth_eval else ""))
