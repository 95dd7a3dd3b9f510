"""Training is deterministic, checkpoints are atomic, and --resume continues exactly."""

import json

import dflash_mlx  # noqa: F401
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import tiny_target
from dflash_mlx.train.features import FeatureSource
from dflash_mlx.train.checkpoint import CHECKPOINT
from dflash_mlx.train.config import TrainConfig
from dflash_mlx.train.split import split_records
from dflash_mlx.train.trainer import Trainer


def _records(n=12, seed=0):
    rng = np.random.default_rng(seed)
    return [{"id": f"r{i}", "prompt": rng.integers(0, 256, 6).tolist(),
             "response": rng.integers(0, 256, int(rng.integers(3, 30))).tolist()} for i in range(n)]


def _trainer(run_dir, target, records, steps=6):
    draft = random_draft(target, num_layers=1, block_size=4, seed=5)
    draft.set_vocab(mx.arange(0, 280, dtype=mx.int32))
    cfg = TrainConfig(steps=steps, batch_tokens=32, blocks_per_seq=4, lr=1e-3, eval_every=0,
                      log_every=1, checkpoint_every=1e9)
    train, held = split_records(records, 2)
    feats = FeatureSource(target, draft.config.target_layer_ids)
    return Trainer(draft, train, held, feats, cfg, run_dir, log=lambda s: None)


def _params(t):
    return {k: np.array(v) for k, v in tree_flatten(t.draft.parameters())}


def test_resume_after_kill_matches_uninterrupted_run(tmp_path):
    model, _ = tiny_target("qwen3")
    target = Target(model)
    recs = _records()

    full = _trainer(tmp_path / "full", target, recs)
    full.train()

    first = _trainer(tmp_path / "killed", target, recs)
    first.train(stop_after=3)  # saves a checkpoint at step 3, then the process "dies"
    del first
    resumed = _trainer(tmp_path / "killed", target, recs)
    assert resumed.resume()
    assert resumed.step == 3
    # the next step is the one the uninterrupted run took
    np.testing.assert_array_equal(np.array(resumed.batch(3).anchors), np.array(full.batch(3).anchors))
    resumed.train()
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
    assert resumed.tokens == full.tokens
    a, b = _params(full), _params(resumed)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_checkpoint_is_atomic_and_complete(tmp_path):
    model, _ = tiny_target("llama")
    t = _trainer(tmp_path, Target(model), _records(), steps=2)
    t.train()
    ck = tmp_path / CHECKPOINT
    assert sorted(p.name for p in ck.iterdir()) == [
        "draft.safetensors", "optimizer.safetensors", "state.json", "vocab.safetensors"]
    assert not list(tmp_path.glob(".tmp-ckpt-*"))
    state = json.loads((ck / "state.json").read_text())
    assert state["step"] == 2 and len(state["history"]) == 2
    # a leftover temp folder from a kill mid-write is ignored by resume
    (tmp_path / ".tmp-ckpt-dead").mkdir()
    t2 = _trainer(tmp_path, Target(model), _records(), steps=2)
    assert t2.resume() and t2.step == 2
    # the learning rate schedule continues from the restored optimizer step
    assert t2.optimizer.step.item() == 2


def test_batches_are_a_function_of_seed_and_step(tmp_path):
    model, _ = tiny_target("llama")
    target = Target(model)
    t1 = _trainer(tmp_path / "a", target, _records())
    t2 = _trainer(tmp_path / "b", target, _records())
    for s in (0, 5, 17):  # 17 is past one epoch
        b1, b2 = t1.batch(s), t2.batch(s)
        np.testing.assert_array_equal(np.array(b1.anchors), np.array(b2.anchors))
        np.testing.assert_array_equal(np.array(b1.block_ids), np.array(b2.block_ids))
    assert not np.array_equal(np.array(t1.batch(0).block_ids), np.array(t1.batch(1).block_ids))


def test_stop_request_checkpoints_between_steps(tmp_path):
    model, _ = tiny_target("llama")
    t = _trainer(tmp_path, Target(model), _records(), steps=6)
    orig = t.train_step

    def step_then_signal(batch):
        out = orig(batch)
        if t.step == 1:  # "SIGTERM" arrives during the third step
            t.stop_requested = True
        return out

    t.train_step = step_then_signal
    t.train()
    state = json.loads((tmp_path / CHECKPOINT / "state.json").read_text())
    assert t.step == 2 and state["step"] == 2


_KILLED_RUN = r"""
import sys, time
sys.path.insert(0, {tests!r})
import test_train_resume as T
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import tiny_target
model, _ = tiny_target("qwen3")
t = T._trainer({run!r}, Target(model), T._records(), steps=40)
t.cfg.checkpoint_every = 0.0  # checkpoint after every step
orig = t.train_step
def slow(batch):
    time.sleep(0.05)
    return orig(batch)
t.train_step = slow
t.train()
"""


def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
    """A real process, killed with SIGKILL mid-run, resumes onto the uninterrupted trajectory."""
    import os
    import signal
    import subprocess
    import sys
    import time

    model, _ = tiny_target("qwen3")
    target = Target(model)
    full = _trainer(tmp_path / "full", target, _records(), steps=40)
    full.train()

    run = tmp_path / "killed"
    code = _KILLED_RUN.format(tests=os.path.dirname(__file__), run=str(run))
    proc = subprocess.Popen([sys.executable, "-c", code])
    state = run / CHECKPOINT / "state.json"
    t0 = time.time()
    while time.time() - t0 < 120:
        try:
            if json.loads(state.read_text())["step"] >= 5:
                break
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    resumed = _trainer(run, target, _records(), steps=40)
    assert resumed.resume()
    killed_at = resumed.step
    assert 5 <= killed_at < 40
    resumed.train()
    assert resumed.tokens == full.tokens
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
    a, b = _params(full), _params(resumed)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
