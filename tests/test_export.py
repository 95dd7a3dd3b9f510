"""`dflash-mlx export`: the folder it writes is a standard mlx-lm model."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load

from dflash_mlx.cli import export
from dflash_mlx.models.loading import load
from gguf_helpers import load_packaged, write_tiny_gguf


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def same_model(a, tok_a, b, tok_b, text):
    ids = tok_a.encode(text)
    assert tok_b.encode(text) == ids
    assert set(tok_b.eos_token_ids) == set(tok_a.eos_token_ids)
    la = np.array(a(mx.array([ids]))[0].astype(mx.float32))
    lb = np.array(b(mx.array([ids]))[0].astype(mx.float32))
    return la, lb


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_export_roundtrip_through_mlx_lm(tmp_path, arch, capsys):
    src = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(src, arch)
    out = tmp_path / "out"
    assert export.main([str(src), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (out / "config.json").exists() and list(out.glob("*.safetensors"))
    assert (out / "tokenizer.json").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == {"llama": "llama", "gemma3": "gemma3_text"}[arch]

    ours, tok = load(str(src), quiet=True)
    theirs, their_tok = mlx_lm_load(str(out))
    la, lb = same_model(ours, tok, theirs, their_tok, "the cat sat on the mat")
    np.testing.assert_array_equal(la, lb)  # same f32 weights, same model class
    # and our loader reads the exported folder back too
    again, _ = load(str(out))
    np.testing.assert_array_equal(np.array(again(mx.array([[1, 2, 3]]))), np.array(ours(mx.array([[1, 2, 3]]))))


def test_export_dtype(tmp_path):
    src = tmp_path / "m.gguf"
    write_tiny_gguf(src, "llama")
    assert export.main([str(src), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    model, _ = mlx_lm_load(str(tmp_path / "bf16"))
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16


def test_export_refuses_non_empty_folder(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert export.main(["smollm2-135m", str(out)]) == 1
    assert "not an empty folder" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"


def test_export_unknown_model(tmp_path, capsys):
    assert export.main(["nope-model", str(tmp_path / "o")]) == 1
    assert "unknown model" in capsys.readouterr().err


@pytest.mark.slow
def test_export_smollm2_chat_template_and_logits(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME")
    model, tok = load_packaged("smollm2-135m")
    out = export.export_model(model, tok, tmp_path / "smollm2")
    theirs, their_tok = mlx_lm_load(str(out))
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert their_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    la, lb = same_model(model, tok, theirs, their_tok, "The capital of France is Paris.")
    np.testing.assert_allclose(la, lb, atol=1e-4)


def test_export_refuses_rope_freqs_model(tmp_path, capsys):
    src = tmp_path / "m.gguf"
    write_tiny_gguf(src, "llama", rope_freqs=np.linspace(1.0, 8.0, 8))
    assert export.main([str(src), str(tmp_path / "out")]) == 1
    assert "rope_freqs" in capsys.readouterr().err


def test_quantized_folder_cast_on_cpu_or_kept(tmp_path, monkeypatch):
    """An mlx-lm folder with 4-bit weights: float parts follow the dtype policy,
    DFLASH_MLX_DTYPE=keep leaves everything as stored."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    src = tmp_path / "m.gguf"
    write_tiny_gguf(src, "llama", hidden_size=64, intermediate_size=128)
    model, tok = load(str(src), quiet=True)
    config = export.model_config_dict(model, tok)
    model.set_dtype(mx.bfloat16)
    model, config = quantize_model(model, config, group_size=32, bits=4)
    out = tmp_path / "q4"
    save_model(out, model)
    save_config(config, out / "config.json")
    tok._tokenizer.save_pretrained(out)

    cast, _ = load(str(out))
    layer = cast.model.layers[0].self_attn.q_proj
    assert layer.weight.dtype == mx.uint32 and layer.scales.dtype == mx.float32
    ids = mx.array([[1, 2, 3, 4]])
    ref = np.array(model(ids).astype(mx.float32))
    np.testing.assert_allclose(np.array(cast(ids)), ref, atol=0.1 * np.abs(ref).max())
    monkeypatch.setenv("DFLASH_MLX_DTYPE", "keep")
    kept, _ = load(str(out))
    assert kept.model.layers[0].self_attn.q_proj.scales.dtype == mx.bfloat16
