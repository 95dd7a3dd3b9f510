"""Rotary embeddings with one offset per batch entry (tree nodes, batched draft rows).

`mx.fast.rope` takes an array of offsets, one per batch entry; some scaled variants in
mlx-lm size tables from an int offset and do not. `takes_offset_arrays` tells which (checked
once per rope class); `rotate_rows` rotates each batch entry at its own offset either way.
"""

from typing import Dict, Sequence

import mlx.core as mx

_ARRAY_OFFSETS: Dict[type, bool] = {}


def _check(rope) -> bool:
    x = mx.random.normal((3, 1, 1, 8), key=mx.random.key(0))
    dims = getattr(rope, "dims", None) or getattr(rope, "dim", None)
    if isinstance(dims, int) and dims > 0:
        x = mx.random.normal((3, 1, 1, max(dims, 8)), key=mx.random.key(0))
    try:
        batched = rope(x, offset=mx.array([5, 2, 7]))
        each = mx.concatenate([rope(x[i : i + 1], offset=o) for i, o in enumerate((5, 2, 7))], axis=0)
        return bool(mx.allclose(batched, each, atol=1e-5).item())
    except Exception:
        return False


def takes_offset_arrays(rope) -> bool:
    """Whether `rope` rotates a batch with one offset per batch entry, as `mx.fast.rope` does."""
    kind = type(rope)
    if kind not in _ARRAY_OFFSETS:
        _ARRAY_OFFSETS[kind] = _check(rope)
    return _ARRAY_OFFSETS[kind]


def rotate_rows(rope, x: mx.array, offsets: Sequence[int]) -> mx.array:
    """x: [B, heads, L, d], batch entry b at positions offsets[b].. -> rotated x."""
    if len(set(offsets)) == 1:
        return rope(x, offset=offsets[0])
    if takes_offset_arrays(rope):
        return rope(x, offset=mx.array(offsets))
    return mx.concatenate([rope(x[b : b + 1], offset=o) for b, o in enumerate(offsets)], axis=0)
