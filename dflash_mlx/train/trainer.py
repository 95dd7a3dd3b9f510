"""Train a DFlash draft against a frozen target.

Each step takes a few target-generated sequences, picks K random anchors in
each response, and trains all K blocks [anchor, MASK x (B-1)] of a sequence in
one forward (`forward.py`, block-sparse mask). Target features come from a
`features.FeatureSource`: the on-disk fp16 cache the data generation wrote, or
recomputed with the frozen target when a record has none.

Determinism: the batch of step s depends only on (seed, s) (an epoch
permutation plus a per-step anchor RNG), so a run resumed from a checkpoint
takes exactly the steps an uninterrupted run would. Checkpoints (draft
weights, AdamW state, history) are written to a temporary folder and renamed
into place, so a kill never leaves a torn checkpoint.
"""

import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from dflash_mlx.models.draft.dflash import DFlashDraftModel
from dflash_mlx.models.draft.config import DraftConfig
from dflash_mlx.progress import eta_seconds, format_duration
from dflash_mlx.train.forward import training_logits
from dflash_mlx.train.loss import block_loss, block_metrics, expected_tau, position_accuracy
from dflash_mlx.train.vocab import index_map

CHECKPOINT = "checkpoint"  # the latest full checkpoint (weights + optimizer + state)
SNAPSHOTS = "snapshots"  # weights-only copies kept for the learning curve


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_tokens: int = 2048  # block tokens per step (sequences x blocks x block size)
    blocks_per_seq: int = 8
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01  # matrices only: decaying norm weights pulls them toward 0, not 1
    grad_clip: float = 1.0
    gamma: float = 7.0
    # Self-distillation: loss = (1 - distill) * CE(target's token) + distill * CE(target's
    # top-k distribution); 0 trains on the target's tokens alone.
    distill: float = 0.0  # the teacher's top-k: FeatureSource(teacher_topk=...)
    dropout: float = 0.0  # training forward only (context and residual branches)
    seed: int = 0
    max_seq_len: int = 512
    checkpoint_every: float = 180.0  # seconds between checkpoints
    snapshot_every: int = 0  # steps between weight snapshots (0: none)
    eval_every: int = 100  # steps between held-out evaluations
    eval_records: int = 32
    log_every: int = 10


def lr_schedule(cfg: TrainConfig):
    warm = max(1, int(round(cfg.warmup * cfg.steps)))
    return optim.join_schedules(
        [
            optim.linear_schedule(cfg.lr / warm, cfg.lr, warm),
            optim.cosine_decay(cfg.lr, max(1, cfg.steps - warm), cfg.lr * cfg.min_lr_ratio),
        ],
        [warm],
    )


def split_records(records: Sequence[dict], n_eval: int):
    """Held-out records for evaluation: chosen by id hash, stable as data grows."""
    import hashlib

    def key(r):
        return hashlib.sha1(r["id"].encode()).hexdigest()

    ranked = sorted(records, key=key)
    held = {r["id"] for r in ranked[:n_eval]}
    return [r for r in records if r["id"] not in held], [r for r in records if r["id"] in held]


def split_by_hash(records: Sequence[dict], frac: float):
    """Held-out records by a fixed hash threshold: a record never changes side as data grows."""
    import hashlib

    def held(r):
        return int(hashlib.sha1(r["id"].encode()).hexdigest()[:8], 16) < frac * 2**32

    return [r for r in records if not held(r)], [r for r in records if held(r)]


def load_run_draft(run_dir, target) -> DFlashDraftModel:
    """The draft of run folder `run_dir`'s latest checkpoint (training-space weights: the
    feature scale is not folded into `fc`), bound to `target`."""
    run = Path(run_dir)
    cfg = DraftConfig.from_dict(json.loads((run / "draft_config.json").read_text()))
    draft = DFlashDraftModel(cfg)
    draft.bind(target)
    draft.load_weights(list(mx.load(str(run / CHECKPOINT / "draft.safetensors")).items()))
    if (run / CHECKPOINT / "vocab.safetensors").exists():
        draft.set_vocab(mx.load(str(run / CHECKPOINT / "vocab.safetensors"))["token_ids"])
    mx.eval(draft.parameters())
    return draft


@dataclass
class Batch:
    features: mx.array  # [N, S, n_tl*H]
    block_ids: mx.array  # [N, K*B]
    anchors: mx.array  # [N, K]
    labels: mx.array  # [N, K, B-1] draft-vocabulary indices
    valid: mx.array  # [N, K, B-1] label exists and is in the draft vocabulary
    exists: mx.array  # [N, K, B-1] label exists
    # The target's distribution at each label (distillation): its top-k tokens as
    # draft-vocabulary indices and their probabilities, renormalised over the top-k
    # tokens the draft vocabulary has (0 elsewhere). None without a teacher.
    soft_ids: Optional[mx.array] = None  # [N, K, B-1, k]
    soft_probs: Optional[mx.array] = None  # [N, K, B-1, k]

    @property
    def supervised(self) -> int:
        return int(self.exists.sum().item())


def make_batch(
    records: Sequence[dict],
    features: Callable[[dict], np.ndarray],
    rng: np.random.Generator,
    block_size: int,
    blocks_per_seq: int,
    mask_token_id: int,
    vocab_index: np.ndarray,
    max_seq_len: int = 512,
    feature_scale: Optional[np.ndarray] = None,
    teacher: Optional[Callable[[dict], tuple]] = None,
    target_labels: Optional[Callable[[dict], np.ndarray]] = None,
) -> Batch:
    """K random anchors in each record's response; blocks past the end are masked.
    `feature_scale` [n_tl*H] preconditions the features (folded into fc at export).
    `teacher(rec)` -> (ids [len-1, k], log-probs [len-1, k]): soft labels as well.
    Depth records (`train/depth_data.py`) may carry `spans` ([start, end) positions
    anchors are drawn from: the target's own responses in a chained conversation) and
    `target_labels` (labels are then `target_labels(rec)`, the target's argmax after
    each position, instead of the next token of the text)."""
    B, K = block_size, blocks_per_seq
    feats, blocks, anchors, labels, valid, exists = [], [], [], [], [], []
    soft_ids, soft_probs = [], []
    for rec in records:
        seq = (rec["prompt"] + rec["response"])[:max_seq_len]
        T = len(seq)
        P = min(len(rec["prompt"]), T - 2)
        cand = np.arange(P, T - 1)  # anchors need at least one label after them
        if rec.get("spans"):
            inside = np.zeros(T, dtype=bool)
            for a0, a1 in rec["spans"]:
                inside[max(a0, 0):min(a1, T)] = True
            cand = cand[inside[cand]]
        take = min(K, len(cand))
        a = np.sort(rng.choice(cand, size=take, replace=False)) if take else np.zeros(0, np.int64)
        a_ok = np.arange(K) < take
        a = np.concatenate([a, np.full(K - take, P, dtype=a.dtype)]).astype(np.int64)
        pos = a[:, None] + np.arange(1, B)[None]  # label positions [K, B-1]
        ex = (pos < T) & a_ok[:, None]
        seq_np = np.asarray(seq, dtype=np.int64)
        feats.append(np.asarray(features(rec))[: T - 1])  # first: the same forward may give the labels
        if rec.get("target_labels"):
            if target_labels is None:
                raise ValueError(f"record {rec['id']} is labelled by the target: pass target_labels")
            argmax = np.asarray(target_labels(rec), dtype=np.int64)  # [len-1]: token after position j
            lab_full = np.where(ex, argmax[np.minimum(pos - 1, len(argmax) - 1)], 0)
        else:
            lab_full = np.where(ex, seq_np[np.minimum(pos, T - 1)], 0)
        lab = vocab_index[lab_full]
        va = ex & (lab >= 0)
        blk = np.full((K, B), mask_token_id, dtype=np.int64)
        blk[:, 0] = seq_np[a]
        blocks.append(blk.reshape(-1))
        anchors.append(a)
        labels.append(np.maximum(lab, 0))
        valid.append(va)
        exists.append(ex)
        if teacher is not None:
            # row j of the teacher is the target's distribution of token j+1
            t_ids, t_logp = teacher(rec)
            rows = np.minimum(pos - 1, len(t_ids) - 1)
            ids = vocab_index[np.asarray(t_ids)[rows]]  # [K, B-1, k], -1: not in the draft vocabulary
            p = np.exp(np.asarray(t_logp, np.float32)[rows]) * (ids >= 0) * ex[..., None]
            p /= np.maximum(p.sum(-1, keepdims=True), 1e-9)
            soft_ids.append(np.maximum(ids, 0))
            soft_probs.append(p)
    S = max(f.shape[0] for f in feats)
    F = np.zeros((len(feats), S, feats[0].shape[1]), dtype=np.float32)
    for i, f in enumerate(feats):
        F[i, : f.shape[0]] = f
    if feature_scale is not None:
        F *= feature_scale[None, None, :]
    return Batch(
        mx.array(F),
        mx.array(np.stack(blocks).astype(np.int32)),
        mx.array(np.stack(anchors).astype(np.int32)),
        mx.array(np.stack(labels).astype(np.int32)),
        mx.array(np.stack(valid)),
        mx.array(np.stack(exists)),
        mx.array(np.stack(soft_ids).astype(np.int32)) if teacher is not None else None,
        mx.array(np.stack(soft_probs)) if teacher is not None else None,
    )


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
        # Decoupled weight decay is applied by hand to matrices only (see train_step).
        self.optimizer = optim.AdamW(learning_rate=lr_schedule(cfg), weight_decay=0.0)
        self.optimizer.init(draft.trainable_parameters())
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
            decay = 1.0 - lr * self.cfg.weight_decay
            self.draft.update(tree_unflatten([
                (k, v * decay) for k, v in tree_flatten(self.draft.trainable_parameters()) if v.ndim >= 2
            ]))
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
        """weights + optimizer + state, written to a temp folder and renamed into place."""
        final = self.run_dir / CHECKPOINT
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-ckpt-", dir=self.run_dir))
        try:
            mx.save_safetensors(str(tmp / "draft.safetensors"), dict(tree_flatten(self.draft.parameters())))
            opt = dict(tree_flatten(self.optimizer.state))
            mx.save_safetensors(str(tmp / "optimizer.safetensors"), {k: v for k, v in opt.items() if isinstance(v, mx.array)})
            if self.draft.vocab_ids is not None:
                mx.save_safetensors(str(tmp / "vocab.safetensors"), {"token_ids": self.draft.vocab_ids})
            (tmp / "state.json").write_text(json.dumps(self.state_dict()))
            old = self.run_dir / (CHECKPOINT + ".old")
            shutil.rmtree(old, ignore_errors=True)
            if final.exists():
                final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def save_snapshot(self):
        d = self.run_dir / SNAPSHOTS
        d.mkdir(exist_ok=True)
        name = d / f"step{self.step:07d}.safetensors"
        tmp = d / f".tmp-{name.name}"
        mx.save_safetensors(str(tmp), dict(tree_flatten(self.draft.parameters())),
                            metadata={"step": str(self.step), "tokens": str(self.tokens)})
        tmp.replace(name)

    def resume(self) -> bool:
        """Continue from the latest checkpoint of run_dir (False: none there)."""
        ck = self.run_dir / CHECKPOINT
        if not ck.exists() and (self.run_dir / (CHECKPOINT + ".old")).exists():
            ck = self.run_dir / (CHECKPOINT + ".old")  # killed between the two renames
        if not (ck / "state.json").exists():
            return False
        state = json.loads((ck / "state.json").read_text())
        self.draft.load_weights(list(mx.load(str(ck / "draft.safetensors")).items()))
        if (ck / "vocab.safetensors").exists():
            self.draft.set_vocab(mx.load(str(ck / "vocab.safetensors"))["token_ids"])
        opt = mx.load(str(ck / "optimizer.safetensors"))
        self.optimizer.state = tree_unflatten(list(opt.items()))
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
        """Start from another run's Adam moments where its parameters match these (a grown
        draft's old layers, fc, norms); the rest start at zero. Fresh moments make Adam's
        first steps (MLX's AdamW has no bias correction) move every weight by ~3x the lr,
        which undoes part of a trained draft. The step count stays this run's own: the lr
        schedule reads it. Returns how many tensors were adopted."""
        saved = mx.load(str(Path(checkpoint) / "optimizer.safetensors"))
        state = dict(tree_flatten(self.optimizer.state))
        adopted = 0
        for k, v in state.items():
            if k.endswith((".m", ".v")) and k in saved and tuple(saved[k].shape) == tuple(v.shape):
                state[k] = saved[k].astype(v.dtype)
                adopted += 1
        self.optimizer.state = tree_unflatten(list(state.items()))
        mx.eval(self.optimizer.state)
        return adopted

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


def plot_curves(state: Dict, path, tau_points: Optional[List[Dict]] = None):
    """Training curve PNG: loss/accuracy vs supervised tokens, held-out tau estimate
    (and engine-measured tau where given; the deep held-out records where evaluated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dflash_mlx.train.evaluate import tau_trend

    hist, evals = state.get("history", []), state.get("evals", [])
    trend = tau_trend(tau_points or [], min_tokens=200_000)
    fig, axes = plt.subplots(1, 4 if trend else 3, figsize=(20 if trend else 15, 4))
    if hist:
        t = [h["tokens"] for h in hist]
        axes[0].plot(t, [h["loss"] for h in hist], label="train", alpha=0.6)
        axes[1].plot(t, [h["acc"] for h in hist], label="train", alpha=0.6)
        axes[2].plot(t, [h["tau_hat"] for h in hist], label="train tau (estimate)", alpha=0.5)
    if evals:
        t = [e["tokens"] for e in evals]
        axes[0].plot(t, [e["val_loss"] for e in evals], "o-", label="held-out")
        axes[1].plot(t, [e["val_acc"] for e in evals], "o-", label="held-out")
        axes[2].plot(t, [e["val_tau_hat"] for e in evals], "o-", label="held-out tau (estimate)")
        deep = [e for e in evals if e.get("depth")]
        if deep:  # held-out deep records (--depth-data), another distribution: plotted apart
            t = [e["tokens"] for e in deep]
            for ax, key in zip(axes, ("val_loss", "val_acc", "val_tau_hat")):
                ax.plot(t, [e["depth"][key] for e in deep], "s--", label="held-out, deep")
        # The first steps' losses (tens of nats) would flatten the rest of the curve.
        top = 1.5 * max([e["val_loss"] for e in evals] + [e["depth"]["val_loss"] for e in deep])
        if top > 0:  # a held-out set with no label to score gives loss 0
            axes[0].set_ylim(0, top)
    if tau_points:
        axes[2].plot([p["tokens"] for p in tau_points], [p["tau"] for p in tau_points], "s-",
                     label="engine tau (greedy, B=16)")
    if trend:
        import numpy as np

        ax = axes[3]
        pts = [p for p in tau_points if p["tokens"] > 0]
        ax.semilogx([p["tokens"] for p in pts], [p["tau"] for p in pts], "s", base=2, label="engine tau")
        x = np.logspace(np.log2(pts[0]["tokens"]), np.log2(pts[-1]["tokens"]) + 7, 50, base=2)
        ax.plot(x, trend["intercept"] + trend["per_doubling"] * np.log2(x), "--",
                label=f"fit: {trend['per_doubling']:+.3f} tau per doubling")
        ax.axvline(pts[-1]["tokens"], color="grey", alpha=0.4)
    titles = ["weighted CE loss", "top-1 accuracy (mask positions)", "tau",
              "engine tau, log-linear trend (extrapolated 128x)"]
    drawn = [[ln.get_label() for ln in ax.get_lines()] for ax in axes]
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("supervised tokens")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return drawn  # the curves' labels, per panel
