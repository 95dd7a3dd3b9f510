"""Sliding windows put back as they were before a discarded cycle (`models/target/windows.py`)."""

import dflash_mlx  # noqa: F401,I001  (before mlx.core: BLAS routing)
import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchRotatingKVCache, KVCache, RotatingKVCache

from dflash_mlx.models.target import windows
from dflash_mlx.models.target.rollback import in_temporal_order, rollback_batch_rows, rollback_rotating


def batch_window():
    """Two rows past a window of 8 (one left-padded), rotated by one-token steps."""
    c = BatchRotatingKVCache(8, [2, 0])
    k = mx.random.normal((2, 1, 10, 4), key=mx.random.key(0))
    c.update_and_fetch(k, k)
    for i in range(3):
        k = mx.random.normal((2, 1, 1, 4), key=mx.random.key(1 + i))
        c.update_and_fetch(k, k)
    return c


def state(c):
    fields = ("keys", "values", "offset", "left_padding") if isinstance(c, BatchRotatingKVCache) else ("keys", "values")
    arrays = {f: getattr(c, f) for f in fields if isinstance(getattr(c, f), mx.array)}
    mx.eval(list(arrays.values()))
    return ({f: a.tolist() for f, a in arrays.items()},
            {f: getattr(c, f) for f in ("_idx", "_offset", "rotated", "offset")
             if hasattr(c, f) and not isinstance(getattr(c, f), mx.array)})


@pytest.mark.parametrize("copied", [True, False])
def test_a_batch_window_is_put_back_whole_after_a_discarded_verify(copied, monkeypatch):
    """A 3-token verify on full batch windows (which drops their oldest entries and moves their left
    padding in place), discarded: every field as it was. The control: the padding array held, not
    copied, comes back moved (what the option fuzz found, seeds 160141 and 160417)."""
    if not copied:
        monkeypatch.setattr(windows, "_held", lambda field, value: value)
    c = batch_window()
    in_temporal_order(c)
    before = state(c)
    held = windows.snapshot_windows([c])
    k = mx.random.normal((2, 1, 3, 4), key=mx.random.key(9))
    c.update_and_fetch(k, k)
    rollback_batch_rows(c, [3, 3])
    windows.restore_windows(held)
    assert (state(c) == before) == copied


def test_a_lone_window_is_put_back_and_takes_a_one_token_step():
    c = RotatingKVCache(8)
    k = mx.random.normal((1, 1, 10, 4), key=mx.random.key(0))
    c.update_and_fetch(k, k)
    before = state(c)
    held = windows.snapshot_windows([c, KVCache()])  # (only the windows are held)
    assert len(held) == 1
    k = mx.random.normal((1, 1, 3, 4), key=mx.random.key(1))
    c.update_and_fetch(k, k)
    rollback_rotating(c, 3)
    windows.restore_windows(held)
    assert state(c) == before
    c.update_and_fetch(k[:, :, :1], k[:, :, :1])  # trimmed whole instead, this step raised
    assert c.offset == 11 and windows.snapshot_windows([KVCache()]) is None
