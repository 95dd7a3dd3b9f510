"""`dflash-mlx train --export-for speculators|specforge`: our data and recipe in their formats.

Checked against the trainers' own config loaders where they are installed (a side venv
with torch; skipped in CI), and always against what the files must say: the rows are
our records, the initial draft in speculators' layout is our recipe's initial draft.
"""

import json

import mlx.core as mx
import pytest
import yaml

from dflash_mlx import load_draft
from dflash_mlx.train import export_for
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import tiny_target
from dflash_mlx.train.options import build_parser


@pytest.fixture(scope="module")
def setup():
    model, tok = tiny_target("qwen3", seed=0)
    rng = __import__("random").Random(0)
    records = [{"id": f"gsm8k-train:{i}", "prompt": [rng.randrange(256) for _ in range(12)],
                "response": [rng.randrange(256) for _ in range(30)] + [257], "finish": "stop"} for i in range(6)]
    return model, tok, records


def _args(out, fmt):
    return export_for.add_args(build_parser()).parse_args(
        ["--target", "tiny", "--out", str(out), "--export-for", fmt, "--layers", "2", "--draft-vocab", "64"])


def _export(setup, tmp_path, fmt):
    model, tok, records = setup
    args, target = _args(tmp_path / fmt, fmt), Target(model)
    draft, vocab = export_for.initial_draft(args, target, tok, records)
    (tmp_path / fmt).mkdir()
    write = export_for.write_speculators if fmt == "speculators" else export_for.write_specforge
    write(tmp_path / fmt, args, records, draft, vocab, target, tok, "verifier")
    return args, draft, vocab


def test_speculators_export(setup, tmp_path):
    model, tok, records = setup
    args, draft, vocab = _export(setup, tmp_path, "speculators")
    rows = [json.loads(line) for line in (tmp_path / "speculators" / "data.jsonl").read_text().splitlines()]
    assert [r["input_ids"] for r in rows] == [r["prompt"] + r["response"] for r in records]
    assert all(sum(r["loss_mask"]) == len(rec["response"]) and r["loss_mask"][len(rec["prompt"])] == 1
               for r, rec in zip(rows, records))
    # the initial draft, in speculators' layout, is ours (taps, vocabulary, weights)
    init = load_draft(str(tmp_path / "speculators" / "init"), model)
    assert init.config.target_layer_ids == draft.config.target_layer_ids
    assert init.vocab_ids.tolist() == vocab.tolist()
    from mlx.utils import tree_flatten

    ours, back = dict(tree_flatten(draft.parameters())), dict(tree_flatten(init.parameters()))
    assert sorted(ours) == sorted(back) and all(mx.array_equal(ours[k], back[k]) for k in ours)
    cfg = yaml.safe_load((tmp_path / "speculators" / "train.yaml").read_text())["train"]
    assert cfg["speculator_type"] == "dflash" and cfg["loss"]["loss_fn"] == "ce"
    assert cfg["dflash"] == {"block_size": 16, "dflash_decay_gamma": 7.0, "per_position_loss_weight": "fixed-exp-decay"}
    assert cfg["optimizer"]["lr"] == args.lr and cfg["scheduler"]["scheduler_warmup_ratio"] == args.warmup



def test_specforge_export(setup, tmp_path):
    model, tok, records = setup
    args, draft, vocab = _export(setup, tmp_path, "specforge")
    rows = [json.loads(line) for line in (tmp_path / "specforge" / "data.jsonl").read_text().splitlines()]
    from dflash_mlx.train.data import gsm8k_train_prompts

    questions = {p.id: p.text for p in gsm8k_train_prompts()[:6]}
    assert [r["conversations"][0]["content"] for r in rows] == [questions[r["id"]] for r in records]
    assert rows[0]["conversations"][1]["content"] == tok.decode(records[0]["response"][:-1])
    dcfg = json.loads((tmp_path / "specforge" / "draft_config.json").read_text())
    assert dcfg["dflash_config"]["target_layer_ids"] == draft.config.target_layer_ids
    cfg = json.loads((tmp_path / "specforge" / "specforge.json").read_text())
    assert cfg["training"]["strategy"] == "dflash" and cfg["training"]["loss_decay_gamma"] == 7.0


def test_speculators_own_loader_reads_the_config(setup, tmp_path):
    # speculators' own config loader, where it is installed (a side venv with torch)
    resolution = pytest.importorskip("speculators.train.config.resolution")
    _export(setup, tmp_path, "speculators")
    from speculators.train.config.schema import TrainConfig

    theirs = resolution.build_from_sources(TrainConfig, cli={}, argv=[],
                                           config_path=str(tmp_path / "speculators" / "train.yaml"))
    assert theirs.dflash.dflash_decay_gamma == 7.0 and theirs.draft.from_pretrained == str(tmp_path / "speculators" / "init")


def test_specforge_own_loader_reads_the_config(setup, tmp_path):
    schema = pytest.importorskip("specforge.config.schema")
    args, _, _ = _export(setup, tmp_path, "specforge")
    theirs = schema.Config.from_file(str(tmp_path / "specforge" / "specforge.json"))
    assert theirs.training.num_anchors == args.blocks_per_seq
