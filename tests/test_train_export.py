"""Exported drafts load with load_draft and round-trip; `dflash-mlx train` runs end to end."""

import json

import dflash_mlx  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx.models.draft.checkpoints import DRAFT_VOCAB_FILE, load_draft, random_draft
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import tiny_target
from dflash_mlx.train.export import export_draft, model_card


def test_export_round_trips_through_load_draft(tmp_path):
    model, _ = tiny_target("qwen3")
    draft = random_draft(Target(model), num_layers=2, block_size=8, seed=2)
    vocab = mx.array([1, 5, 9, 40, 41, 257, 299], dtype=mx.int32)
    draft.set_vocab(vocab)
    card = model_card({"target": "tiny", "records": 3, "steps": 1, "state": {"draft_config": draft.config.to_dict()},
                       "tau": {"gsm8k": {"tau": 2.5, "prompts": 2, "tokens": 10}}})
    out = export_draft(draft, tmp_path / "d", dtype=mx.float16, card=card)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["README.md", "config.json", DRAFT_VOCAB_FILE, "model.safetensors"]
    assert "| gsm8k | 2 | 10 | 2.50 |" in (out / "README.md").read_text()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8
    stored = mx.load(str(out / "model.safetensors"))
    assert all(v.dtype == mx.float16 for v in stored.values())
    assert len(stored) == 3 + 11 * 2  # z-lab layout: no embedding, no head

    loaded = load_draft(out, model)  # takes the target's dtype (float32)
    assert loaded.config.to_dict() == draft.config.to_dict()
    np.testing.assert_array_equal(np.array(loaded.vocab_ids), np.array(vocab))
    a, b = dict(tree_flatten(draft.parameters())), dict(tree_flatten(loaded.parameters()))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.array(a[k].astype(mx.float16).astype(mx.float32)), np.array(b[k]))
    # exporting the loaded draft again gives byte-identical weights
    again = export_draft(loaded, tmp_path / "d2", dtype=mx.float16)
    s2 = mx.load(str(again / "model.safetensors"))
    for k in stored:
        np.testing.assert_array_equal(np.array(stored[k]), np.array(s2[k]))
    # and it still proposes over the reduced vocabulary
    cache = loaded.make_cache()
    _, feats, _ = loaded.target.forward(mx.array([[3, 4, 5]]), None, loaded.config.target_layer_ids)
    assert loaded.propose_logits(mx.array([6]), feats, cache, 8).shape == (1, 7, 7)


def test_train_cli_end_to_end_and_resume(tmp_path, monkeypatch):
    from dflash_mlx.train import cli

    model, tok = tiny_target("llama")
    monkeypatch.setattr(cli, "load_target", lambda spec: (model, tok))
    out = tmp_path / "draft"
    args = ["--target", "tiny", "--out", str(out), "--gsm8k", "6", "--sharegpt", "0",
            "--max-new-tokens", "12", "--max-prompt-tokens", "400", "--gen-batch", "3",
            "--layers", "1", "--block-size", "4", "--draft-vocab", "100", "--steps", "4",
            "--batch-tokens", "32", "--blocks-per-seq", "4", "--eval-every", "2", "--tau-prompts", "0"]
    assert cli.main(args) == 0
    run = tmp_path / "draft.run"
    assert len((run / "responses.jsonl").read_text().splitlines()) == 6
    assert len(list((run / "features").glob("*.npy"))) == 6
    assert (run / "training_curve.png").stat().st_size > 1000
    state = json.loads((run / "checkpoint" / "state.json").read_text())
    assert state["step"] == 4 and len(state["evals"]) == 2
    draft = load_draft(out, model)
    assert draft.vocab_ids.size == 100 and draft.config.block_size == 4
    assert (out / "training_curve.png").exists() and "4 steps" in (out / "README.md").read_text()
    # more steps with --resume: continues from step 4 without regenerating
    more = [a if a != "4" or args[i - 1] != "--steps" else "6" for i, a in enumerate(args)]
    assert cli.main(more + ["--resume", "--skip-gen"]) == 0
    state = json.loads((run / "checkpoint" / "state.json").read_text())
    assert state["step"] == 6 and [h["step"] for h in state["history"]] == [4, 6]
    legs = state["legs"]
    assert [(g["start_step"], g["end_step"], g["schedule_steps"]) for g in legs] == [(0, 4, 4), (4, 6, 6)]
    assert legs[1]["start_lr"] > legs[0]["end_lr"]  # the stretched cosine starts higher up again
    card = (out / "README.md").read_text()
    assert "steps 1-4:" in card and "steps 5-6:" in card and "cosine to 6 steps" in card
    assert len((run / "responses.jsonl").read_text().splitlines()) == 6


def test_train_cli_grows_a_trained_run(tmp_path, monkeypatch):
    from dflash_mlx.train import cli

    model, tok = tiny_target("llama")
    monkeypatch.setattr(cli, "load_target", lambda spec: (model, tok))
    base = ["--target", "tiny", "--gsm8k", "6", "--sharegpt", "0", "--max-new-tokens", "12",
            "--max-prompt-tokens", "400", "--gen-batch", "3", "--block-size", "4", "--draft-vocab", "100",
            "--batch-tokens", "32", "--blocks-per-seq", "4", "--eval-every", "2", "--tau-prompts", "0"]
    small = tmp_path / "small.run"
    assert cli.main(base + ["--out", str(tmp_path / "small"), "--layers", "1", "--steps", "4"]) == 0
    with pytest.raises(SystemExit, match="not a training run folder"):
        cli.main(base + ["--out", str(tmp_path / "x"), "--grow-from", str(tmp_path / "small"), "--layers", "2"])
    with pytest.raises(SystemExit, match="--layers"):
        cli.main(base + ["--out", str(tmp_path / "y"), "--grow-from", str(small), "--layers", "0"])
    with pytest.raises(SystemExit, match="a grown run brings no data"):
        cli.main(base + ["--out", str(tmp_path / "z"), "--grow-from", str(small), "--layers", "2", "--skip-gen"])
    run = tmp_path / "big.run"
    run.mkdir()
    (run / "responses.jsonl").write_text((small / "responses.jsonl").read_text())
    args = base + ["--out", str(tmp_path / "big"), "--run-dir", str(run), "--grow-from", str(small),
                   "--layers", "3", "--steps", "2", "--skip-gen", "--dropout", "0.1"]
    assert cli.main(args) == 0
    logged = (run / "train.log").read_text()
    assert "grown from" in logged and "Adam moments of" in logged
    grown = load_draft(tmp_path / "big", model)
    first = load_draft(tmp_path / "small", model)
    assert grown.config.num_hidden_layers == 3
    assert grown.config.target_layer_ids == first.config.target_layer_ids
    np.testing.assert_array_equal(np.array(grown.vocab_ids), np.array(first.vocab_ids))
    np.testing.assert_array_equal(np.load(run / "feature_scale.npy"), np.load(small / "feature_scale.npy"))
    # a second call resumes the grown run like any other (its own config and checkpoint)
    assert cli.main([a if a != "2" else "3" for a in args] + ["--resume"]) == 0
    assert json.loads((run / "checkpoint" / "state.json").read_text())["step"] == 3


def test_measure_tau_pools_engine_cycles():
    from dflash_mlx.bench.suites import format_prompt, load_suite
    from dflash_mlx.generate import encode_prompt as encode
    from dflash_mlx.testing.targets import ScriptedDraft, greedy_reference
    from dflash_mlx.train.evaluate import measure_tau

    model, tok = tiny_target("llama")
    p = load_suite("gsm8k", limit=1)[0]
    ids = encode(tok, format_prompt(tok, p))
    ref = ids + greedy_reference(model, ids, 13, stop_ids=tok.eos_token_ids)
    oracle = ScriptedDraft(Target(model), ref, wrong_from=lambda c: 10**9, block_size=4)
    out = measure_tau(model, tok, oracle, suites=("gsm8k",), limit=1, max_tokens=13, block_size=4)
    # 13 tokens: the prefill's token, then 3 full blocks of 4 -> tau 4
    assert out["gsm8k"]["tokens"] == 13 and out["gsm8k"]["tau"] == 4.0 and out["gsm8k"]["cycles"] == 3


def test_train_cli_export_only_measures_tau_into_the_card(tmp_path, monkeypatch):
    from dflash_mlx.train import cli

    model, tok = tiny_target("qwen3")
    monkeypatch.setattr(cli, "load_target", lambda spec: (model, tok))
    out = tmp_path / "draft"
    base = ["--target", "tiny", "--out", str(out), "--gsm8k", "3", "--sharegpt", "0",
            "--max-new-tokens", "10", "--max-prompt-tokens", "400", "--layers", "1", "--block-size", "4",
            "--draft-vocab", "0", "--steps", "2", "--batch-tokens", "16", "--blocks-per-seq", "2"]
    assert cli.main(base + ["--tau-prompts", "0"]) == 0
    assert "Measured tau" not in (out / "README.md").read_text()
    # this call's own training flags differ: the card must still say how the draft was trained
    other = [("999" if a == "16" else a) for a in base]
    assert cli.main(other + ["--skip-gen", "--resume", "--export-only", "--tau-prompts", "1",
                             "--tau-max-tokens", "6", "--tau-suites", "gsm8k", "--lr", "0.5"]) == 0
    card = (out / "README.md").read_text()
    assert "## Measured tau (engine, greedy, block size 4)" in card and "| gsm8k | 1 |" in card
    assert "16 block tokens per step" in card and "lr 0.5" not in card
    state = json.loads((tmp_path / "draft.run" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 2  # export-only trained nothing more
    assert not (out / DRAFT_VOCAB_FILE).exists()  # full vocabulary: no extra file


def test_model_card_of_a_continued_windowed_draft_says_so():
    dcfg = {"layer_types": ["sliding_attention"] * 2, "sliding_window": 2048, "num_hidden_layers": 2}
    card = model_card({"target": "t", "init": "target", "init_from": "smollm2-135m", "records": 10,
                       "depth_records": 30, "depth_tokens": 100_000, "depth_repeat": 180,
                       "state": {"draft_config": dcfg}})
    assert "continued from the exported draft `smollm2-135m`" in card
    assert "initialised from the target" not in card
    assert "30 deep records (100000 tokens, each 180x per epoch" in card
    assert "sliding_attention, sliding_attention, window 2048" in card
    plain = model_card({"target": "t", "init": "target", "state": {"draft_config": {}}})
    assert "initialised from the target" in plain and "deep records" not in plain


def test_model_card_thins_long_held_out_curves():
    from dflash_mlx.train.export import thin

    evals = [{"step": 50 * i, "tokens": 1000 * i, "val_loss": 6.0 - i / 100, "val_acc": i / 100,
              "val_tau_hat": 1 + i / 100} for i in range(1, 85)]
    kept = thin(evals, 30)
    assert len(kept) == 30 and kept[0] is evals[0] and kept[-1] is evals[-1]
    assert [e["step"] for e in kept] == sorted({e["step"] for e in kept})
    card = model_card({"target": "t", "state": {"evals": evals, "draft_config": {}}})
    rows = [line for line in card.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 30 and rows[-1].startswith("| 4200 |")
    assert thin(evals[:5], 30) == evals[:5]


def test_tau_trend_recovers_a_log_linear_curve(tmp_path):
    from dflash_mlx.train.evaluate import tau_trend, tokens_for_tau
    from dflash_mlx.train.curves import plot_curves

    pts = [{"tokens": 2**k, "tau": 0.2 + 0.05 * k} for k in range(15, 22)] + [{"tokens": 1000, "tau": 3.0}]
    trend = tau_trend(pts, min_tokens=2**15)
    assert trend["n"] == 7
    assert abs(trend["per_doubling"] - 0.05) < 1e-9 and abs(trend["intercept"] - 0.2) < 1e-9
    assert abs(tokens_for_tau(trend, 1.5) - 2**26) / 2**26 < 1e-6
    assert tau_trend(pts[:2]) is None
    assert tokens_for_tau({"per_doubling": -0.01, "intercept": 1.0}, 2.0) == float("inf")
    plot_curves({"history": [], "evals": []}, tmp_path / "curve.png", pts)
    assert (tmp_path / "curve.png").stat().st_size > 10_000
    ev = {"tokens": 10, "val_loss": 3.0, "val_acc": 0.2, "val_tau_hat": 1.8}
    deep = {"val_loss": 4.0, "val_acc": 0.1, "val_tau_hat": 1.6}
    drawn = plot_curves({"history": [], "evals": [ev | {"depth": deep}, ev | {"tokens": 20}]}, tmp_path / "c2.png")
    assert all("held-out, deep" in panel for panel in drawn[:3]) and "held-out" in drawn[0]


def test_tau_prompts_per_suite():
    from dflash_mlx.train import options

    parse = lambda *a: options.build_parser().parse_args(["--target", "t", "--out", "o", *a]).tau_prompts  # noqa: E731
    assert parse() == {"*": 4}
    assert parse("--tau-prompts", "0") == {"*": 0}
    assert parse("--tau-prompts", "gsm8k=20,humaneval=6") == {"gsm8k": 20, "humaneval": 6}
    from dflash_mlx.cli.common import CLIError

    with pytest.raises(CLIError, match="suite=number"):
        parse("--tau-prompts", "gsm8k=many")
