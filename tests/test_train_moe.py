"""The training recipe on MoE and hybrid targets (dflash_mlx/train/init.py, cli.py, data.py):
target initialisation copies what has a counterpart (attention, norms) and leaves the rest
random (a sparse MoE block has no dense MLP to copy, a Gated DeltaNet layer no attention),
`--overfit` learns, and an export loads back and decodes exactly the target's greedy output."""

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)
import numpy as np
import pytest

from dflash_mlx import stream_generate
from dflash_mlx.testing import archs
from dflash_mlx.models.draft.checkpoints import load_draft
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import byte_tokenizer, greedy_reference, tiny_target
from dflash_mlx.train import cli
from dflash_mlx.train import data as D
from dflash_mlx.train import init as I
from dflash_mlx.train.features import FeatureSource

MAX_NEW = 24
BASE = ["--target", "tiny", "--gsm8k", "4", "--sharegpt", "0", "--max-new-tokens", str(MAX_NEW),
        "--max-prompt-tokens", "400", "--gen-batch", "4", "--layers", "2", "--block-size", "4",
        "--draft-vocab", "100", "--batch-tokens", "32", "--blocks-per-seq", "4", "--tau-prompts", "0"]


class _Log:
    """Collects what the CLI prints to stderr."""

    def __init__(self):
        self.parts = []

    def write(self, s):
        self.parts.append(s)

    def flush(self):
        pass

    def text(self):
        return "".join(self.parts)


def _trained_run(key, tmp_path_factory, steps):
    """(model, tokenizer, folder, log): the CLI generates the target's greedy responses to 4
    GSM8K prompts, trains `steps` steps and exports the draft to `folder` (run: folder.run)."""
    model, tok = archs.build(key, seed=1), byte_tokenizer()
    d = tmp_path_factory.mktemp(key)
    log = _Log()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "load_target", lambda spec: (model, tok))
        mp.setattr(cli.sys, "stderr", log)
        assert cli.main(BASE + ["--out", str(d / "draft"), "--steps", str(steps), "--lr", "3e-3"]) == 0
    return model, tok, d / "draft", log.text()


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    return _trained_run("qwen3_moe", tmp_path_factory, steps=40)


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    return _trained_run("qwen3_next", tmp_path_factory, steps=20)


def _overfit(model, tok, run_dir, out, monkeypatch, n=2, steps=60):
    """Runs `--overfit n` through the CLI on `run_dir`'s records; (report, before, after, positions)."""
    log = _Log()
    monkeypatch.setattr(cli, "load_target", lambda spec: (model, tok))
    monkeypatch.setattr(cli.sys, "stderr", log)
    assert cli.main(BASE + ["--out", str(out), "--run-dir", str(run_dir), "--skip-gen", "--overfit", str(n),
                            "--steps", str(steps), "--lr", "3e-3"]) == 0
    report = log.text()
    assert f"overfit check: {n} sequences, {steps} steps" in report
    before, after = (float(x) for x in report.split("top-1 ")[1].split()[0:3:2])
    lines = report.split("overfit check")[1].splitlines()
    pos = {ln.split()[0]: [float(x) for x in ln.split()[1:]] for ln in lines if ln.strip().startswith(("before", "after"))}
    return report, before, after, pos


def _records(run_dir):
    return D.read_records(run_dir / "responses.jsonl")


def _assert_varied(records):
    """The target's greedy responses are not a constant run (else the checks are vacuous)."""
    assert len(records) == 4
    for r in records:
        assert len(r["response"]) == MAX_NEW
        assert len(set(r["response"])) >= 5, r["response"]
    assert len({tuple(r["response"]) for r in records}) == len(records)


# ---- MoE target (Qwen3-MoE: every layer's MLP is a sparse MoE block) --------------------------


def test_init_on_an_moe_target_copies_attention_and_leaves_the_moe_mlp_random():
    model = archs.build("qwen3_moe", seed=1)
    target, tok = Target(model), byte_tokenizer()
    recs = [{"id": "a", "prompt": list(range(10, 30)), "response": greedy_reference(model, list(range(10, 30)), 16)}]
    cfg = I.make_draft_config(target, tok, recs, 2, 4, "target")
    draft, _, done = I.make_draft(cfg, target, recs, FeatureSource(target, cfg.target_layer_ids))
    assert done["copied_layers"] == [2, 3] and done["passthrough_tap"] == 1
    assert done["no_dense_mlp"] == [0, 1] and "no_attention" not in done
    assert set(done["skipped"]) == {f"layers.{i}.mlp.{p}_proj.weight" for i in (0, 1) for p in ("gate", "up", "down")}
    src = model.model.layers[2]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
        np.testing.assert_array_equal(np.array(getattr(draft.layers[0].self_attn, name).weight),
                                      np.array(getattr(src.self_attn, name).weight))


def test_overfit_check_on_an_moe_target_learns(moe_run, tmp_path, monkeypatch):
    model, tok, folder, train_log = moe_run
    assert "MLP random in draft layers [0, 1]" in train_log
    run_dir = folder.parent / (folder.name + ".run")
    _assert_varied(_records(run_dir))
    report, before, after, pos = _overfit(model, tok, run_dir, tmp_path / "o", monkeypatch)
    # measured: loss 4.69 -> 1.40, top-1 0.000 -> 0.542, per position (1..3) 0.00 0.00 0.00 -> 0.50 0.50 0.62
    assert before < 0.1 and after > before + 0.3, report
    assert len(pos["after"]) == 3 and min(pos["after"]) > 0.1, report


@pytest.mark.parametrize("run", ["moe_run", "hybrid_run"])
def test_a_draft_trained_on_the_target_loads_back_and_is_exact(run, request):
    model, tok, folder, _ = request.getfixturevalue(run)
    draft = load_draft(folder, model)
    eos = list(tok.eos_token_ids)
    accepted = 0
    for rec in _records(folder.parent / (folder.name + ".run"))[:2]:
        ref = greedy_reference(model, rec["prompt"], MAX_NEW, stop_ids=eos)
        out = list(stream_generate(model, draft, tok, rec["prompt"], max_tokens=MAX_NEW, block_size="draft"))
        assert [t for r in out for t in r.tokens] == ref
        accepted += sum(out[-1].accept_lengths)
    # it learnt something from a few steps on these very records (measured: 17 drafted tokens
    # accepted on the MoE target after 40 steps, 5 on the hybrid one after 20: partial accepts
    # there roll the Gated DeltaNet states back)
    assert accepted > 0


# ---- hybrid target (Qwen3-Next: Gated DeltaNet layers 0, 2; attention layers 1, 3; MoE MLPs) ----


def test_init_on_a_hybrid_target_picks_attention_layers_and_survives_layers_without_one():
    model = archs.build("qwen3_next", seed=1)
    target, tok = Target(model), byte_tokenizer()
    assert I.target_copy_layers(target, 1) == [3]
    assert I.target_copy_layers(target, 2) == [1, 3]  # the default, [2, 3], has a Gated DeltaNet layer
    recs = [{"id": "a", "prompt": list(range(10, 30)), "response": greedy_reference(model, list(range(10, 30)), 16)}]
    cfg = I.make_draft_config(target, tok, recs, 2, 4, "target")
    assert 0 in cfg.target_layer_ids  # feeds the first copied layer, 1
    draft, _, done = I.make_draft(cfg, target, recs, FeatureSource(target, cfg.target_layer_ids))
    assert done["copied_layers"] == [1, 3] and done["passthrough_tap"] == 0 and "no_attention" not in done
    # the copy layers given explicitly: layer 2 has no attention, so draft layer 0's stays random
    cfg = I.make_draft_config(target, tok, recs, 2, 4, "target", copy_layers=[2, 3])
    draft, _, done = I.make_draft(cfg, target, recs, FeatureSource(target, cfg.target_layer_ids), copy_layers=[2, 3])
    assert done["no_attention"] == [0] and done["no_dense_mlp"] == [0, 1]
    assert {f"layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")} \
        <= set(done["skipped"])
    # gated attention: q_proj also makes the gate (twice the rows), so only k/v/o and the norms match
    assert "layers.1.self_attn.q_proj.weight" in done["skipped"]
    np.testing.assert_array_equal(np.array(draft.layers[1].self_attn.k_proj.weight),
                                  np.array(model.model.layers[3].self_attn.k_proj.weight))
    np.testing.assert_array_equal(np.array(draft.layers[0].input_layernorm.weight),
                                  np.array(model.model.layers[2].input_layernorm.weight))


def test_overfit_check_on_a_hybrid_target_learns(hybrid_run, tmp_path, monkeypatch):
    model, tok, folder, train_log = hybrid_run
    assert "initialised from the target: layers [1, 3]" in train_log
    run_dir = folder.parent / (folder.name + ".run")
    recs = _records(run_dir)
    _assert_varied(recs)
    # batched, left-padded generation keeps the recurrent layers exact
    assert recs[0]["response"] == greedy_reference(model, recs[0]["prompt"], MAX_NEW)
    report, before, after, pos = _overfit(model, tok, run_dir, tmp_path / "o", monkeypatch)
    # measured: loss 4.91 -> 2.88, top-1 0.000 -> 0.458, per position (1..3) 0.00 0.00 0.00 -> 0.38 0.38 0.62
    assert before < 0.1 and after > before + 0.25, report
    assert len(pos["after"]) == 3 and min(pos["after"]) > 0.1, report


def test_dense_targets_still_copy_their_last_layers():
    model, _ = tiny_target("llama")
    target = Target(model)
    for n in (1, 2, 3):
        assert I.target_copy_layers(target, n) == I.default_copy_layers(target.num_layers, n)
