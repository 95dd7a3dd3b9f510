"""A bounded KV cache, as mlx-lm's `generate_step(max_kv_size=...)` keeps one.

mlx-lm's `make_prompt_cache(model, max_kv_size)` gives a model that makes no caches of its own a
`RotatingKVCache(max_kv_size, keep=4)` a layer (a model with `make_cache` keeps its own caches: the
argument is ignored there, here too). Plain decoding writes one token at a time into that window:
once full, a token overwrites the oldest entry after the first `keep`, so the step at position p
attends to the first 4 tokens and the last `max_kv_size - 4` up to p.

A forward of several tokens does not see that. mlx-lm concatenates them after the window's last
`max_kv_size - 1` entries and masks a plain sliding window of `max_kv_size` over the buffer, which
drops the 4 kept tokens from the second row on and lets a row see entries its one-token step would
have overwritten. A verify of w rows on mlx-lm's own window therefore gives other logits than w steps
of plain decoding as soon as the context passes `max_kv_size` (the answers part within tokens).

`StepsWindowCache` is mlx-lm's window with one change: the mask of a forward of several rows is the one
each row's own step would attend with (the kept tokens, and the last `max_kv_size - keep` entries up to
the row). The buffer, its trim and its one-token updates are mlx-lm's, so a verify's rollback is a
sliding window's (`rollback.rollback_rotating`). The prompt is not plain decoding's steps: mlx-lm runs it
in chunks of 2048 under its own mask, and so does the engine (`chunk_rows`, `engine.cycle.prefill_bounds`),
then the last prompt token alone, a step like the rest.

A model whose attention does not take its cache's mask is refused in one line (`check`: a probe on a
window of 8, a verify of 4 rows against 4 steps), as are split targets and a quantized KV cache beside it
(mlx-lm cannot quantize a rotating cache).
"""

import copy
from contextlib import contextmanager
from typing import Any, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from dflash_mlx.identity import IdentityMap
from dflash_mlx.models.target.rollback import UnsupportedTargetError, sub_caches

KEEP = 4  # the tokens mlx-lm's make_prompt_cache keeps at the front of a bounded cache

_CHECKED = IdentityMap()


class StepsWindowCache(RotatingKVCache):
    """mlx-lm's `RotatingKVCache(max_size, keep)`, whose mask for a forward of several rows is the one
    each row's one-token step would use (while `chunk_rows` is False; while True, mlx-lm's own)."""

    chunk_rows = False

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        if N == 1 or self.chunk_rows:
            return super().make_mask(N, window_size=window_size, return_array=return_array)
        # After the update the buffer is in temporal order: the kept tokens, then consecutive positions
        # (mlx-lm's `_update_concat` trims it to max_size - 1 entries before it appends the N rows).
        # Row i sits at buffer index `offset + i`; its step would see the kept entries and the last
        # max_size - keep entries up to itself (a one-token step's mask is None: the whole window).
        offset = min(self.max_size - 1, self.offset)
        rows = mx.arange(offset, offset + N)[:, None]  # [N, 1] buffer index of each row
        keys = mx.arange(offset + N)[None]  # [1, offset + N]
        return (keys <= rows) & ((keys < self.keep) | (keys > rows - (self.max_size - self.keep)))


def checked_max_kv_size(max_kv_size: Optional[int]) -> Optional[int]:
    """`max_kv_size` as given, or a ValueError naming what it takes (None: unbounded)."""
    if max_kv_size is None:
        return None
    if isinstance(max_kv_size, bool) or not isinstance(max_kv_size, int) or max_kv_size <= KEEP:
        raise ValueError(f"max_kv_size must be a whole number > {KEEP} (mlx-lm keeps the first {KEEP} tokens of "
                         f"a bounded cache), or None: unbounded; got {max_kv_size!r}")
    return max_kv_size


def bounds(model) -> bool:
    """Whether `max_kv_size` bounds `model`'s caches: mlx-lm's `make_prompt_cache` ignores it for a model
    that makes its own."""
    return not hasattr(model, "make_cache")


def make_window_cache(target, max_kv_size: Optional[int]) -> List[Any]:
    """The target's caches for `max_kv_size` as mlx-lm's `make_prompt_cache` makes them: a model that
    makes its own keeps them (mlx-lm ignores the bound there), any other a window a layer."""
    if max_kv_size is None or not bounds(target.model):
        return target.make_cache()
    return [StepsWindowCache(max_kv_size, keep=KEEP) for _ in target.model.layers]


def windowed(cache: Optional[List[Any]]) -> bool:
    """Whether some cache in `cache` is a bounded one (`StepsWindowCache`)."""
    return any(isinstance(s, StepsWindowCache) for c in cache or () for s in sub_caches(c))


@contextmanager
def chunk_rows(cache: List[Any]):
    """While open, forwards on `cache` mask prompt chunks as mlx-lm's prefill does."""
    windows = [s for c in cache for s in sub_caches(c) if isinstance(s, StepsWindowCache)]
    for w in windows:
        w.chunk_rows = True
    try:
        yield
    finally:
        for w in windows:
            w.chunk_rows = False


def check(target, quantized: bool = False):
    """Raises `UnsupportedTargetError` in one line where `target` cannot decode on a bounded cache
    exactly (`quantized`: with mlx-lm's quantized KV cache beside it); the probe runs once per model."""
    if not bounds(target.model):
        return  # (its own caches, as under mlx-lm: the bound changes nothing)
    if quantized:
        raise UnsupportedTargetError(f"max_kv_size: {target.name}: a bounded KV cache cannot be quantized (mlx-lm's "
                                     "kv_bits raises on its RotatingKVCache too): drop one of the two")
    found = _CHECKED.get((target.model,))
    if found is None:
        found = [_refusal(target)]
        _CHECKED.put((target.model,), found)
    if found[0] is not None:
        raise UnsupportedTargetError(f"max_kv_size: {target.name}: {found[0]}")


def _refusal(target) -> Optional[str]:
    if target.sharding is not None:
        return "a bounded KV cache is not supported on a target split over processes"
    # 12 tokens through a window of 8 (the kept 4 and 4 more): the last 4 as one verify under this
    # module's mask and under mlx-lm's, and as 4 steps. The first must be nearer the steps than the
    # second is (not equal: a verify's rows round differently, by much in bfloat16), and must differ
    # from it, or the model does not read its cache's mask at all.
    ids = mx.array([[(7 * i + 3) % target.vocab_size for i in range(12)]])
    try:
        stepped, steps = [StepsWindowCache(8, keep=KEEP) for _ in target.model.layers], []
        for i in range(12):
            if i == 8:  # (the window full: the verifies start from here)
                rows, theirs = copy.deepcopy(stepped), copy.deepcopy(stepped)
            steps.append(target.forward(ids[:, i : i + 1], stepped)[0])
        steps = target.logits(mx.concatenate(steps[8:], axis=1))
        ours = target.logits(target.forward(ids[:, 8:], rows)[0])
        with chunk_rows(theirs):
            mlx_lm_mask = target.logits(target.forward(ids[:, 8:], theirs)[0])
        gap, their_gap = (mx.abs(x - steps).max().item() for x in (ours, mlx_lm_mask))
    except Exception as e:
        line = " ".join(str(e).split())[:160]
        return f"its attention does not run on a bounded KV cache ({type(e).__name__}: {line})"
    if not gap < their_gap / 4:
        return ("its attention does not take its cache's masks (a verify past the window does not give plain "
                "decoding's steps): run it without max_kv_size")
    return None
