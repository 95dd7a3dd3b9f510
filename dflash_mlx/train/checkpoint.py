"""A run folder's checkpoint and weight snapshots, on disk.

The checkpoint (draft weights, AdamW state, vocabulary, the trainer's history as
state.json) is written to a temporary folder and renamed into place, so a kill
never leaves a torn checkpoint; a kill between the two renames leaves the previous
one as `checkpoint.old`, which `load_checkpoint` falls back to. Snapshots are
weights only, kept for the learning curve.
"""

import json
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from dflash_mlx.models.draft.config import DraftConfig
from dflash_mlx.models.draft.dflash import DFlashDraftModel

CHECKPOINT = "checkpoint"  # the latest full checkpoint (weights + optimizer + state)
SNAPSHOTS = "snapshots"  # weights-only copies kept for the learning curve


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


def save_checkpoint(run_dir: Path, draft: DFlashDraftModel, optimizer, state: Dict):
    """weights + optimizer + state, written to a temp folder and renamed into place."""
    final = run_dir / CHECKPOINT
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-ckpt-", dir=run_dir))
    try:
        mx.save_safetensors(str(tmp / "draft.safetensors"), dict(tree_flatten(draft.parameters())))
        opt = dict(tree_flatten(optimizer.state))
        mx.save_safetensors(str(tmp / "optimizer.safetensors"),
                            {k: v for k, v in opt.items() if isinstance(v, mx.array)})
        if draft.vocab_ids is not None:
            mx.save_safetensors(str(tmp / "vocab.safetensors"), {"token_ids": draft.vocab_ids})
        (tmp / "state.json").write_text(json.dumps(state))
        old = run_dir / (CHECKPOINT + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_snapshot(run_dir: Path, draft: DFlashDraftModel, step: int, tokens: int):
    d = run_dir / SNAPSHOTS
    d.mkdir(exist_ok=True)
    name = d / f"step{step:07d}.safetensors"
    tmp = d / f".tmp-{name.name}"
    mx.save_safetensors(str(tmp), dict(tree_flatten(draft.parameters())),
                        metadata={"step": str(step), "tokens": str(tokens)})
    tmp.replace(name)


def load_checkpoint(run_dir: Path, draft: DFlashDraftModel, optimizer) -> Optional[Dict]:
    """Load the latest checkpoint of `run_dir` into `draft` and `optimizer`; its state
    (step, history, ...), or None when there is none."""
    ck = run_dir / CHECKPOINT
    if not ck.exists() and (run_dir / (CHECKPOINT + ".old")).exists():
        ck = run_dir / (CHECKPOINT + ".old")  # killed between the two renames
    if not (ck / "state.json").exists():
        return None
    state = json.loads((ck / "state.json").read_text())
    draft.load_weights(list(mx.load(str(ck / "draft.safetensors")).items()))
    if (ck / "vocab.safetensors").exists():
        draft.set_vocab(mx.load(str(ck / "vocab.safetensors"))["token_ids"])
    opt = mx.load(str(ck / "optimizer.safetensors"))
    optimizer.state = tree_unflatten(list(opt.items()))
    return state


def adopt_moments(optimizer, checkpoint) -> int:
    """Start from another run's Adam moments where its parameters match these (a grown
    draft's old layers, fc, norms); the rest start at zero. Fresh moments make Adam's
    first steps (MLX's AdamW has no bias correction) move every weight by ~3x the lr,
    which undoes part of a trained draft. The step count stays this run's own: the lr
    schedule reads it. Returns how many tensors were adopted."""
    saved = mx.load(str(Path(checkpoint) / "optimizer.safetensors"))
    state = dict(tree_flatten(optimizer.state))
    adopted = 0
    for k, v in state.items():
        if k.endswith((".m", ".v")) and k in saved and tuple(saved[k].shape) == tuple(v.shape):
            state[k] = saved[k].astype(v.dtype)
            adopted += 1
    optimizer.state = tree_unflatten(list(state.items()))
    mx.eval(optimizer.state)
    return adopted
