"""Sliding-window caches put back as they were before a cycle that never lands.

A verify of w tokens on a full window (`RotatingKVCache`, `BatchRotatingKVCache`) concatenates
them after dropping the oldest entries the window no longer needs, and a rollback of what was
rejected trims the tail: kept >= 1 token, the window again holds what the next step reads. A cycle
launched ahead and discarded keeps none: trimmed whole, the window would hold one entry fewer than
its size while its count of tokens says it is full, and mlx-lm's next one-token update then sizes a
negative buffer (`[full] Negative dimensions`; found by the option fuzz on a batch, and reachable
alone: a stream closed with a cycle launched ahead, then its next turn one token longer). So a
discard puts a window's own state back instead: a multi-token update makes new arrays, never
writes into the old ones, so the state held before the launch is still whole. Not so in deterministic
mode, whose verify is one-token updates that write into the window's own arrays: nothing is held there,
and the verify's record (`exact_rows.RowsRecord`, from copies) puts the windows back on its own.
"""

from typing import Any, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

from dflash_mlx.models.target.rollback import sub_caches

_FIELDS = {
    RotatingKVCache: ("keys", "values", "offset", "_idx"),
    BatchRotatingKVCache: ("keys", "values", "offset", "left_padding", "_idx", "_offset", "rotated", "_lengths"),
}

Snapshot = List[Tuple[Any, dict]]


def snapshot_windows(caches: List) -> Optional[Snapshot]:
    """The state of every sliding-window cache in `caches` (a target's or a batch's), before a
    cycle whose verify writes two tokens or more into them; None where there is none."""
    held = [(c, {f: _held(f, getattr(c, f)) for f in fields})
            for cache in caches for c in sub_caches(cache) for fields in [_fields(c)] if fields]
    return held or None


def _fields(c) -> tuple:
    """The fields that make a window's state (a bounded cache, `kv_window.StepsWindowCache`, is a
    `RotatingKVCache`); () for any other cache."""
    return next((f for kind, f in _FIELDS.items() if isinstance(c, kind)), ())


def _held(field: str, value):
    """A field's value as it is now. A batch window's `left_padding` is updated in place (`-=` on an
    mx.array rewrites that very array: the option fuzz found the restored padding moved), so its small
    arrays are copied; the keys and values a multi-token update replaces, never writes into."""
    if isinstance(value, mx.array) and field not in ("keys", "values"):
        return mx.array(value)
    return value


def restore_windows(snapshot: Optional[Snapshot]):
    """Put back what `snapshot_windows` held (after the discarded cycle's rollback of the rest)."""
    for c, state in snapshot or ():
        for field, value in state.items():
            setattr(c, field, value)
