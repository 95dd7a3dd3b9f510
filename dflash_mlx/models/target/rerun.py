"""Caches a partial accept rolls back by running the text model again (DeepSeek V4.1).

DeepSeek V4.1's `LayerCache` holds a layer's sliding window, its closed compressed groups and
their index keys, and the rows of the group still open. It cannot be trimmed (evicted window rows
and closed groups are gone), and no layer can be re-run alone: the layers that compress hand the
compressed KV and the indexer's picks to the layers after them in a dict the text model makes for
each forward. So a verify keeps every cache's fields as they were (the model replaces its arrays
rather than writing into them, so keeping the references is a copy; `probe` checks it on one
rollback when the target is built), and a partial accept puts them back and runs the text model
again on the kept tokens: one more forward of those tokens, which leaves the caches as a forward
of the kept tokens alone does.

`Target` takes this path only when every cache of the model is of this kind (then one forward
re-runs all of them); a model that mixes it with others is refused in one line. A split model's
ranks roll back together and so run that forward together, its collectives in step (tensor and
pipeline splits of DeepSeek V4.1: `benchmarks/results/20261205-split-variants-deepseek-v41/`).
"""

from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache


def can_rerun(c) -> bool:
    """A cache of the model's own class (not one of mlx-lm's `_BaseCache`s) that says it cannot
    be trimmed and holds only arrays, numbers and None: its fields are its whole state."""
    if isinstance(c, _BaseCache) or not hasattr(c, "__dict__"):
        return False
    trimmable = getattr(c, "is_trimmable", None)
    if not callable(trimmable) or trimmable():
        return False
    return all(v is None or isinstance(v, (mx.array, int, float, bool)) for v in vars(c).values())


def takes(kinds: List[str]) -> bool:
    """Whether a target of these rollback kinds takes this path (all of its caches do, or none:
    `refusal`)."""
    return kinds[:1] == ["rerun"]


def refusal(kinds: List[str], cache: List[Any]) -> Optional[str]:
    """Why caches of rollback `kinds` cannot take this path, or None."""
    if "rerun" not in kinds:
        return None
    if set(kinds) != {"rerun"}:
        i = kinds.index("rerun")
        return (f"cache {i} ({type(cache[i]).__name__}) is rolled back by running the whole text model again, "
                "and its other caches cannot be: a model that mixes the two has no rollback path")
    return None


@dataclass
class Rerun:
    """What a verify forward keeps to undo itself: its tokens and each cache's fields before it."""

    tokens: mx.array  # [B, S]
    fields: List[dict]


def before_verify(tokens: mx.array, cache: List[Any]) -> Rerun:
    return Rerun(tokens, [dict(vars(c)) for c in cache])


def put_back(cache_entry: Any, fields: dict):
    """`cache_entry`'s instance attributes made `fields` again: those set since (a forward may
    add one, as a first update sets its arrays) go too, not only those it changed."""
    vars(cache_entry).clear()
    vars(cache_entry).update(fields)


def rerun(forward: Callable[[mx.array, List[Any]], mx.array], cache: List[Any], record: Rerun, keep: int):
    """Put every cache back as it was before the verify, then run the text model's forward
    (`Target.run_text_model`) on its first `keep` tokens (queued: the next forward's evaluation
    takes it along)."""
    for c, fields in zip(cache, record.fields):
        put_back(c, fields)
    if keep:  # (queued now: a split model's ranks then run its collectives before the next forward's)
        mx.async_eval(forward(record.tokens[:, :keep], cache))
