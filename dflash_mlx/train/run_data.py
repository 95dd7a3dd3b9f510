"""The data stage of a `dflash-mlx train` run: the records it trains and evaluates on.

Packed responses (`--data`) are merged into the run folder first, so generation
continues where an earlier machine stopped; generation then skips every prompt
already answered. The records are split into training and held-out ones by id hash
(`split.split_by_hash`: a record never changes side as data grows); deep records
(`--depth-data`, built by train/depth_data.py) join the training records, and
their held-out ones are evaluated apart.
"""

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List

from dflash_mlx.train import data as D
from dflash_mlx.train.packed import pack_responses, unpack_responses
from dflash_mlx.train.split import split_by_hash, split_records


@dataclass
class Records:
    all: List[dict]  # every response of the run folder long enough to train on
    train: List[dict]
    held: List[dict]
    depth_train: List[dict]
    depth_eval: List[dict]


def merge_packed(packed, responses: Path, tokenizer, log):
    """Append the packed records the run does not have yet (generation then skips them)."""
    have = {r["id"] for r in D.read_records(responses)}
    new = [r for r in unpack_responses(packed, tokenizer, log=log) if r["id"] not in have]
    responses.parent.mkdir(parents=True, exist_ok=True)
    with responses.open("a") as f:
        for r in new:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    log(f"merged {len(new)} records from {packed}")


def pack(run, path):
    """`--pack`: the run's responses, compactly (token ids only, committable), into `path`."""
    packed = D.read_records(run.responses)
    n = pack_responses(packed, path)
    run.log(f"packed {len(packed)} records into {path} ({n / 1e6:.1f} MB)")


def generate(run, layer_ids):
    """The target's answers to the default prompts, for up to --gen-minutes; with the
    feature cache on, the tapped features of `layer_ids` are saved as they are computed."""
    args = run.args
    prompts = D.default_prompts(args.gsm8k, args.sharegpt, seed=args.seed, code_first=args.code_first)
    deadline = time.time() + 60 * args.gen_minutes if args.gen_minutes else None
    run.log(f"generating responses for up to {len(prompts)} prompts -> {run.responses}")
    D.generate_responses(
        run.model, run.tokenizer, prompts, run.responses, max_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, batch_size=args.gen_batch, deadline=deadline,
        feature_layers=None if run.feature_dir is None else layer_ids, feature_dir=run.feature_dir,
    )


def read_run_records(run) -> Records:
    """The run folder's records, split; with --overfit, the first N training records are
    both what is trained on and what is evaluated."""
    args, log = run.args, run.log
    records = [r for r in D.read_records(run.responses) if len(r["response"]) >= 2]
    if not records:
        hint = (f"; a grown run brings no data of its own: pass --data <packed file> or copy "
                f"{Path(args.grow_from) / 'responses.jsonl'} there") if args.grow_from else ""
        raise SystemExit(f"no responses in {run.responses}: run without --skip-gen first{hint}")
    train, held = split_by_hash(records, 0.03)
    held = held[:48]
    if not held and len(records) > 1:  # tiny data sets: keep one record aside anyway
        train, held = split_records(records, 1)
    depth_train, depth_eval = depth_records(args.depth_data) if args.depth_data else ([], [])
    if depth_train:
        train = train + depth_train * max(args.depth_repeat, 1)
        log(f"depth data: {len(depth_train)} deep training records (x{max(args.depth_repeat, 1)}), "
            f"{len(depth_eval)} held out")
        if args.max_seq_len < max(len(r["prompt"]) + len(r["response"]) for r in depth_train):
            log(f"note: --max-seq-len {args.max_seq_len} cuts the deep records; 8192 keeps them whole")
    if args.overfit:
        # the check: can the recipe fit exactly what it trains on? (deep records first when given)
        train = (depth_train + train)[: args.overfit]
        held = train
    return Records(records, train, held, depth_train, depth_eval)


def depth_records(folder):
    folder = Path(folder)
    if not (folder / "depth-train.jsonl").exists():
        raise SystemExit(f"--depth-data {folder}: no depth-train.jsonl there; build it with "
                         "`python -m dflash_mlx.train.depth_data build ... --run-dir` first")
    train = D.read_records(folder / "depth-train.jsonl")
    held = D.read_records(folder / "depth-eval.jsonl") if (folder / "depth-eval.jsonl").exists() else []
    return train, held


def follow_responses(run, records: Records):
    """`--follow-data`: a callable returning the training records another process
    appended to the run's responses since the last call (held-out ones left out)."""
    known = {r["id"] for r in records.all}

    def refresh():
        fresh = [r for r in D.read_records(run.responses) if r["id"] not in known and len(r["response"]) >= 2]
        known.update(r["id"] for r in fresh)
        return split_by_hash(fresh, 0.03)[0]

    return refresh
