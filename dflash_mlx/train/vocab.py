"""Reduced draft vocabulary: the target tokens the draft may propose.

Scoring 15 draft positions over a 262k-token LM head costs about as much as a
target decode step on CPU. The draft only needs the tokens the target actually
says, so it scores the `size` most frequent response tokens of the training
data. Verification still uses the full target head: output stays exact; an
out-of-vocabulary token is simply never drafted.
"""

from collections import Counter
from typing import Iterable, List, Optional, Sequence

import numpy as np


def count_tokens(records: Iterable[dict]) -> Counter:
    c = Counter()
    for r in records:
        c.update(r["response"])
    return c


def build_vocab(records: Sequence[dict], size: int, vocab_size: int, always: Sequence[int] = ()) -> np.ndarray:
    """The `size` most frequent response tokens (plus `always`, e.g. EOS), sorted by id.

    Ties are broken by token id so the result is deterministic. If the data has
    fewer distinct tokens, the rest is filled with the lowest unused ids.
    """
    if size >= vocab_size:
        return np.arange(vocab_size, dtype=np.int32)
    counts = count_tokens(records)
    chosen = [int(t) for t in always if 0 <= t < vocab_size]
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    seen = set(chosen)
    for t, _ in ranked:
        if len(chosen) >= size:
            break
        if t not in seen and 0 <= t < vocab_size:
            chosen.append(int(t))
            seen.add(t)
    t = 0
    while len(chosen) < size:
        if t not in seen:
            chosen.append(t)
            seen.add(t)
        t += 1
    return np.array(sorted(chosen[:size]), dtype=np.int32)


def index_map(vocab_ids: Optional[np.ndarray], vocab_size: int) -> np.ndarray:
    """full token id -> index in the draft vocabulary (-1: not in it)."""
    if vocab_ids is None:
        return np.arange(vocab_size, dtype=np.int32)
    m = np.full(vocab_size, -1, dtype=np.int32)
    m[np.asarray(vocab_ids)] = np.arange(len(vocab_ids), dtype=np.int32)
    return m


def coverage(records: Sequence[dict], vocab_ids: Optional[np.ndarray]) -> float:
    """Fraction of response tokens inside the draft vocabulary."""
    if vocab_ids is None:
        return 1.0
    counts = count_tokens(records)
    total = sum(counts.values())
    inside = set(int(t) for t in vocab_ids)
    return sum(n for t, n in counts.items() if t in inside) / max(total, 1)
