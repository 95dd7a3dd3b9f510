"""Blending two exported drafts of one layout: exact interpolation, loadable, mismatches refused."""

import json

import dflash_mlx  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx.models.draft.checkpoints import load_draft, random_draft, save_draft
from dflash_mlx.testing.targets import tiny_target
from dflash_mlx.train.blend import blend, main


def _saved(model, path, seed, **kw):
    d = random_draft(model, seed=seed, block_size=4, **kw)
    d.set_vocab(mx.arange(0, 256, 2, dtype=mx.int32))
    save_draft(d, path)
    return dict(tree_flatten(d.parameters()))


def test_blend_interpolates_every_tensor_and_loads(tmp_path):
    model, _ = tiny_target("llama")
    a = _saved(model, tmp_path / "a", 0)
    b = _saved(model, tmp_path / "b", 1)
    out = blend(tmp_path / "a", tmp_path / "b", 0.25, tmp_path / "mix")
    mixed = load_draft(out, model)
    got = dict(tree_flatten(mixed.parameters()))
    compared = [k for k in b if k in got and not k.startswith(("embed", "lm_head"))]  # those are the target's
    assert len(compared) >= 8 and "fc.weight" in compared
    for k in compared:
        np.testing.assert_allclose(np.array(got[k]), 0.75 * np.array(a[k]) + 0.25 * np.array(b[k]), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.array(mixed.vocab_ids), np.arange(0, 256, 2))
    assert "0.75 x" in (out / "README.md").read_text()
    assert not (tmp_path / "mix.tmp").exists()
    ends = blend(tmp_path / "a", tmp_path / "b", 1.0, tmp_path / "end")  # weight 1: the tuned draft
    np.testing.assert_array_equal(np.array(mx.load(str(ends / "model.safetensors"))["fc.weight"]),
                                  np.array(mx.load(str(tmp_path / "b" / "model.safetensors"))["fc.weight"]))


def test_blend_takes_the_tuned_drafts_window(tmp_path):
    model, _ = tiny_target("llama")
    _saved(model, tmp_path / "full", 0)
    _saved(model, tmp_path / "windowed", 1, layer_types=["sliding_attention"], sliding_window=8)
    out = blend(tmp_path / "full", tmp_path / "windowed", 0.5, tmp_path / "mix")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention"] and cfg["sliding_window"] == 8
    assert load_draft(out, model).config.sliding_window == 8


def test_blend_refuses_other_layouts_vocabularies_and_weights(tmp_path, capsys):
    model, _ = tiny_target("llama")
    _saved(model, tmp_path / "a", 0)
    _saved(model, tmp_path / "deeper", 1, num_layers=2)
    with pytest.raises(ValueError, match="differ in .*num_hidden_layers"):
        blend(tmp_path / "a", tmp_path / "deeper", 0.5, tmp_path / "x")
    _saved(model, tmp_path / "b", 1)
    np.save(tmp_path / "b" / "draft_vocab.npy", np.arange(1, 257, 2, dtype=np.int32))
    with pytest.raises(ValueError, match="different draft vocabularies"):
        blend(tmp_path / "a", tmp_path / "b", 0.5, tmp_path / "x")
    assert main([str(tmp_path / "a"), str(tmp_path / "a"), "--weight", "1.5", "--out", str(tmp_path / "x")]) == 2
    assert "give a value in [0, 1]" in capsys.readouterr().err
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "a"), "--weight", "0.5", "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()
