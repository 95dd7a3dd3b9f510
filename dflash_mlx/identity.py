"""Values keyed by the identity of live objects.

MLX arrays and modules do not hash by value, and a dead object's `id` is soon
reused by a new one; the weak references here tell a live key from a newcomer
that inherited a dead key's id. Entries of dead keys are dropped as new ones come.
"""

import weakref
from typing import Any, Dict, Tuple

_MISSING = object()


class IdentityMap:
    """`map.get((a, b))` / `map.put((a, b), value)`: keyed by the identities of a and b."""

    def __init__(self):
        self._items: Dict[Tuple[int, ...], Tuple[Tuple[weakref.ref, ...], Any]] = {}

    def get(self, keys: tuple, default=None):
        entry = self._items.get(tuple(map(id, keys)), _MISSING)
        if entry is _MISSING or any(ref() is not key for ref, key in zip(entry[0], keys)):
            return default
        return entry[1]

    def put(self, keys: tuple, value):
        for k in [k for k, (refs, _) in self._items.items() if any(r() is None for r in refs)]:
            del self._items[k]
        self._items[tuple(map(id, keys))] = (tuple(weakref.ref(k) for k in keys), value)

    def put_new(self, keys: tuple, value) -> bool:
        """`put` unless the keys have a value already; True when put."""
        if self.get(keys, _MISSING) is not _MISSING:
            return False
        self.put(keys, value)
        return True

    def clear(self):
        self._items.clear()

    def __len__(self):
        return len(self._items)


def pair(model, draft) -> tuple:
    """The keys of a target/draft pair's entries: (model,) with no draft (None), else (model, draft)."""
    return (model,) if draft is None else (model, draft)
