"""Held-out records: which of a run's records are kept aside for evaluation.

Both splits go by a hash of the record id, not by position or a random draw, so
they do not depend on the order the records were generated in; `split_by_hash`
also keeps every record on its side as data is added (a resumed or
`--follow-data` run never trains on what an earlier leg held out).
"""

import hashlib
from typing import Sequence


def split_records(records: Sequence[dict], n_eval: int):
    """Held-out records for evaluation: chosen by id hash, stable as data grows."""

    def key(r):
        return hashlib.sha1(r["id"].encode()).hexdigest()

    ranked = sorted(records, key=key)
    held = {r["id"] for r in ranked[:n_eval]}
    return [r for r in records if r["id"] not in held], [r for r in records if r["id"] in held]


def split_by_hash(records: Sequence[dict], frac: float):
    """Held-out records by a fixed hash threshold: a record never changes side as data grows."""

    def held(r):
        return int(hashlib.sha1(r["id"].encode()).hexdigest()[:8], 16) < frac * 2**32

    return [r for r in records if not held(r)], [r for r in records if held(r)]
