"""Deterministic mode: every target row runs in the shapes plain decoding gives it.

On a GPU a 1-row decode and a k-row verify run different kernels (GEMV against GEMM,
quantized qmv against qmm, one-query attention against many-query attention), whose sums
round differently; in bfloat16, float16 or 4-bit the verify's argmax can then differ from
plain decoding's at a near-tie, and the caches it writes differ in their last bits, so a
later near-tie can flip too. Nothing short of the decode's own shapes is bit-identical to
it, so deterministic mode (`Target.deterministic`) runs:

  the prompt      as mlx-lm's `generate_step` does: all but its last token in chunks of
                  `MLX_LM_PREFILL_STEP`, then the last token alone (`engine.cycle.prefill_bounds`,
                  which runs the last token alone in every mode);
  a verify        as one-token forwards, one per row, each on the caches the previous one
                  left (`forward_rows`), queued as one graph: no host sync between rows;
  the LM head     row by row (`logits_rows`).

Every kernel then sees the shapes it sees in plain decoding, so greedy DFlash is plain
decoding token for token in every dtype, on every backend. The price is that a verify
costs its rows' decode steps (less the host syncs between them): on a GPU, where a wide
verify is nearly free, this mode gives that up for exactness. A rollback trims full KV caches
(quantized or not), puts every other attention cache (sliding windows, chunks) back and replays the kept rows'
updates, and puts any other state (recurrent layers' states, DeepSeek V4.1's compressed groups)
back as the last kept row left it (`RowsRecord`). Split targets, token trees and batches of rows
are refused (`refusal`, the engine): their verify has no plain-decoding twin here.
"""

from contextlib import contextmanager
from typing import Any, List, Optional, Tuple

import mlx.core as mx

from dflash_mlx.models.target.rerun import put_back

# mlx-lm's generate_step(prefill_step_size=...) default: plain decoding's prompt chunks.
MLX_LM_PREFILL_STEP = 2048


def refusal(target) -> Optional[str]:
    """Why `target` cannot run in deterministic mode, or None."""
    if target.sharding is not None:
        return f"{target.name} is split over processes: deterministic mode runs one process's decode shapes"
    return None


def _copied(value):
    """A cache attribute as it is now: arrays as new array objects (a one-token update may
    assign into the cache's own), lists and tuples of them copied."""
    if isinstance(value, mx.array):
        return value[...]
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


def _state(c) -> dict:
    return {k: _copied(v) for k, v in vars(c).items()}


class RowsRecord:
    """What rolls a deterministic verify's caches back to its first `keep` rows.

    A full KVCache trims. Any other attention cache (sliding windows: a full window's one-token
    update overwrites its oldest entry; chunked attention: its front is dropped as the rows go
    on) is put back as it was before the rows, and the calls that changed it are made again,
    in order, up to the last kept row's update: plain decoding's own steps. Any other cache
    (a recurrent layer's conv and SSM states, which each step replaces whole; DeepSeek V4.1's
    window and compressed groups) is kept as each row leaves it (`snapshot`, references: no
    copy of a state the step replaced) and put back as the last kept row left it."""

    CALLS = ("update_and_fetch", "maybe_trim_front")  # what the models call on a cache

    def __init__(self, cache: List[Any]):
        from mlx_lm.models.cache import KVCache, QuantizedKVCache

        from dflash_mlx.models.target.rollback import sub_caches

        subs = [c for entry in cache for c in sub_caches(entry)]
        full = (KVCache, QuantizedKVCache)  # (whose entries only grow: a trim takes rows back)
        self.trimmed = [c for c in subs if type(c) in full]
        # (a window's buffer is written in place: a state kept per row would copy it every row)
        self.replayed = [c for c in subs if type(c) not in full and hasattr(c, "update_and_fetch")]
        self.stateful = [c for c in subs if type(c) not in full and not hasattr(c, "update_and_fetch")]
        self.before = [_state(c) for c in self.replayed]
        self.states: List[List[dict]] = [[_state(c)] for c in self.stateful]  # [cache][rows run]
        self.calls: List[List[Tuple[str, tuple]]] = [[] for _ in self.replayed]

    def snapshot(self):
        """After each row: what it left in the caches that are put back whole."""
        for c, states in zip(self.stateful, self.states):
            states.append(_state(c))

    @contextmanager
    def recording(self):
        """The rows' calls on each cache are kept (instance attributes on the caches, removed after)."""
        for c, calls in zip(self.replayed, self.calls):
            for name in self.CALLS:
                if hasattr(c, name):
                    def call(*args, _own=getattr(c, name), _name=name, _calls=calls):
                        _calls.append((_name, args))
                        return _own(*args)

                    setattr(c, name, call)
        try:
            yield
        finally:
            for c in self.replayed:
                for name in self.CALLS:
                    vars(c).pop(name, None)

    def rollback(self, num_rows: int, keep: int):
        from dflash_mlx.models.target.rollback import rollback_cache

        for c in self.trimmed:
            rollback_cache(c, num_rows - keep)
        for c, states in zip(self.stateful, self.states):
            put_back(c, states[keep])
        for c, before, calls in zip(self.replayed, self.before, self.calls):
            put_back(c, before)
            updates = 0
            for name, args in calls:
                if updates == keep:
                    break
                getattr(c, name)(*args)
                updates += name == "update_and_fetch"


def forward_rows(one_forward, tokens: mx.array, cache: List[Any], num_layer_ids: int):
    """tokens [1, S] through `one_forward(tokens [1, 1]) -> (h, features, record)` one row
    at a time: (h [1, S, H], features [1, S, n*H] or None, the RowsRecord a rollback takes)."""
    record = RowsRecord(cache)
    hs, feats = [], []
    with record.recording():
        for i in range(tokens.shape[1]):
            h, f, _ = one_forward(tokens[:, i : i + 1])
            record.snapshot()
            hs.append(h)
            if f is not None:
                feats.append(f)
    h = mx.concatenate(hs, axis=1)
    return h, (mx.concatenate(feats, axis=1) if num_layer_ids and feats else None), record


def logits_rows(logits_of, h: mx.array) -> mx.array:
    """h [B, S, H] -> logits [B, S, V], each row through the LM head alone."""
    if h.ndim < 3 or h.shape[1] == 1:
        return logits_of(h)
    return mx.concatenate([logits_of(h[:, i : i + 1]) for i in range(h.shape[1])], axis=1)
