"""Target outputs for training: features (and the target's argmax labels, and its top-k
distribution for self-distillation) of each record, from the on-disk cache the data
generation wrote or computed with the frozen target and cached, held in a memory bounded
in bytes (`FeatureSource`); `target_pass` runs long records in chunks with a KV cache.
Every file is written beside a temporary name and renamed into place (`save_atomic`)."""

import json
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from dflash_mlx.train.data import feature_file

class FeatureSource:
    """Target features of a record: the fp16 cache when present, else the frozen target.

    With `teacher_topk` > 0 it also gives the target's top-k next-token distribution
    (`teacher`, for self-distillation), from the same target forward as the features.
    """

    def __init__(self, target, layer_ids: Sequence[int], feature_dir=None, save_missing: bool = False,
                 teacher_topk: int = 0, memory_bytes: int = 256 << 20):
        self.target = target
        self.layer_ids = list(layer_ids)
        self.feature_dir = Path(feature_dir) if feature_dir else None
        self.save_missing = save_missing and self.feature_dir is not None
        self.teacher_topk = teacher_topk
        # What the target computed (features, teacher, labels), kept in memory, least recently
        # used first out, at most `memory_bytes` beyond the latest record, which always stays:
        # make_batch asks for a record's features and then its teacher or labels, one forward;
        # a small set trained on for many steps (the overfit check, a run without a feature
        # folder) runs the target once per record, not once per step.
        self.memory_bytes = memory_bytes
        self._memory: "OrderedDict[tuple, tuple]" = OrderedDict()
        self._memory_used = 0
        # A cache may hold more layers than this draft taps (`feature_layers.json`,
        # written by data generation): then this draft reads its columns of them.
        self.stored = self.layer_ids
        if self.feature_dir is not None and (self.feature_dir.parent / "feature_layers.json").exists():
            stored = json.loads((self.feature_dir.parent / "feature_layers.json").read_text())
            if set(self.layer_ids) <= set(stored):
                self.stored = list(stored)
        H = target.hidden_size
        self.columns = None
        if self.stored != self.layer_ids:
            self.columns = np.concatenate([np.arange(H) + H * self.stored.index(i) for i in self.layer_ids])

    def _select(self, f: np.ndarray) -> np.ndarray:
        return f if self.columns is None else f[:, self.columns]

    def _memory_key(self, rec: dict) -> tuple:
        return rec["id"], hash(tuple(rec["prompt"])), hash(tuple(rec["response"]))

    def _remembered(self, rec: dict):
        hit = self._memory.get(self._memory_key(rec))
        if hit is not None:
            self._memory.move_to_end(self._memory_key(rec))
        return hit

    def _remember(self, rec: dict, features: np.ndarray, teacher=None, labels=None) -> None:
        """Keep (features, teacher, labels) of `rec`; what an earlier forward gave stays."""
        key = self._memory_key(rec)
        old = self._memory.pop(key, None)
        if old is not None:
            self._memory_used -= old[3]
            teacher = teacher if teacher is not None else old[1]
            labels = labels if labels is not None else old[2]
        size = features.nbytes + (sum(a.nbytes for a in teacher) if teacher else 0)
        size += labels.nbytes if labels is not None else 0
        self._memory[key] = (features, teacher, labels, size)
        self._memory_used += size
        while self._memory_used > self.memory_bytes and len(self._memory) > 1:
            self._memory_used -= self._memory.popitem(last=False)[1][3]

    def __call__(self, rec: dict) -> np.ndarray:
        """[len-1, n_tl*H] features of positions 0..len-2 (float16 or float32)."""
        n = len(rec["prompt"]) + len(rec["response"]) - 1
        remembered = self._remembered(rec)
        if remembered is not None:
            return self._select(remembered[0])
        if self.feature_dir is not None:
            path = feature_file(self.feature_dir, rec["id"])
            if path.exists():
                f = np.load(path, mmap_mode="r")
                # a cache written for other taps has another width: recompute instead
                if f.shape[0] >= n and f.shape[1] == len(self.stored) * self.target.hidden_size:
                    return self._select(f[:n])
        return self._select(self._run_target(rec, save_features=True))

    def teacher(self, rec: dict):
        """The target's top-k next-token distribution at every position 0..len-2:
        (ids [len-1, k] int32, log-probs [len-1, k] float16), cached beside the features."""
        if not self.teacher_topk:
            raise ValueError("this FeatureSource was made without teacher_topk: no teacher distribution")
        n = len(rec["prompt"]) + len(rec["response"]) - 1
        remembered = self._remembered(rec)
        if remembered is not None and remembered[1] is not None:
            return remembered[1]
        if self.feature_dir is not None:
            path = teacher_file(self.feature_dir, rec["id"], self.teacher_topk)
            if path.exists():
                with np.load(path) as z:
                    if z["ids"].shape[0] >= n:
                        return z["ids"][:n], z["logp"][:n]
        cached = self.feature_dir is not None and feature_file(self.feature_dir, rec["id"]).exists()
        self._run_target(rec, save_features=not cached)
        teacher = self._remembered(rec)[1]
        if teacher is None:
            raise ValueError(f"record {rec['id']} is longer than {LONG_RECORD} tokens: its chunked target "
                             "forward gives no teacher distribution; train it without --distill")
        return teacher

    def labels(self, rec: dict) -> np.ndarray:
        """[len-1] int32: the target's own argmax after each position 0..len-2 (records
        with `target_labels`: text the target did not write, or wrote in another context),
        from the same forward as the features, cached beside them."""
        n = len(rec["prompt"]) + len(rec["response"]) - 1
        remembered = self._remembered(rec)
        if remembered is not None and remembered[2] is not None:
            return remembered[2]
        if self.feature_dir is not None:
            path = labels_file(self.feature_dir, rec["id"])
            if path.exists():
                lab = np.load(path)
                if lab.shape[0] >= n:
                    return lab[:n]
        cached = self.feature_dir is not None and feature_file(self.feature_dir, rec["id"]).exists()
        self._run_target(rec, save_features=not cached, with_labels=True)
        return self._remembered(rec)[2]

    def _run_target(self, rec: dict, save_features: bool, with_labels: bool = False) -> np.ndarray:
        """One target forward over the record: its features (returned) and, with a
        teacher, its top-k next-token log-probs (with `target_labels`, its argmax);
        saved when the source keeps what it computes."""
        seq = rec["prompt"] + rec["response"][:-1]
        with_labels = with_labels or bool(rec.get("target_labels"))
        if len(seq) > LONG_RECORD or with_labels:
            f, lab = target_pass(self.target, seq, self.stored, with_labels=with_labels)
            self._remember(rec, f, labels=lab)
            if with_labels and self.save_missing:
                save_npy(labels_file(self.feature_dir, rec["id"]), lab)
            if self.save_missing and save_features:
                save_npy(feature_file(self.feature_dir, rec["id"]), f)
            return f
        h, feats, _ = self.target.forward(mx.array([seq]), None, self.stored)
        f = np.array(feats[0].astype(mx.float16))
        k = self.teacher_topk
        teacher = None
        if k:
            logits = self.target.logits(h[0]).astype(mx.float32)
            top = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
            lp = mx.take_along_axis(logits, top, axis=-1) - mx.logsumexp(logits, axis=-1, keepdims=True)
            teacher = np.array(top.astype(mx.int32)), np.array(lp.astype(mx.float16))
        self._remember(rec, f, teacher)
        if self.save_missing:
            if save_features:
                save_npy(feature_file(self.feature_dir, rec["id"]), f)
            if teacher is not None:
                save_atomic(teacher_file(self.feature_dir, rec["id"], k),
                             lambda tmp: np.savez(tmp, ids=teacher[0], logp=teacher[1]))
        return f


# Longer records go through the target in chunks with a KV cache (one pass over
# 8k tokens would build 8k x 8k attention scores per head).
LONG_RECORD = 1024


def target_pass(target, seq: Sequence[int], layer_ids: Sequence[int], with_labels: bool = True,
                chunk: int = 512, cache=None):
    """Features [len, n_tl*H] (fp16) and the target's argmax after every position
    [len] (int32, or None) of one forward over `seq`, run in chunks with a KV cache
    (`cache`: one holding the tokens before `seq`, which it is extended by)."""
    cache = target.make_cache() if cache is None else cache
    feats, labels = [], []
    for start in range(0, len(seq), chunk):
        h, f, _ = target.forward(mx.array([list(seq[start:start + chunk])]), cache, layer_ids)
        out = [f[0].astype(mx.float16)]
        if with_labels:
            out.append(mx.argmax(target.logits(h[0]), axis=-1).astype(mx.int32))
        mx.eval(out, [c.state for c in cache])
        feats.append(np.array(out[0]))
        if with_labels:
            labels.append(np.array(out[1]))
    return np.concatenate(feats), (np.concatenate(labels) if with_labels else None)


def save_atomic(path: Path, write: Callable[[Path], None]):
    """`write(tmp)` beside `path`, then renamed into place: a killed run leaves no half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.tmp{path.suffix}")
    write(tmp)
    tmp.replace(path)


def save_npy(path: Path, a: np.ndarray):
    save_atomic(path, lambda tmp: np.save(tmp, a))


def labels_file(feature_dir, record_id: str) -> Path:
    """Where a record's cached target argmax labels live (beside its features)."""
    f = feature_file(feature_dir, record_id)
    return f.with_name(f"{f.stem}.argmax.npy")


def teacher_file(feature_dir, record_id: str, k: int) -> Path:
    """Where a record's cached top-k teacher distribution lives (beside its features)."""
    f = feature_file(feature_dir, record_id)
    return f.with_name(f"{f.stem}.top{k}.npz")
