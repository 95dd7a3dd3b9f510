"""Target and draft caches kept between calls, and what of them a new prompt can reuse.

Attention caches are trimmed back to the prefix a new prompt shares with them.
Recurrent caches (Gated DeltaNet state, conv state) cannot be trimmed, so a
`PromptCache` can also keep a few snapshots taken at request boundaries
(`snapshot()`), keyed by the tokens they hold; `reuse` restores the one that
saves the most prefill. Snapshots are bounded by count and by bytes (least
recently used dropped first). mlx-lm's `LRUPromptCache` keeps mlx-lm caches
only; a snapshot here also holds the draft's context cache and the features it
has not absorbed, and a sliding-window draft cache that cannot be trimmed.
"""

import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import CacheList, ChunkedKVCache, can_trim_prompt_cache, trim_prompt_cache

from dflash_mlx.speculation.copies import ContextIndex
from dflash_mlx.models.target.adapter import target_for
from dflash_mlx.models.draft.context_cache import ContextCache
from dflash_mlx.models.target.kv_window import bounds, checked_max_kv_size, make_window_cache, windowed


@dataclass
class Snapshot:
    """A frozen copy of a `PromptCache`'s caches after `tokens`."""

    tokens: List[int]
    target_cache: List[Any]
    draft_cache: Optional[List[Any]]
    pending: Optional[mx.array]
    nbytes: int = 0  # set when kept


def nbytes(obj) -> int:
    """Bytes of the arrays a cache (or a list of caches, or a snapshot's parts) holds."""
    if obj is None:
        return 0
    if isinstance(obj, mx.array):
        return obj.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(x) for x in obj)
    try:
        n = obj.nbytes  # mlx-lm's caches know their buffers' size
        if isinstance(n, int):
            return n
    except (NotImplementedError, AttributeError):
        pass
    if not hasattr(obj, "__dict__"):
        return 0
    # a cache of our own (the draft's ContextCache): its arrays and the caches inside it
    return sum(nbytes(v) for v in vars(obj).values()
               if isinstance(v, (mx.array, list, tuple)) or (hasattr(v, "__dict__") and hasattr(v, "keys")))


@dataclass
class PromptCache:
    """Target and draft caches kept between calls (multi-turn chat, a server).

    `tokens` are the tokens whose K/V (or recurrent state) the target cache
    holds; `pending` are target features of the last committed positions that
    the draft has not absorbed yet. `max_snapshots` > 0 keeps that many
    snapshots, holding at most `max_bytes` together (None: no bound in bytes);
    the least recently used go first, and one larger than `max_bytes` is not kept.
    The live caches (one conversation, at most the context window) come on top.
    """

    model: Any
    target_cache: List[Any]
    draft: Any = None
    draft_cache: Optional[List[Any]] = None
    tokens: List[int] = field(default_factory=list)
    pending: Optional[mx.array] = None
    valid: bool = True
    max_snapshots: int = 0
    max_bytes: Optional[int] = None
    snapshots: "OrderedDict[tuple, Snapshot]" = field(default_factory=OrderedDict)
    # the whole conversation (fed tokens + the last committed one), for copy proposals
    copy_index: Optional[ContextIndex] = None
    # the next cycle, planned or launched before the host needed it (`engine.ahead`); while one is
    # launched its rows are in the caches, and `valid` is False
    ahead: Any = None
    # the call's quantized KV cache setting (`models.target.kv_quantization`), None: full precision
    kv_quantization: Any = None
    # mlx-lm's max_kv_size: the target caches are bounded windows (`models.target.kv_window`); None: not
    max_kv_size: Optional[int] = None
    # logits processors see `tokens` from here on (a prompt cache file's: what follows it, as mlx-lm's generate)
    history_start: int = 0
    # `tokens` before this are placeholders (an mlx-lm prompt cache file does not name them): copies skip them
    known_from: int = 0

    @property
    def history(self) -> List[int]:
        """The tokens logits processors see as what came before (`history_start` on)."""
        return self.tokens[self.history_start:] if self.history_start else self.tokens

    @property
    def windowed(self) -> bool:
        """Whether the target caches are bounded windows (`max_kv_size`, on a model without caches of its own)."""
        return self.max_kv_size is not None and windowed(self.target_cache)

    def context_index(self, last: int) -> ContextIndex:
        """The index of `tokens` + [last] for copy proposals: the one kept from earlier calls
        brought up to date when it is a prefix of them (a chat's next turn), else built anew."""
        context = self.tokens[self.known_from:] + [last]
        index = self.copy_index
        if index is None or not index.follows(context):
            index = ContextIndex()
        index.extend(context[len(index):])
        self.copy_index = index
        return index

    @property
    def snapshot_bytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots.values())

    @property
    def live_bytes(self) -> int:
        return nbytes(self.target_cache) + nbytes(self.draft_cache) + nbytes(self.pending)

    def stats(self) -> Dict[str, Any]:
        return {"tokens": len(self.tokens), "snapshots": len(self.snapshots), "max_snapshots": self.max_snapshots,
                "snapshot_bytes": self.snapshot_bytes, "max_bytes": self.max_bytes, "live_bytes": self.live_bytes}

    def snapshot(self) -> bool:
        """Keep a copy of the caches as they are now; say whether one was taken."""
        if self.max_snapshots < 1 or not self.valid or not self.tokens:
            return False
        self._keep(
            Snapshot(
                list(self.tokens),
                copy.deepcopy(self.target_cache),
                copy.deepcopy(self.draft_cache),
                self.pending,
            )
        )
        return True

    def reuse(self, prompt_ids: Sequence[int], target, draft) -> List[int]:
        """Leave the caches holding the longest reusable prefix of `prompt_ids`; return the rest.

        The last prompt token is always left to run: the engine needs its logits.
        """
        prompt_ids = list(prompt_ids)
        limit = len(prompt_ids) - 1
        live = Snapshot(self.tokens, self.target_cache, self.draft_cache, self.pending)
        live_keep = self._usable(live, prompt_ids, limit, draft) if self.valid else 0
        best, best_keep = None, 0
        for snap in self.snapshots.values():
            keep = self._usable(snap, prompt_ids, limit, draft)
            if keep > best_keep:
                best, best_keep = snap, keep

        if best is not None and best_keep > live_keep:
            self.snapshots.move_to_end(tuple(best.tokens))
            chosen = copy.deepcopy(best)  # the snapshot stays for later prompts
            if self.valid and self.tokens:
                self._keep(live)  # the live caches are not used again: keep them as they are
            self._restore(chosen, best_keep, draft)
        elif live_keep > 0:
            if live_keep < len(self.tokens) and self.max_snapshots > 0:
                self.snapshot()  # trimming loses the tail another conversation may come back to
            self._restore(live, live_keep, draft)
        else:
            if self.valid and self.tokens and self.max_snapshots > 0:
                self._keep(live)
            self.target_cache = make_window_cache(target, self.max_kv_size)
            self.draft_cache = make_draft_cache(draft, self.model, self.max_kv_size)
            self.pending = None
            self.tokens = []
        self.history_start = min(self.history_start, len(self.tokens))
        self.known_from = min(self.known_from, len(self.tokens))
        return prompt_ids[len(self.tokens) :]

    # -- internals --------------------------------------------------------------

    def _keep(self, snap: Snapshot):
        key = tuple(snap.tokens)
        self.snapshots.pop(key, None)
        snap.nbytes = nbytes(snap.target_cache) + nbytes(snap.draft_cache) + nbytes(snap.pending)
        if self.max_bytes is not None and snap.nbytes > self.max_bytes:
            return
        self.snapshots[key] = snap
        total = self.snapshot_bytes
        while len(self.snapshots) > self.max_snapshots or (self.max_bytes is not None and total > self.max_bytes):
            _, dropped = self.snapshots.popitem(last=False)
            total -= dropped.nbytes

    @staticmethod
    def _usable(snap: Snapshot, prompt_ids: List[int], limit: int, draft) -> int:
        """Tokens of `snap` a prompt can keep: the shared prefix if the caches trim to it, else all or none."""
        n = len(snap.tokens)
        shared = min(common_prefix(snap.tokens, prompt_ids), limit)
        if shared == n:
            return n
        if shared == 0 or not can_trim_prompt_cache(snap.target_cache):
            return 0
        keep = shared - _draft_replay(snap, shared, draft)
        return keep if trims_to(snap.target_cache, keep) else 0

    def _restore(self, snap: Snapshot, keep: int, draft):
        """Make `snap` (owned by this call) the live caches, trimmed to `keep` tokens."""
        drop = len(snap.tokens) - keep
        if drop > 0:
            trim_prompt_cache(snap.target_cache, drop)
            if draft is not None and snap.draft_cache is not None:
                pending = _pending_len(snap)
                draft_len = len(snap.tokens) - pending
                if keep >= draft_len:
                    snap.pending = snap.pending[:, : keep - draft_len] if keep > draft_len else None
                else:
                    fresh = make_draft_cache(draft, self.model, self.max_kv_size)
                    for i, c in enumerate(snap.draft_cache):
                        if c.trimmable(draft_len - keep):
                            c.trim(draft_len - keep)
                        else:
                            # A sliding window that no longer holds what the trim leaves
                            # visible: `_usable` kept `keep` a window short of the shared
                            # prefix, so the prefill injects the whole window again.
                            fresh[i].offset = keep
                            snap.draft_cache[i] = fresh[i]
                    snap.pending = None
        self.target_cache = snap.target_cache
        self.draft_cache = snap.draft_cache
        self.pending = snap.pending
        self.tokens = list(snap.tokens[:keep])


def _draft_replay(snap: Snapshot, keep: int, draft) -> int:
    """Tokens before `keep` the prefill must run again so the draft's context is right.

    Trimming a draft cache to `keep` tokens is exact on full-attention layers. A
    sliding-window layer keeps only its last `window - 1` entries, so once it is past
    its window a trim would leave it short of what the next block sees: the target
    cache is then trimmed a window further back and the prefill runs that window
    again, rebuilding the draft's context from fresh target features (instead of
    throwing both caches away).
    """
    if draft is None or snap.draft_cache is None:
        return 0
    draft_len = len(snap.tokens) - _pending_len(snap)
    if keep >= draft_len:
        return 0  # only waiting features are dropped
    windows = [c.window for c in snap.draft_cache if not c.trimmable(draft_len - keep)]
    return min(max(windows) - 1, keep) if windows else 0


def trims_to(caches: Sequence[Any], keep: int) -> bool:
    """Whether trimming `caches` to their first `keep` tokens leaves what the next forward reads.

    mlx-lm's `ChunkedKVCache` (Llama 4's chunked layers) says it is always trimmable, but it drops
    keys off its front as a decode goes on (`maybe_trim_front`) and `trim` stops at what it still
    holds: trimmed back past that, it would keep more tokens than the full-attention caches beside
    it and lack keys of the chunk position `keep` is in. Back to the start of that chunk it holds them.
    """
    for c in caches:
        for sub in (c.caches if isinstance(c, CacheList) else (c,)):
            if isinstance(sub, ChunkedKVCache) and sub.start_position > keep // sub.chunk_size * sub.chunk_size:
                return False
    return True


def _pending_len(snap: Snapshot) -> int:
    return 0 if snap.pending is None else snap.pending.shape[1]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def make_draft_cache(draft, model, max_kv_size: Optional[int] = None) -> Optional[List[Any]]:
    """The draft's context caches (None without a draft). Under mlx-lm's `max_kv_size`, on a model it bounds,
    each keeps at most the last `max_kv_size` tokens' entries as well (and a few more it masks out): the draft
    then sees what the target's window holds, its guesses change but no token does, and its memory is bounded
    as the target's is."""
    if draft is None:
        return None
    caches = draft.make_cache()
    if max_kv_size is None or not bounds(model) or not all(isinstance(c, ContextCache) for c in caches):
        return caches
    return [ContextCache(max_kv_size if c.window is None else min(c.window, max_kv_size)) for c in caches]


def make_prompt_cache(model, draft=None, max_snapshots: int = 0, max_bytes: Optional[int] = None,
                      max_kv_size: Optional[int] = None) -> PromptCache:
    """`max_kv_size`: mlx-lm's bound on the target's KV cache (`models.target.kv_window`; None: unbounded)."""
    target = target_for(model, draft)
    max_kv_size = checked_max_kv_size(max_kv_size)
    return PromptCache(
        model=model,
        target_cache=make_window_cache(target, max_kv_size),
        max_kv_size=max_kv_size,
        draft=draft,
        draft_cache=make_draft_cache(draft, model, max_kv_size),
        max_snapshots=max_snapshots,
        max_bytes=max_bytes,
    )
