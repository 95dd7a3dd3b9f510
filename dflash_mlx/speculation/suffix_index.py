"""Copies from earlier requests: one index over their prompts and answers, shared by all.

Coding agents and multi-agent pipelines send requests whose answers repeat earlier ones
(the same tool calls, a file re-emitted after an edit, the same query skeleton), often in
another conversation than the one that wrote them first, where the context's own
`copies.ContextIndex` cannot see them. `SuffixIndex` keeps, over earlier requests' token
sequences ("documents"), the latest place each n-gram (n = 1..MAX_NGRAM) ended with a
next token, as `ContextIndex` does over one context, and proposes what followed the
longest n-gram the context ends with (cf. SuffixDecoding in Arctic Inference, which keeps
a global suffix tree of earlier outputs beside each request's own). Its matches are
`CopyMatch(shared=True)`; `policy.copies` weighs them by the same rule as the context's
own, with a record of their own. Each n-gram's earlier ends are chained, as the context
index's are, so `matches` gives several continuations for a copy tree.

A conversation is resent whole at every turn: a document that extends a kept one extends
it (only the new tokens are indexed) and one that shares a prefix with a kept one indexes
only what follows the shared part. The index is bounded in bytes (`BYTES_PER_TOKEN` per
indexed token, measured, plus the documents' tokens); the least recently added documents go
first. Every method takes a lock, so one index may serve several threads (the server's
engine runs on one).
"""

import threading
import weakref
from array import array
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

from dflash_mlx.speculation.copies import MAX_NGRAM, MAX_STEPS, CopyMatch

# Python memory per indexed token: MAX_NGRAM dictionary entries (a hashed key, a packed
# position) with the dictionary's slack, and MAX_NGRAM packed earlier ends; an upper bound
# measured with tracemalloc (tests/test_global_copies.py checks it).
BYTES_PER_TOKEN = 1100
DEFAULT_SUFFIX_INDEX_BYTES = 256 << 20  # about 240k indexed tokens
_POSITION_BITS = 32


class _Document:
    __slots__ = ("tokens", "start", "earlier")

    def __init__(self, tokens: array, start: int):
        self.tokens = tokens  # the whole sequence, so n-grams may reach before `start`
        self.start = start  # n-grams whose next token is at `start` or later are indexed here
        # [(i - start) * MAX_NGRAM + n - 1]: where the n-gram before position i ended before
        # (packed as `_latest`'s values), -1 for nowhere
        self.earlier = array("q")

    @property
    def nbytes(self) -> int:
        return 4 * len(self.tokens) + BYTES_PER_TOKEN * (len(self.tokens) - self.start)


class SuffixIndex:
    """Earlier requests' prompts and answers, for copies in later ones (`add`, `match`);
    at most `max_bytes` (0: nothing is kept). `model`: the model whose token ids it holds
    (checked by `stream_generate`)."""

    def __init__(self, max_bytes: int = DEFAULT_SUFFIX_INDEX_BYTES, model=None):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._model = weakref.ref(model) if model is not None else None
        self._docs: "OrderedDict[int, _Document]" = OrderedDict()  # serial -> document, least recent first
        self._latest: Dict[int, int] = {}  # hash of an n-gram -> serial << 32 | where it ended
        self._serial = 0
        self._bytes = 0
        self._lock = threading.Lock()

    def made_for(self, model) -> bool:
        return self._model is None or self._model() is model

    @property
    def nbytes(self) -> int:
        return self._bytes

    def stats(self) -> Dict[str, int]:
        with self._lock:
            return {"documents": len(self._docs), "tokens": sum(len(d.tokens) for d in self._docs.values()),
                    "bytes": self._bytes, "max_bytes": self.max_bytes}

    def clear(self):
        with self._lock:
            self._docs.clear()
            self._latest.clear()
            self._bytes = 0

    # -- adding

    def add(self, tokens: Sequence[int]):
        """Keep a finished request's tokens (its prompt and answer) for later requests."""
        tokens = array("i", tokens)
        if len(tokens) < 2 or self.max_bytes <= 0:
            return
        with self._lock:
            serial, shared = self._longest_prefix(tokens)
            if serial is not None and shared == len(tokens):
                self._docs.move_to_end(serial)  # nothing new
                return
            if serial is not None and shared == len(self._docs[serial].tokens):
                doc = self._docs.pop(serial)  # a conversation resent with its next turn: extended
                self._bytes -= doc.nbytes
                self._docs[serial] = doc
                old = len(doc.tokens)
                doc.tokens.extend(tokens[old:])
                self._index(serial, doc, old)
                self._bytes += doc.nbytes
            else:
                self._serial += 1
                serial = self._serial
                doc = self._docs[serial] = _Document(tokens, max(1, shared))
                self._index(serial, doc, doc.start)
                self._bytes += doc.nbytes
            self._evict(serial)

    def _longest_prefix(self, tokens: array):
        """(serial, length) of the kept document sharing the longest prefix with `tokens`."""
        best, best_len = None, 0
        for serial, doc in self._docs.items():
            n = _common_prefix(doc.tokens, tokens)
            if n > best_len:
                best, best_len = serial, n
        return best, best_len

    def _index(self, serial: int, doc: _Document, start: int):
        """Index the n-grams whose next token is at position `start` or later."""
        seq, latest, tag, earlier = doc.tokens, self._latest, serial << _POSITION_BITS, doc.earlier
        for i in range(max(1, start), len(seq)):
            for n in range(1, MAX_NGRAM + 1):
                if n <= i:
                    key = hash(tuple(seq[i - n : i]))
                    earlier.append(latest.get(key, -1))
                    latest[key] = tag | (i - 1)
                else:
                    earlier.append(-1)

    def _drop(self, serial: int):
        doc = self._docs.pop(serial)
        seq, latest, tag = doc.tokens, self._latest, serial << _POSITION_BITS
        for i in range(max(1, doc.start), len(seq)):
            for n in range(1, min(MAX_NGRAM, i) + 1):
                key = hash(tuple(seq[i - n : i]))
                if latest.get(key, -1) >> _POSITION_BITS == serial:  # not since overwritten by a later document
                    del latest[key]
        self._bytes -= doc.nbytes
        return doc

    def _evict(self, newest: int):
        while self._bytes > self.max_bytes and len(self._docs) > 1:
            self._drop(next(iter(self._docs)))
        if self._bytes > self.max_bytes:  # the newest alone is past the bound: keep what fits of its end
            doc = self._drop(newest)
            fit = (self.max_bytes // (BYTES_PER_TOKEN + 4)) - 1
            if fit >= 2:
                self._serial += 1
                tail = self._docs[self._serial] = _Document(doc.tokens[-fit:], 1)
                self._index(self._serial, tail, 1)
                self._bytes += tail.nbytes

    # -- matching

    def match(self, context: Sequence[int], max_tokens: int) -> Optional[CopyMatch]:
        """What followed the latest earlier occurrence of the longest n-gram (up to
        MAX_NGRAM) `context` ends with, up to `max_tokens` tokens; None when none occurred."""
        found = self.matches(context, max_tokens, 1)
        return found[0] if found else None

    def matches(self, context: Sequence[int], max_tokens: int, k: int) -> List[CopyMatch]:
        """Up to `k` distinct continuations of `context`'s suffix in earlier requests: the
        longest n-gram's occurrences first, most recent first (up to `MAX_STEPS`), then shorter ones'."""
        tail = [int(t) for t in context[-MAX_NGRAM:]]
        found: List[CopyMatch] = []
        seen = set()
        mask = (1 << _POSITION_BITS) - 1
        with self._lock:
            for n in range(len(tail), 0, -1):
                at = self._latest.get(hash(tuple(tail[-n:])), -1)
                for _ in range(MAX_STEPS):
                    doc = self._docs.get(at >> _POSITION_BITS) if at >= 0 else None
                    end = at & mask
                    if doc is None or doc.tokens[end - n + 1 : end + 1].tolist() != tail[-n:]:
                        break  # none, dropped, or a hash shared by another n-gram
                    continuation = doc.tokens[end + 1 : end + 1 + max_tokens].tolist()
                    if tuple(continuation) not in seen:
                        seen.add(tuple(continuation))
                        found.append(CopyMatch(n, end + 1, continuation, shared=True))
                        if len(found) >= k:
                            return found
                    at = doc.earlier[(end + 1 - doc.start) * MAX_NGRAM + n - 1]
        return found


def _common_prefix(a: array, b: array) -> int:
    """Length of the common prefix of two token arrays (slices compared in C, halving the range)."""
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; the answer is at most hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def make_suffix_index(model, max_bytes: int = DEFAULT_SUFFIX_INDEX_BYTES) -> SuffixIndex:
    """An empty `SuffixIndex` for `model`'s token ids, for `stream_generate(..., suffix_index=)`."""
    return SuffixIndex(max_bytes, model=model)
