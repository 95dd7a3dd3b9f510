"""The training recipe's settings, and the optimizer and learning-rate schedule they define.

AdamW runs without its own weight decay: decay is applied by hand, decoupled, to
weight matrices only (`decay_matrices`), since decaying norm weights pulls them
toward 0, not toward their resting value of 1.
"""

from dataclasses import dataclass

import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten


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


def make_optimizer(draft, cfg: TrainConfig) -> optim.AdamW:
    """AdamW on the schedule, its state initialised for `draft`'s trainable parameters."""
    optimizer = optim.AdamW(learning_rate=lr_schedule(cfg), weight_decay=0.0)
    optimizer.init(draft.trainable_parameters())
    return optimizer


def decay_matrices(draft, lr, weight_decay: float):
    """Decoupled weight decay at learning rate `lr`, on the weight matrices only."""
    decay = 1.0 - lr * weight_decay
    draft.update(tree_unflatten([
        (k, v * decay) for k, v in tree_flatten(draft.trainable_parameters()) if v.ndim >= 2
    ]))
