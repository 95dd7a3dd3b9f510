"""Deep records labelled by the target: one forward over each record writes its features and
the target's argmax after every position where `FeatureSource` reads them (records that share a
document prefix share one pass, `label_shared`), and `agreement` measures how often that argmax
agrees with the record's text, inside the target's own answers and elsewhere (the records are
built in `train.depth_data`)."""

from typing import Dict, List, Sequence, Tuple

import numpy as np


def agreement(rec: dict, labels: np.ndarray) -> Dict[str, Tuple[int, int]]:
    """(agreeing, positions) of the target's argmax with the text: inside `spans`, elsewhere."""
    seq = np.asarray(rec["prompt"] + rec["response"])
    hit = labels[: len(seq) - 1] == seq[1:]  # argmax after j vs token j+1
    inside = np.zeros(len(seq) - 1, dtype=bool)
    for a, b in rec["spans"]:
        inside[max(a - 1, 0): b - 1] = True  # token p predicted at position p-1
    rest = ~inside
    rest[: max(len(rec["prompt"]) - 1, 0)] = False  # the template's head is no text to predict
    return {"inside": (int(hit[inside].sum()), int(inside.sum())),
            "outside": (int(hit[rest].sum()), int(rest.sum()))}


def label_shared(target, group: Sequence[dict], layer_ids: Sequence[int], feature_dir) -> bool:
    """Features and argmax labels of records that share one document prefix (`prefix_len`
    tokens each, of the longest one's), written where `FeatureSource` reads them: each
    document token goes through the target once, then each record's own tail, which is
    rolled back off the cache again (`Target.rollback`). False (nothing done) for a target
    with recurrent layers, whose state cannot be rolled back without a verify tape: then
    each record takes its own pass."""
    from dflash_mlx.train.data import feature_file
    from dflash_mlx.train.features import labels_file, save_npy, target_pass

    if target.recurrent:
        return False
    cache = target.make_cache()
    group = sorted(group, key=lambda r: r["prefix_len"])
    longest = group[-1]
    doc = (longest["prompt"] + longest["response"])[: longest["prefix_len"]]
    feats, labels, pos = [], [], 0
    for r in group:
        seq = r["prompt"] + r["response"][:-1]  # what FeatureSource runs the target over
        p = r["prefix_len"]
        if seq[:p] != doc[:p]:
            raise ValueError(f"{r['id']}: its first {p} tokens are not the document prefix of {longest['id']}")
        if p > pos:
            f, lab = target_pass(target, doc[pos:p], layer_ids, cache=cache)
            feats.append(f)
            labels.append(lab)
            pos = p
        tail = seq[p:]
        # one update, as the rollback of a sliding-window cache requires
        f, lab = target_pass(target, tail, layer_ids, cache=cache, chunk=max(len(tail), 1))
        target.rollback(cache, len(tail), len(tail), None)
        save_npy(labels_file(feature_dir, r["id"]), np.concatenate(labels + [lab]))
        save_npy(feature_file(feature_dir, r["id"]), np.concatenate(feats + [f]))
    return True


def label(target, recs: Sequence[dict], layer_ids: Sequence[int], feature_dir, log=print) -> dict:
    """Run the target once over each record (features and argmax into the feature cache);
    return the agreement of its argmax with the text, per kind and split."""
    from dflash_mlx.train.features import FeatureSource

    from dflash_mlx.train.data import feature_file
    from dflash_mlx.train.features import labels_file

    src = FeatureSource(target, layer_ids, feature_dir, save_missing=True)
    stats: Dict[str, List[int]] = {}
    import time

    tic = time.perf_counter()
    groups: Dict[str, List[dict]] = {}
    for r in recs:
        if r.get("prefix_group") and not (feature_file(feature_dir, r["id"]).exists()
                                          and labels_file(feature_dir, r["id"]).exists()):
            groups.setdefault(r["prefix_group"], []).append(r)
    for name, group in groups.items():
        t0 = time.perf_counter()
        if label_shared(target, group, src.stored, feature_dir):  # the columns FeatureSource reads
            n = max(r["prefix_len"] for r in group) + sum(len(r["prompt"]) + len(r["response"]) - r["prefix_len"]
                                                           for r in group)
            log(f"labelled {len(group)} answers to {name} in one pass ({n} tokens, "
                f"{n / (time.perf_counter() - t0):.0f} tok/s)")
    done = 0
    for r in recs:
        lab = src.labels(r)
        src(r)  # features: cached by the same forward
        done += len(r["prompt"]) + len(r["response"])
        split = r.get("split") or ("eval" if ":eval:" in r["id"] else "train")
        kind = r["id"].split(":")[0] + ":" + split
        for where, (a, n) in agreement(r, lab).items():
            s = stats.setdefault(f"{kind}:{where}", [0, 0])
            s[0] += a
            s[1] += n
        log(f"labelled {r['id']} ({len(r['prompt']) + len(r['response'])} tokens), "
            f"{done / (time.perf_counter() - tic):.0f} tok/s so far")
    return {k: {"agree": a, "positions": n, "rate": a / max(n, 1)} for k, (a, n) in stats.items()}
