"""Train a DFlash draft against a frozen target.

Each step takes a few target-generated sequences, picks K random anchors in
each response, and trains all K blocks [anchor, MASK x (B-1)] of a sequence in
one forward (`batch.make_batch`, `forward.py`, block-sparse mask). Target features
come from a `features.FeatureSource`: the on-disk fp16 cache the data generation
wrote, or recomputed with the frozen target when a record has none.

Determinism: the batch of step s depends only on (seed, s) (an epoch
permutation plus a per-step anchor RNG), so a run resumed from a checkpoint
takes exactly the steps an uninterrupted run would. Checkpoints (draft
weights, AdamW state, history) are atomic (`checkpoint.py`).
"""

import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from dflash_mlx.models.draft.dflash import DFlashDraftModel
from dflash_mlx.progress import eta_seconds, format_duration
from dflash_mlx.train.batch import Batch, make_batch
from dflash_mlx.train.checkpoint import adopt_moments, load_checkpoint, save_checkpoint, save_snapshot
from dflash_mlx.train.config import TrainConfig, decay_matrices, lr_schedule, make_optimizer
from dflash_mlx.train.forward import training_logits
from dflash_mlx.train.loss import block_loss, block_metrics, expected_tau, position_accuracy
from dflash_mlx.train.vocab import index_map


class Trainer:
    """Owns the draft, optimizer, data order and checkpoints of one run folder."""

    def __init__(
        self,
        draft: DFlashDraftModel,
        train_records: Sequence[dict],
        eval_records: Sequence[dict],
        features: Callable[[dict], np.ndarray],
        cfg: TrainConfig,
        run_dir,
        log: Optional[Callable[[str], None]] = None,
        feature_scale: Optional[np.ndarray] = None,
    ):
        self.draft = draft
        self.feature_scale = feature_scale
        self.train_records = list(train_records)
        self.eval_records = list(eval_records)
        self.features = features
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        B = draft.config.block_size
        self.seqs_per_step = max(1, cfg.batch_tokens // (cfg.blocks_per_seq * B))
        vocab = None if draft.vocab_ids is None else np.array(draft.vocab_ids)
        self.vocab_index = index_map(vocab, draft.config.vocab_size)
        # Decoupled weight decay is applied by hand to matrices only (config.decay_matrices).
        self.optimizer = make_optimizer(draft, cfg)
        self.step = 0
        self.tokens = 0  # supervised (mask-position) tokens seen
        self.elapsed = 0.0  # training seconds, summed over resumed runs
        self.history: List[Dict] = []
        self.evals: List[Dict] = []
        self.resumed_config: Optional[Dict] = None
        # One entry per `train` call: where it started and stopped, its schedule and data.
        self.legs: List[Dict] = []
        self._loss_and_grad = nn.value_and_grad(draft, self._loss)
        # Set from a signal handler: the loop stops between steps, checkpoints, returns.
        self.stop_requested = False
        # Data still being generated beside training: called every `refresh_every`
        # steps, returns new training records (the data order then follows the new set).
        self.refresh: Optional[Callable[[], List[dict]]] = None
        self.refresh_every = 0
        # Held-out deep records (train/depth_data.py), evaluated apart: their positions
        # and labels are another distribution than the short held-out records'.
        self.depth_eval_records: List[dict] = []

    # -- data order ---------------------------------------------------------

    def batch_records(self, step: int) -> List[dict]:
        """Records of step `step`: consecutive slices of a per-epoch seeded permutation."""
        n = len(self.train_records)
        out = []
        start = step * self.seqs_per_step
        for i in range(start, start + self.seqs_per_step):
            epoch, j = divmod(i, n)
            perm = np.random.default_rng([self.cfg.seed, epoch]).permutation(n)
            out.append(self.train_records[perm[j]])
        return out

    def batch(self, step: int) -> Batch:
        rng = np.random.default_rng([self.cfg.seed, 1_000_003, step])
        c = self.draft.config
        return make_batch(
            self.batch_records(step), self.features, rng, c.block_size, self.cfg.blocks_per_seq,
            c.mask_token_id, self.vocab_index, self.cfg.max_seq_len, self.feature_scale, self._teacher(),
            getattr(self.features, "labels", None),
        )

    def _teacher(self):
        return self.features.teacher if self.cfg.distill else None

    # -- one step -------------------------------------------------------------

    def _loss(self, model, batch: Batch):
        logits = training_logits(model, batch.features, batch.block_ids, batch.anchors,
                                 dropout=self.cfg.dropout)
        loss, _ = block_loss(logits, batch.labels, batch.valid, self.cfg.gamma,
                             batch.soft_ids, batch.soft_probs, self.cfg.distill)
        return loss, logits

    def train_step(self, batch: Batch):
        (loss, logits), grads = self._loss_and_grad(self.draft, batch)
        grads, gnorm = optim.clip_grad_norm(grads, self.cfg.grad_clip)
        lr = self.optimizer.learning_rate
        self.optimizer.update(self.draft, grads)
        if self.cfg.weight_decay:
            decay_matrices(self.draft, lr, self.cfg.weight_decay)
        corr, n, acc_sum, blocks = block_metrics(logits, batch.labels, batch.valid, batch.exists)
        mx.eval(self.draft.parameters(), self.optimizer.state, loss, gnorm, corr, n, acc_sum, blocks)
        return {
            "loss": loss.item(),
            "acc": corr.item() / max(n.item(), 1),
            "tau_hat": expected_tau(acc_sum.item(), blocks.item()),
            "gnorm": gnorm.item(),
            "supervised": int(n.item()),
        }

    def evaluate(self, records: Optional[Sequence[dict]] = None) -> Dict:
        """Held-out loss, accuracy and expected accept length (fixed anchors) on
        `records` (default: the held-out records)."""
        records = self.eval_records if records is None else list(records)
        if not records:
            return {}
        c = self.draft.config
        rng = np.random.default_rng([self.cfg.seed, 7])
        tot = {"loss": 0.0, "w": 0.0, "corr": 0, "n": 0, "acc": 0, "blocks": 0}
        pos_corr = np.zeros(c.block_size - 1)
        pos_n = np.zeros(c.block_size - 1)
        for i in range(0, len(records), self.seqs_per_step):
            b = make_batch(
                records[i : i + self.seqs_per_step], self.features, rng, c.block_size,
                self.cfg.blocks_per_seq, c.mask_token_id, self.vocab_index, self.cfg.max_seq_len,
                self.feature_scale, target_labels=getattr(self.features, "labels", None),
            )
            logits = training_logits(self.draft, b.features, b.block_ids, b.anchors)
            loss, w = block_loss(logits, b.labels, b.valid, self.cfg.gamma)
            corr, n, acc_sum, blocks = block_metrics(logits, b.labels, b.valid, b.exists)
            pc, pn = position_accuracy(logits, b.labels, b.valid, b.exists)
            mx.eval(loss, w, corr, n, acc_sum, blocks, pc, pn)
            pos_corr += np.array(pc)
            pos_n += np.array(pn)
            tot["loss"] += loss.item() * w.item()
            tot["w"] += w.item()
            tot["corr"] += corr.item()
            tot["n"] += n.item()
            tot["acc"] += acc_sum.item()
            tot["blocks"] += blocks.item()
        return {
            "step": self.step,
            "tokens": self.tokens,
            "val_loss": tot["loss"] / max(tot["w"], 1e-9),
            "val_acc": tot["corr"] / max(tot["n"], 1),
            "val_tau_hat": expected_tau(tot["acc"], tot["blocks"]),
            # top-1 accuracy of mask position k = 1..B-1 (each on its own, not conditional)
            "val_pos_acc": [round(float(x), 4) for x in pos_corr / np.maximum(pos_n, 1)],
        }

    # -- checkpoints ----------------------------------------------------------

    def state_dict(self) -> Dict:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "elapsed": self.elapsed,
            "config": asdict(self.cfg),
            "draft_config": self.draft.config.to_dict(),
            "history": self.history,
            "evals": self.evals,
            "legs": self.legs,
        }

    def save_checkpoint(self):
        save_checkpoint(self.run_dir, self.draft, self.optimizer, self.state_dict())

    def save_snapshot(self):
        save_snapshot(self.run_dir, self.draft, self.step, self.tokens)

    def resume(self) -> bool:
        """Continue from the latest checkpoint of run_dir (False: none there)."""
        state = load_checkpoint(self.run_dir, self.draft, self.optimizer)
        if state is None:
            return False
        self.step, self.tokens = state["step"], state["tokens"]
        self.elapsed = state.get("elapsed", 0.0)
        self.history, self.evals = state["history"], state["evals"]
        self.legs = state.get("legs", [])
        self.resumed_config = state.get("config")  # what the checkpoint was trained with
        mx.eval(self.draft.parameters(), self.optimizer.state)
        return True

    def _end_leg(self, leg: Dict, schedule, start_elapsed: float):
        leg.update(end_step=self.step, end_lr=float(schedule(mx.array(max(self.step - 1, 0))).item()),
                   end_records=len(self.train_records), minutes=(self.elapsed - start_elapsed) / 60)

    def adopt_moments(self, checkpoint) -> int:
        """Another run's Adam moments where its parameters match these (`checkpoint.adopt_moments`)."""
        return adopt_moments(self.optimizer, checkpoint)

    # -- loop -------------------------------------------------------------------

    def train(self, stop_after: Optional[int] = None, deadline: Optional[float] = None):
        """Run to cfg.steps (or `stop_after` more steps, or until `deadline`)."""
        cfg = self.cfg
        end = cfg.steps if stop_after is None else min(cfg.steps, self.step + stop_after)
        last_ck = time.perf_counter()
        t0 = time.perf_counter()
        start_elapsed, start_step = self.elapsed, self.step
        schedule = lr_schedule(cfg)
        leg = {"start_step": self.step, "schedule_steps": cfg.steps, "peak_lr": cfg.lr,
               "start_lr": float(schedule(mx.array(self.step)).item()), "start_records": len(self.train_records)}
        self.legs.append(leg)
        window = []
        while self.step < end:
            if deadline is not None and time.time() > deadline:
                self.log(f"deadline reached at step {self.step}")
                break
            if self.stop_requested:
                self.log(f"stop requested at step {self.step}")
                break
            if self.refresh is not None and self.refresh_every and self.step % self.refresh_every == 0:
                new = self.refresh()
                if new:
                    self.train_records.extend(new)
                    self.log(f"step {self.step}: +{len(new)} new records ({len(self.train_records)} in all)")
            m = self.train_step(self.batch(self.step))
            self.step += 1
            self.tokens += m["supervised"]
            self.elapsed = start_elapsed + time.perf_counter() - t0
            window.append(m)
            if self.step % cfg.log_every == 0 or self.step == end:
                rec = {
                    "step": self.step,
                    "tokens": self.tokens,
                    "loss": float(np.mean([w["loss"] for w in window])),
                    "acc": float(np.mean([w["acc"] for w in window])),
                    "tau_hat": float(np.mean([w["tau_hat"] for w in window])),
                    "lr": float(self.optimizer.learning_rate.item()),
                    "elapsed": self.elapsed,
                }
                window = []
                self.history.append(rec)
                eta = eta_seconds(self.step - start_step, end - start_step, time.perf_counter() - t0)
                self.log(
                    f"step {self.step}/{cfg.steps} [{'#' * int(20 * self.step / cfg.steps):<20}] "
                    f"loss {rec['loss']:.3f} acc {rec['acc']:.3f} tau^ {rec['tau_hat']:.2f} "
                    f"lr {rec['lr']:.2e} | {self.tokens / max(self.elapsed, 1e-9):.0f} tok/s | "
                    f"elapsed {format_duration(self.elapsed)} ETA {format_duration(eta)}"
                )
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                ev = self.evaluate()
                if ev:
                    self.log(
                        f"eval step {self.step}: loss {ev['val_loss']:.3f} acc {ev['val_acc']:.3f} "
                        f"tau^ {ev['val_tau_hat']:.2f}"
                    )
                    if self.depth_eval_records:
                        ev["depth"] = self.evaluate(self.depth_eval_records)
                        self.log(f"depth eval step {self.step}: loss {ev['depth']['val_loss']:.3f} "
                                 f"acc {ev['depth']['val_acc']:.3f} tau^ {ev['depth']['val_tau_hat']:.2f} "
                                 f"pos 1-4 {ev['depth']['val_pos_acc'][:4]}")
                    self.evals.append(ev)
            if cfg.snapshot_every and self.step % cfg.snapshot_every == 0:
                self.save_snapshot()
            if time.perf_counter() - last_ck > cfg.checkpoint_every:
                self._end_leg(leg, schedule, start_elapsed)
                self.save_checkpoint()
                last_ck = time.perf_counter()
        self._end_leg(leg, schedule, start_elapsed)
        self.save_checkpoint()
        return self.history
