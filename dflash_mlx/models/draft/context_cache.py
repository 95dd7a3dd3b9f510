"""The draft's KV cache: context keys/values only, one per draft layer.

Block keys/values are recomputed every step and never stored, so the cache only
grows with committed context and the draft never needs a rollback in the loop.
"""

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class ContextCache:
    """Context-only K/V of one draft layer, with absolute positions.

    Full-attention layers keep everything (mlx-lm's KVCache, grown in steps);
    sliding layers keep the last `window - 1` entries, the most any block query
    can see, plus `TRIM_SLACK` more (masked out) so that a prompt cache can trim
    a few tokens (an edited answer's tail) without rebuilding the window.
    """

    TRIM_SLACK = 32

    def __init__(self, window: Optional[int] = None):
        self.window = window
        self._full = KVCache() if window is None else None
        self.keys = None
        self.values = None
        self.offset = 0  # absolute number of context tokens seen

    def append(self, keys: mx.array, values: mx.array):
        """keys, values: [B, n_kv, S, d] at positions offset..offset+S-1."""
        self.offset += keys.shape[2]
        if self._full is not None:
            return self._full.update_and_fetch(keys, values)
        if self.keys is not None:
            keys = mx.concatenate([self.keys, keys], axis=2)
            values = mx.concatenate([self.values, values], axis=2)
        keep = self.window - 1 + self.TRIM_SLACK
        self.keys, self.values = keys[..., -keep:, :], values[..., -keep:, :]
        return self.keys, self.values

    def trimmable(self, n: int) -> bool:
        """Whether dropping the newest n entries leaves all a later block can see: always on
        full layers; on sliding ones only while the older entries it needs are still held."""
        if self._full is not None:
            return True
        held = 0 if self.keys is None else self.keys.shape[2]
        return n <= held and held - n >= min(self.window - 1, self.offset - n)

    def trim(self, n: int) -> int:
        """Drop the newest n context entries (`trimmable(n)` must hold)."""
        if not self.trimmable(n):
            raise RuntimeError("this sliding-window draft cache no longer holds what a trim would "
                               "leave visible; rebuild it from the target's features")
        self.offset -= n
        if self._full is not None:
            return self._full.trim(n)
        if n:
            self.keys, self.values = self.keys[..., :-n, :], self.values[..., :-n, :]
        return n

    def fetch(self):
        if self._full is not None:
            if self._full.keys is None:
                return None, None
            return self._full.keys[..., : self._full.offset, :], self._full.values[..., : self._full.offset, :]
        return self.keys, self.values
