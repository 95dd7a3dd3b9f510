"""dflash_mlx/train/gpu/train_torch.py (the recipe on a CUDA machine), at toy scale on the CPU.

Skipped without torch and speculators (CI stays torch-free); run in a side venv with
`pip install torch==2.13.0` (CPU) + `speculators==0.9.0`. Checks: the recipe rules the
script restates equal the library's; the draft it builds, exported in z-lab format,
computes in MLX (`load_draft`) what speculators' model computes in torch; and the whole
script runs end to end (responses, training on the fly, export) into a folder
`load_draft` reads.
"""

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
    assert T.build_vocab(records, 64, 300, always=[257]).tolist() == build_vocab(records, 64, 300, always=[257]).tolist()
    tok = byte_tokenizer()
    assert T.choose_mask_token(tok._tokenizer, records, 300, [257]) == I.choose_mask_token(tok, records, 300)
    held = {r["id"] for r in split_by_hash(records, 0.03)[1]}
    assert {r["id"] for r in records if T.held_out(r["id"])} == held


def test_built_draft_computes_in_mlx_what_it_computes_in_torch(hf_target, tmp_path):
    from mlx_lm.utils import load_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_target, dtype=torch.float32).eval()
    args = T.main.__globals__["argparse"].Namespace(layers=2, block_size=8, shard_mb=15.0)
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
    (feats, last), = T.target_features(model, [tokens], taps, torch.device("cpu"), torch.float32)
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
                   "--draft-vocab", "64", "--steps", "3", "--seq-len", "256", "--log-every", "1",
                   "--device", "cpu"]) == 0
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
