"""Training records with depth: chained conversations and long documents, labelled by the target.

The committed responses are single-turn (~100-token prompts, ~160-token answers), so a
draft trained on them has never seen a position past ~500. Two kinds of deep records:

- **chats**: answered records chained into one multi-turn conversation (the target's
  chat template between turns), up to the target's context window; anchors are drawn
  inside the target's own answers only (`spans`);
- **documents**: a long text from `dflash_mlx.bench.documents.TRAIN_DOCUMENTS` cut to a
  length, then a question; anchors inside the document;
- **answered documents**: the same prompts with the target's own greedy answer after
  them (`answer_documents`: decoded once, with DFlash, which returns the target's own
  tokens, and committed, ~100 tokens each); anchors inside the answer. This is the
  text a summarizer or a code assistant drafts at depth, and the one kind whose labels
  are the target's greedy continuation by construction.

Labels are not generated (decoding at depth runs ~5 tok/s here): one target forward
over the record gives its features and its own argmax after every position
(`target_labels`, `features.target_pass`). Those equal the target's greedy continuation
where the text is the target's own output *in that context*; a chained answer was
written without the turns before it, so `agreement` measures how often the argmax
and the text agree, inside answers and elsewhere.

What is committed is a recipe (`make_recipe`: record ids and document cuts, a few kB);
`build_records` rebuilds the token ids from the committed responses and the documents.
Chats built from the training split's held-out records (`split_by_hash`, as `dflash-mlx
train` holds them out) form the depth evaluation records.

    python -m dflash_mlx.train.depth_data recipe --target smollm2-135m --out recipe.json
    python -m dflash_mlx.train.depth_data answer --target smollm2-135m --out answers.jsonl
    python -m dflash_mlx.train.depth_data build --target smollm2-135m --recipe recipe.json --run-dir RUN
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from dflash_mlx.bench.documents import (
    QUESTIONS, TRAIN_DOCUMENTS, document_prompt, document_prompt_parts, read_documents,
)

RECIPE_SCHEMA = "dflash-mlx-depth-recipe/1"
ANSWER_CUTS = (1024, 3072, 6144)
ANSWER_EVAL_DOCUMENTS = ("statistics.py",)  # answered documents held out for the curves


def chat_pieces(tokenizer) -> Tuple[List[int], List[int]]:
    """(head, between): the template's tokens before the first user text (system turn
    included), and those between one answer's end-of-turn token and the next user text."""
    from dflash_mlx.models.loading import apply_chat_template

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
    from dflash_mlx.train.split import split_by_hash

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
    from dflash_mlx.models.loading import apply_chat_template

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


def answer_plan(docs, tokenizer, cuts: Sequence[int], context: int, max_tokens: int) -> List[dict]:
    """Which (document, length, question) to answer: every cut a document can fill within
    the window (the answer included), questions rotating so each document is asked each."""
    plan = []
    for i, d in enumerate(docs):
        n_doc = len(tokenizer.encode(d.text, add_special_tokens=False))
        fit = sorted({c for c in (min(c, context - max_tokens - 8) for c in cuts) if c <= n_doc})
        for j, cut in enumerate(fit):
            q = (i + j) % len(QUESTIONS[d.kind])
            plan.append({"id": f"answer:{d.name}:{cut}:{q}", "document": d.name, "sha256": d.sha256,
                         "tokens": cut, "question": q,
                         "split": "eval" if d.name in ANSWER_EVAL_DOCUMENTS else "train"})
    return plan


def answer_documents(model, draft, tokenizer, plan: Sequence[dict], max_tokens: int, out: Path,
                     log=print) -> int:
    """Decode the target's greedy answer to each planned prompt, appending one JSON line
    per answer to `out` as it finishes (a rerun skips the ids already there). One prompt
    cache per document, in increasing length: each prompt shares the shorter one's
    document prefix, so a document is prefilled about once. Returns answers written."""
    import time

    from dflash_mlx.generate import make_prompt_cache, stream_generate

    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            try:
                done.add(json.loads(line)["id"])
            except (ValueError, KeyError):
                pass  # a line cut short by an interrupted run is answered again
    docs = {d.name: d for d in read_documents(TRAIN_DOCUMENTS)[0]}
    todo = [p for p in plan if p["id"] not in done]
    cached_doc, cache = None, None
    tic, written, decoded = time.perf_counter(), 0, 0
    with out.open("a") as f:
        for k, spec in enumerate(sorted(todo, key=lambda p: (p["document"], p["tokens"]))):
            d = docs[spec["document"]]
            if d.sha256 != spec["sha256"]:
                raise ValueError(f"{spec['id']}: document {d.name} on this machine is not the planned text")
            ids = document_prompt(tokenizer, d, spec["tokens"], spec["question"])
            if d.name != cached_doc:  # one document's cache alive at a time
                cached_doc, cache = d.name, make_prompt_cache(model, draft)
            tokens, finish = [], "length"
            for r in stream_generate(model, draft, tokenizer, ids, max_tokens=max_tokens, prompt_cache=cache):
                tokens.extend(r.tokens)
                if r.finish_reason:
                    finish = r.finish_reason
            f.write(json.dumps(spec | {"response": tokens, "finish": finish}, separators=(",", ":")) + "\n")
            f.flush()
            written += 1
            decoded += len(tokens)
            el = time.perf_counter() - tic
            log(f"answered {spec['id']} ({len(tokens)} tokens, {finish}) [{k + 1}/{len(todo)}, "
                f"{el:.0f}s, ETA {el / (k + 1) * (len(todo) - k - 1):.0f}s]")
    return written


def answered_records(answers: Sequence[dict], tokenizer) -> Dict[str, List[dict]]:
    """Depth records from committed answers: prompt rebuilt from the document, the answer
    as the response and the one span anchors are drawn from."""
    docs = {d.name: d for d in read_documents(TRAIN_DOCUMENTS)[0]}
    out: Dict[str, List[dict]] = {"train": [], "eval": []}
    for a in answers:
        d = docs.get(a["document"])
        if d is None or d.sha256 != a["sha256"]:
            print(f"depth data: document {a['document']} is not on this machine as answered; skipped",
                  file=sys.stderr)
            continue
        head, body, tail = document_prompt_parts(tokenizer, d, a["tokens"], a["question"])
        ids = head + body + tail
        rec = _record(a["id"], ids + list(a["response"]), len(ids), [[len(ids), len(ids) + len(a["response"])]])
        # one target pass over the document serves every answer to it (`label_shared`)
        rec["prefix_group"], rec["prefix_len"] = a["document"], len(head) + len(body)
        rec["split"] = a["split"]
        out[a["split"]].append(rec)
    return out


def _record(rid: str, ids: List[int], prompt_len: int, spans) -> dict:
    return {"id": rid, "prompt": ids[:prompt_len], "response": ids[prompt_len:], "spans": spans,
            "target_labels": True}


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
    a = sub.add_parser("answer", help="the target's own greedy answers to questions on the training "
                       "documents at depth (one JSON line each, resumable)")
    a.add_argument("--target", required=True)
    a.add_argument("--draft", default=None, help="draft that speeds the decoding (default: the target's packaged one)")
    a.add_argument("--out", required=True)
    a.add_argument("--cuts", default=",".join(map(str, ANSWER_CUTS)), help="prompt lengths")
    a.add_argument("--max-tokens", type=int, default=96)
    a.add_argument("--documents", default=None, help="comma list of training documents to answer (default: all)")
    b = sub.add_parser("build", help="token ids of a recipe's records, labelled by one target forward each")
    b.add_argument("--target", required=True)
    b.add_argument("--responses", default=None)
    b.add_argument("--recipe", required=True)
    b.add_argument("--run-dir", required=True, help="writes depth-train.jsonl, depth-eval.jsonl, features/")
    b.add_argument("--layers", default="1,10,18,27", help="target layers to cache features of")
    b.add_argument("--answers", default=None, metavar="JSONL",
                   help="answered documents (`answer`'s output) to add to the records")
    b.add_argument("--kinds", default="chat,doc,answer",
                   help="which kinds of records to write and label: chat, doc (document cuts), answer")
    b.add_argument("--no-label", action="store_true", help="write the records only")
    b.add_argument("--train-limit", type=int, default=None, metavar="N",
                   help="only the recipe's first N training records (labelling costs one target "
                   "forward per token, ~170 tok/s on an idle 2-core CPU)")
    args = p.parse_args(argv)

    from dflash_mlx import load
    from dflash_mlx.train import data as D
    from dflash_mlx.train.packed import unpack_responses

    model, tokenizer = load(args.target, quiet=True)
    packed = getattr(args, "responses", None) or str(Path(__file__).parent / "data" / "smollm2-135m-responses.jsonl.gz")
    records = unpack_responses(packed, tokenizer)
    if args.cmd == "recipe":
        cuts = [int(x) for x in args.doc_cuts.split(",") if x]
        recipe = make_recipe(records, tokenizer, args.train_chats, args.eval_chats, cuts, args.max_len,
                             seed=args.seed, n_docs=args.docs)
        Path(args.out).write_text(json.dumps(recipe, indent=1))
        print(f"{len(recipe['chats'])} chats, {len(recipe['documents'])} document cuts -> {args.out}")
        return 0
    if args.cmd == "answer":
        from dflash_mlx import load_draft
        from dflash_mlx.models.target.adapter import target_for

        draft = load_draft(args.draft or args.target, model, quiet=True)
        docs = read_documents(TRAIN_DOCUMENTS)[0]
        if args.documents:
            wanted = args.documents.split(",")
            unknown = sorted(set(wanted) - {d.name for d in docs})
            if unknown:
                raise SystemExit(f"--documents: {', '.join(unknown)} not among the training documents here "
                                 f"({', '.join(d.name for d in docs)})")
            docs = [d for d in docs if d.name in wanted]
        context = target_for(model, draft).max_context or 8192
        plan = answer_plan(docs, tokenizer, [int(x) for x in args.cuts.split(",") if x], context, args.max_tokens)
        n = answer_documents(model, draft, tokenizer, plan, args.max_tokens, Path(args.out),
                             log=lambda s: print(s, file=sys.stderr, flush=True))
        print(f"{n} answers -> {args.out}")
        return 0
    from dflash_mlx.models.target.adapter import Target

    recipe = json.loads(Path(args.recipe).read_text())
    built = build_records(recipe, records, tokenizer)
    if args.answers:
        answers = D.read_records(args.answers)
        for split, recs in answered_records(answers, tokenizer).items():
            built[split].extend(recs)
    kinds = set(args.kinds.split(","))
    if kinds - {"chat", "doc", "answer"}:
        raise SystemExit(f"--kinds: {', '.join(sorted(kinds - {'chat', 'doc', 'answer'}))} unknown; "
                         "use chat, doc, answer")
    built = {split: [r for r in recs if r["id"].split(":")[0] in kinds] for split, recs in built.items()}
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
    from dflash_mlx.train.depth_labels import label

    stats = label(Target(model), built["eval"] + built["train"], layer_ids, run / "features",
                  log=lambda s: print(s, file=sys.stderr, flush=True))
    (run / "depth_agreement.json").write_text(json.dumps(stats, indent=1))
    for k, v in sorted(stats.items()):
        print(f"{k}: {v['rate']:.4f} ({v['agree']}/{v['positions']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
