"""Training records with depth: chained conversations and long documents, labelled by the target.

The committed responses are single-turn (~100-token prompts, ~160-token answers), so a
draft trained on them has never seen a position past ~500. Two kinds of deep records:

- **chats**: answered records chained into one multi-turn conversation (the target's
  chat template between turns), up to the target's context window; anchors are drawn
  inside the target's own answers only (`spans`);
- **documents**: a long text from `dflash_mlx.documents.TRAIN_DOCUMENTS` cut to a
  length, then a question; anchors inside the document.

Labels are not generated (decoding at depth runs ~5 tok/s here): one target forward
over the record gives its features and its own argmax after every position
(`target_labels`, `trainer.target_pass`). Those equal the target's greedy continuation
where the text is the target's own output *in that context*; a chained answer was
written without the turns before it, so `agreement` measures how often the argmax
and the text agree, inside answers and elsewhere.

What is committed is a recipe (`make_recipe`: record ids and document cuts, a few kB);
`build_records` rebuilds the token ids from the committed responses and the documents.
Chats built from the training split's held-out records (`split_by_hash`, as `dflash-mlx
train` holds them out) form the depth evaluation records.

    python -m dflash_mlx.train.depth_data recipe --target smollm2-135m --out recipe.json
    python -m dflash_mlx.train.depth_data build --target smollm2-135m --recipe recipe.json --run-dir RUN
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from dflash_mlx.documents import QUESTIONS, TRAIN_DOCUMENTS, read_documents

RECIPE_SCHEMA = "dflash-mlx-depth-recipe/1"


def chat_pieces(tokenizer) -> Tuple[List[int], List[int]]:
    """(head, between): the template's tokens before the first user text (system turn
    included), and those between one answer's end-of-turn token and the next user text."""
    from dflash_mlx.loading import apply_chat_template

    text = apply_chat_template(tokenizer, [{"role": "user", "content": "\x01"},
                                           {"role": "assistant", "content": "\x02"},
                                           {"role": "user", "content": "\x03"}])
    head = text.split("\x01")[0]
    between = text.split("\x02")[1].split("\x03")[0]
    return tokenizer.encode(head, add_special_tokens=False), tokenizer.encode(between, add_special_tokens=False)


def chain(records: Sequence[dict], head: Sequence[int], between: Sequence[int], eos: int):
    """One conversation from answered records: (ids, spans of the answers).

    Each record's prompt is `head + user text + assistant header` (the committed
    format); its response ends with the end-of-turn token `eos`, which `between` starts with."""
    ids: List[int] = list(head)
    spans = []
    for i, r in enumerate(records):
        if list(r["prompt"][: len(head)]) != list(head):
            raise ValueError(f"record {r['id']}: its prompt does not start with the chat template's head")
        if i:
            ids.extend(between[1:] if between and between[0] == eos else between)
        ids.extend(r["prompt"][len(head):])
        spans.append([len(ids), len(ids) + len(r["response"])])
        ids.extend(r["response"])
    return ids, spans


def _answered(records: Sequence[dict], eos: int) -> List[dict]:
    return [r for r in records if r.get("finish") == "stop" and r["response"] and r["response"][-1] == eos]


def make_recipe(records: Sequence[dict], tokenizer, n_train_chats: int, n_eval_chats: int,
                doc_cuts: Sequence[int], max_len: int = 8192, min_len: int = 2048, seed: int = 0,
                n_docs: Optional[int] = None) -> dict:
    """Which records form which conversation, and which documents are cut where."""
    from dflash_mlx.train.trainer import split_by_hash

    eos = tokenizer.eos_token_id
    train, held = split_by_hash(_answered(records, eos), 0.03)  # as `dflash-mlx train` splits them
    rng = np.random.default_rng(seed)
    head, between = chat_pieces(tokenizer)
    chats = []
    for split, pool, n in (("train", train, n_train_chats), ("eval", held, n_eval_chats)):
        order = list(rng.permutation(len(pool)))
        for k in range(n):
            target_len = int(rng.integers(min_len, max_len + 1))
            turns, length = [], len(head)
            while order:
                r = pool[order[-1]]
                step = len(r["prompt"]) - len(head) + len(r["response"]) + len(between)
                if length + step > target_len:
                    break
                order.pop()
                turns.append(r["id"])
                length += step
            if not turns:
                break
            chats.append({"id": f"chat:{split}:{k}", "split": split, "turns": turns})
    docs = []
    found, _ = read_documents(TRAIN_DOCUMENTS)
    for d in found[:n_docs]:
        for j, cut in enumerate(doc_cuts):
            q = int(rng.integers(len(QUESTIONS[d.kind])))
            docs.append({"id": f"doc:{d.name}:{cut}:{q}", "split": "train", "document": d.name,
                         "sha256": d.sha256, "tokens": cut, "question": q})
    return {"schema": RECIPE_SCHEMA, "max_len": max_len, "chats": chats, "documents": docs}


def build_records(recipe: dict, records: Sequence[dict], tokenizer) -> Dict[str, List[dict]]:
    """{"train": [...], "eval": [...]} depth records (`prompt`, `response`, `spans`,
    `target_labels`) from a recipe, the committed responses and the documents."""
    from dflash_mlx.loading import apply_chat_template

    by_id = {r["id"]: r for r in records}
    head, between = chat_pieces(tokenizer)
    eos = tokenizer.eos_token_id
    out: Dict[str, List[dict]] = {"train": [], "eval": []}
    for c in recipe["chats"]:
        missing = [t for t in c["turns"] if t not in by_id]
        if missing:
            raise ValueError(f"{c['id']}: records {missing[:3]} are not in the responses given")
        ids, spans = chain([by_id[t] for t in c["turns"]], head, between, eos)
        out[c["split"]].append(_record(c["id"], ids, len(head), spans))
    docs = {d.name: d for d in read_documents(TRAIN_DOCUMENTS)[0]}
    for spec in recipe["documents"]:
        d = docs.get(spec["document"])
        if d is None:
            print(f"depth data: document {spec['document']} is not on this machine; skipped", file=sys.stderr)
            continue
        marker = "\x00DOC\x00"
        text = apply_chat_template(tokenizer, [{"role": "user", "content": marker + "\n\n"
                                                + QUESTIONS[d.kind][spec["question"]]}])
        pre, post = text.split(marker)
        pre_ids = tokenizer.encode(pre, add_special_tokens=False)
        doc_ids = tokenizer.encode(d.text, add_special_tokens=False)[: spec["tokens"] - len(pre_ids) - 40]
        ids = pre_ids + doc_ids + tokenizer.encode(post, add_special_tokens=False)
        out[spec["split"]].append(_record(spec["id"], ids, len(pre_ids),
                                          [[len(pre_ids), len(pre_ids) + len(doc_ids)]]))
    return out


def _record(rid: str, ids: List[int], prompt_len: int, spans) -> dict:
    return {"id": rid, "prompt": ids[:prompt_len], "response": ids[prompt_len:], "spans": spans,
            "target_labels": True}


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


def label(target, recs: Sequence[dict], layer_ids: Sequence[int], feature_dir, log=print) -> dict:
    """Run the target once over each record (features and argmax into the feature cache);
    return the agreement of its argmax with the text, per kind and split."""
    from dflash_mlx.train.trainer import FeatureSource

    src = FeatureSource(target, layer_ids, feature_dir, save_missing=True)
    stats: Dict[str, List[int]] = {}
    import time

    tic = time.perf_counter()
    done = 0
    for r in recs:
        lab = src.labels(r)
        src(r)  # features: cached by the same forward
        done += len(r["prompt"]) + len(r["response"])
        kind = r["id"].split(":")[0] + ":" + ("eval" if ":eval:" in r["id"] else "train")
        for where, (a, n) in agreement(r, lab).items():
            s = stats.setdefault(f"{kind}:{where}", [0, 0])
            s[0] += a
            s[1] += n
        log(f"labelled {r['id']} ({len(r['prompt']) + len(r['response'])} tokens), "
            f"{done / (time.perf_counter() - tic):.0f} tok/s so far")
    return {k: {"agree": a, "positions": n, "rate": a / max(n, 1)} for k, (a, n) in stats.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_mlx.train.depth_data", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recipe", help="choose chains and document cuts (writes a small JSON)")
    r.add_argument("--target", required=True)
    r.add_argument("--responses", default=None, help="packed responses (default: the committed ones)")
    r.add_argument("--out", required=True)
    r.add_argument("--train-chats", type=int, default=12)
    r.add_argument("--eval-chats", type=int, default=3)
    r.add_argument("--doc-cuts", default="6000")
    r.add_argument("--docs", type=int, default=None, help="training documents used (default: all)")
    r.add_argument("--max-len", type=int, default=8192)
    r.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("build", help="token ids of a recipe's records, labelled by one target forward each")
    b.add_argument("--target", required=True)
    b.add_argument("--responses", default=None)
    b.add_argument("--recipe", required=True)
    b.add_argument("--run-dir", required=True, help="writes depth-train.jsonl, depth-eval.jsonl, features/")
    b.add_argument("--layers", default="1,10,18,27", help="target layers to cache features of")
    b.add_argument("--no-label", action="store_true", help="write the records only")
    b.add_argument("--train-limit", type=int, default=None, metavar="N",
                   help="only the recipe's first N training records (labelling costs one target "
                   "forward per token, ~170 tok/s on an idle 2-core CPU)")
    args = p.parse_args(argv)

    from dflash_mlx import load
    from dflash_mlx.train import data as D

    model, tokenizer = load(args.target, quiet=True)
    packed = args.responses or str(Path(__file__).parent / "data" / "smollm2-135m-responses.jsonl.gz")
    records = D.unpack_responses(packed, tokenizer)
    if args.cmd == "recipe":
        cuts = [int(x) for x in args.doc_cuts.split(",") if x]
        recipe = make_recipe(records, tokenizer, args.train_chats, args.eval_chats, cuts, args.max_len,
                             seed=args.seed, n_docs=args.docs)
        Path(args.out).write_text(json.dumps(recipe, indent=1))
        print(f"{len(recipe['chats'])} chats, {len(recipe['documents'])} document cuts -> {args.out}")
        return 0
    from dflash_mlx.target import Target

    recipe = json.loads(Path(args.recipe).read_text())
    built = build_records(recipe, records, tokenizer)
    if args.train_limit is not None:
        built["train"] = built["train"][: args.train_limit]
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    for split, recs in built.items():
        with (run / f"depth-{split}.jsonl").open("w") as f:
            for rec in recs:
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        n = sum(len(x["prompt"]) + len(x["response"]) for x in recs)
        print(f"{split}: {len(recs)} records, {n} tokens", file=sys.stderr)
    if args.no_label:
        return 0
    layer_ids = [int(x) for x in args.layers.split(",")]
    stats = label(Target(model), built["eval"] + built["train"], layer_ids, run / "features",
                  log=lambda s: print(s, file=sys.stderr, flush=True))
    (run / "depth_agreement.json").write_text(json.dumps(stats, indent=1))
    for k, v in sorted(stats.items()):
        print(f"{k}: {v['rate']:.4f} ({v['agree']}/{v['positions']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
