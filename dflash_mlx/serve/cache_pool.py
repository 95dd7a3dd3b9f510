"""The batched server's cached conversations: earlier answers' caches, kept for the next
request that shares a prefix with one of them.

A finished row's `PromptCache` goes into the pool; a joining request takes out the one
sharing the longest prefix with its prompt (a row owns its caches while it runs) and
prefills only the rest. The pool is bounded in count and, together with the running
rows' live caches, in bytes; the least recently kept conversation goes first. Each kept
conversation has a key, the count of those kept before it, so on a target split over
processes every rank names it alike: rank 0 bounds its pool and the others mirror its keys
(`keys`, `mirror`), since their caches' bytes differ (each holds its own heads or layers). Served one
at a time, the worker keeps a single `PromptCache` with snapshots instead
(`dflash_mlx.engine.prompt_cache`), bounded by the same numbers.
"""

from collections import OrderedDict
from typing import List, Optional

from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.engine.prompt_cache import PromptCache, common_prefix, nbytes

DEFAULT_PROMPT_CACHE_BYTES = 1 << 30  # cached conversations (and, batched, the rows' caches): 1 GiB


def rows_bytes(engine: BatchEngine) -> int:
    """Bytes of the caches the engine's rows (running and joining) hold."""
    rows = list(engine.rows) + list(engine.joining)
    # a lone row decodes on its own PromptCache's caches, which are the engine's then
    batch = nbytes(engine.cache) if engine.batched else 0
    return batch + sum(nbytes(r.state.draft_cache) + nbytes(r.state.target_cache) + r.state.snapshot_bytes
                       for r in rows)


class CachePool:
    """Conversations kept by the batched worker: at most `max_snapshots` of them, and with the
    rows' caches at most `max_bytes` (None: no bound)."""

    def __init__(self, max_snapshots: int, max_bytes: Optional[int]):
        self.max_snapshots, self.max_bytes = max_snapshots, max_bytes
        self.kept: "OrderedDict[int, PromptCache]" = OrderedDict()  # key -> conversation, least recently kept first
        self.count = 0  # conversations kept so far: the next one's key

    def __len__(self) -> int:
        return len(self.kept)

    def best(self, prompt_ids: List[int]) -> Optional[int]:
        """The key of the kept conversation sharing the longest prefix with `prompt_ids`, or None."""
        best, best_len = None, 0
        for key, state in self.kept.items():
            n = common_prefix(state.tokens, prompt_ids)
            if n > best_len:
                best, best_len = key, n
        return best

    def take(self, key: Optional[int]) -> Optional[PromptCache]:
        """The conversation kept under `key`, out of the pool (a row owns its caches); None for None."""
        return self.kept.pop(key) if key is not None else None

    def keep(self, state: PromptCache, engine: Optional[BatchEngine]):
        """Keep a finished row's conversation, dropping the oldest past the bounds (`engine`
        None: no bounds here, a mirror of rank 0's pool drops what `mirror` says)."""
        self.kept[self.count] = state
        self.count += 1
        if engine is None:
            return
        while len(self.kept) > self.max_snapshots:
            self.kept.popitem(last=False)
        self.evict(engine)

    def keys(self) -> List[int]:
        return list(self.kept)

    def mirror(self, keys: List[int]):
        """Keep only the conversations under `keys` (rank 0's pool, which this one mirrors)."""
        for key in set(self.kept) - set(keys):
            del self.kept[key]

    def nbytes(self) -> int:
        return sum(s.live_bytes + s.snapshot_bytes for s in list(self.kept.values()))

    def evict(self, engine: BatchEngine):
        """Least recently kept conversations out while rows and pool hold more than `max_bytes`."""
        if self.max_bytes is None:
            return
        while self.kept and self.nbytes() + rows_bytes(engine) > self.max_bytes:
            self.kept.popitem(last=False)

    def room(self, engine: BatchEngine) -> bool:
        """Whether another row may join: the rows' caches leave room under `max_bytes`
        (kept conversations go first; with nothing running a job always runs)."""
        if self.max_bytes is None or engine.idle:
            return True
        self.evict(engine)
        return rows_bytes(engine) < self.max_bytes

    def stats(self, engine: BatchEngine) -> dict:
        """In the one-at-a-time `PromptCache.stats` keys: kept conversations as "snapshots",
        the rows' caches as "live" (read from another thread: a moment's view)."""
        return {"snapshots": len(self.kept), "max_snapshots": self.max_snapshots,
                "snapshot_bytes": self.nbytes(), "live_bytes": rows_bytes(engine), "max_bytes": self.max_bytes}
