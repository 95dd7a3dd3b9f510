"""z-lab checkpoint format: loads unchanged, fails clearly when broken or mismatched."""

import json

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import load_draft, stream_generate
from dflash_mlx.draft import DraftMismatchError, save_draft
from dflash_mlx.target import Target
from dflash_mlx.testing import EOS_ID, greedy_reference, tiny_target

H, D, NH, NKV, I = 64, 16, 4, 2, 96


def zlab_checkpoint(folder, vocab=300, n_layers=2, layer_ids=(1, 2), extra_cfg=None, seed=0, drop=None, reshape=None):
    """Written by hand with z-lab's exact names and keys (not through our save_draft)."""
    rng = np.random.default_rng(seed)
    w = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32) * 0.05)  # noqa: E731
    ones = lambda n: mx.ones((n,))  # noqa: E731
    weights = {"fc.weight": w(H, len(layer_ids) * H), "hidden_norm.weight": ones(H), "norm.weight": ones(H)}
    for i in range(n_layers):
        p = f"layers.{i}."
        weights.update({
            p + "input_layernorm.weight": ones(H),
            p + "post_attention_layernorm.weight": ones(H),
            p + "self_attn.q_proj.weight": w(NH * D, H),
            p + "self_attn.k_proj.weight": w(NKV * D, H),
            p + "self_attn.v_proj.weight": w(NKV * D, H),
            p + "self_attn.o_proj.weight": w(H, NH * D),
            p + "self_attn.q_norm.weight": ones(D),
            p + "self_attn.k_norm.weight": ones(D),
            p + "mlp.gate_proj.weight": w(I, H),
            p + "mlp.up_proj.weight": w(I, H),
            p + "mlp.down_proj.weight": w(H, I),
        })
    if drop:
        weights.pop(drop)
    if reshape:
        weights[reshape] = weights[reshape][..., :-1]
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": H, "num_hidden_layers": n_layers, "num_attention_heads": NH,
        "num_key_value_heads": NKV, "head_dim": D, "intermediate_size": I, "vocab_size": vocab,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 4096,
        "block_size": 16, "num_target_layers": 4,
        "dflash_config": {"target_layer_ids": list(layer_ids), "mask_token_id": 299},
    }
    cfg.update(extra_cfg or {})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=3)


@pytest.mark.parametrize("extra", [
    {},
    {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}},
    {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
])
def test_zlab_checkpoint_loads_and_is_lossless(tmp_path, target, extra):
    model, tok = target
    extra = dict(extra)
    if "rope_parameters" in extra:
        extra["rope_theta"] = None
    folder = zlab_checkpoint(tmp_path / "d", extra_cfg={k: v for k, v in extra.items() if v is not None})
    draft = load_draft(folder, model)
    assert draft.config.target_layer_ids == [1, 2]
    assert draft.config.mask_token_id == 299
    if "layer_types" in extra:
        assert draft.layers[0].self_attn.window == 8 and draft.layers[1].self_attn.window is None
    prompt = list(range(30, 90))
    ref = greedy_reference(model, prompt, 20, stop_ids=[EOS_ID])
    out = []
    for r in stream_generate(model, draft, tok, prompt, max_tokens=20):
        out += r.tokens
    assert out == ref


def test_rope_parameters_theta_is_read(tmp_path):
    cfg_extra = {"rope_parameters": {"rope_theta": 12345.0}}
    folder = zlab_checkpoint(tmp_path / "d", extra_cfg=cfg_extra)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_theta")
    (folder / "config.json").write_text(json.dumps(cfg))
    model, _ = tiny_target("qwen3", seed=3)
    assert load_draft(folder, model).config.rope_theta == 12345.0


def test_missing_tensor_is_named(tmp_path, target):
    folder = zlab_checkpoint(tmp_path / "d", drop="layers.1.self_attn.k_norm.weight")
    with pytest.raises(DraftMismatchError, match=r"layers\.1\.self_attn\.k_norm\.weight"):
        load_draft(folder, target[0])


def test_misshapen_tensor_is_named(tmp_path, target):
    folder = zlab_checkpoint(tmp_path / "d", reshape="fc.weight")
    with pytest.raises(DraftMismatchError, match=r"fc\.weight.*\(64, 127\).*\(64, 128\)"):
        load_draft(folder, target[0])


def test_corrupt_weights_file(tmp_path, target):
    folder = zlab_checkpoint(tmp_path / "d")
    (folder / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(DraftMismatchError, match="corrupt"):
        load_draft(folder, target[0])


def test_draft_for_another_target(tmp_path, target):
    model = target[0]
    with pytest.raises(DraftMismatchError, match=r"vocab_size 512 .* vocabulary 300"):
        load_draft(zlab_checkpoint(tmp_path / "v", vocab=512), model)
    with pytest.raises(DraftMismatchError, match=r"target_layer_ids \[1, 9\] include \[9\].*4 layers"):
        load_draft(zlab_checkpoint(tmp_path / "l", layer_ids=(1, 9)), model)
    other, _ = tiny_target("qwen3", hidden_size=32, num_attention_heads=2, head_dim=16)
    with pytest.raises(DraftMismatchError, match=r"hidden_size 64 .* hidden size 32"):
        load_draft(zlab_checkpoint(tmp_path / "h"), other)


def test_missing_paths(tmp_path, target):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        (tmp_path / "empty").mkdir()
        load_draft(tmp_path / "empty", target[0])
    with pytest.raises(FileNotFoundError, match="neither a folder"):
        load_draft(str(tmp_path / "nope" / "x" / "y"), target[0])


def test_save_round_trip(tmp_path, target):
    model = target[0]
    folder = zlab_checkpoint(tmp_path / "d", extra_cfg={"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8})
    draft = load_draft(folder, model)
    save_draft(draft, tmp_path / "copy")
    again = load_draft(tmp_path / "copy", model)
    a = dict(__import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(draft.parameters()))
    b = dict(__import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(again.parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)
    assert again.config.to_dict() == draft.config.to_dict()


def test_incremental_injection_equals_one_shot(target):
    """Context injected cycle by cycle (as the engine does) gives the same block logits
    as the whole context at once, on full and sliding-window layers."""
    from dflash_mlx.draft import random_draft

    model = target[0]
    t = Target(model)
    draft = random_draft(t, num_layers=2, block_size=8, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    feats = mx.random.normal((1, 23, len(draft.config.target_layer_ids) * 64))
    last = mx.array([5])
    one = draft.make_cache()
    logits_one = draft.propose_logits(last, feats, one, 8)
    inc = draft.make_cache()
    for s, e in [(0, 4), (4, 5), (5, 17), (17, 23)]:
        draft.inject(feats[:, s:e], inc)
    logits_inc = draft.propose_logits(last, None, inc, 8)
    np.testing.assert_allclose(np.array(logits_one), np.array(logits_inc), rtol=1e-4, atol=1e-4)


def test_hub_id_offline_error(monkeypatch, tmp_path, target):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="offline"):
        load_draft("z-lab/not-a-real-draft-b16", target[0])
