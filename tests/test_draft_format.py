"""z-lab checkpoint format: loads unchanged, fails clearly when broken or mismatched."""

import json

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import load_draft, stream_generate
from dflash_mlx.models.draft.config import DraftMismatchError
from dflash_mlx.models.draft.checkpoints import save_draft
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import EOS_ID, greedy_reference, tiny_target

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
    for r in stream_generate(model, draft, tok, prompt, max_tokens=20, block_size="draft"):
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
    with pytest.raises(FileNotFoundError, match="no such file or folder for the draft"):
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
    from dflash_mlx.models.draft.checkpoints import random_draft

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


@pytest.mark.parametrize("layers", [
    dict(),  # full attention, the whole block visible
    dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6),  # causal window
    dict(layer_types=["sliding_attention"] * 2, sliding_window=9, is_causal=False),
])
def test_rows_with_their_own_contexts_in_one_forward(target, layers):
    """`propose_logits_rows` (the batch engine's one draft forward for its drafting rows):
    rows with contexts of 0-23 tokens, some with features still to inject, give each row
    what `propose_logits` gives it alone."""
    from dflash_mlx.models.draft.checkpoints import random_draft

    draft = random_draft(Target(target[0]), seed=5, num_layers=2, block_size=6, **layers)
    n_feat = len(draft.config.target_layer_ids) * 64
    lengths, pending = [3, 23, 0, 9, 1], [None, 2, 4, None, 1]

    def rows():
        caches, feats = [], []
        for i, (n, p) in enumerate(zip(lengths, pending)):
            cache = draft.make_cache()
            if n:
                draft.inject(mx.random.normal((1, n, n_feat), key=mx.random.key(i)), cache)
            caches.append(cache)
            feats.append(None if p is None else mx.random.normal((1, p, n_feat), key=mx.random.key(50 + i)))
        return caches, feats

    lasts = [mx.array([7 + i]) for i in range(len(lengths))]
    caches, feats = rows()
    assert draft.batches_rows(caches)
    together = draft.propose_logits_rows(lasts, feats, caches, 6)
    caches, feats = rows()
    alone = mx.concatenate([draft.propose_logits(lasts[i], feats[i], caches[i], 6) for i in range(len(lengths))])
    np.testing.assert_allclose(np.array(together), np.array(alone), rtol=1e-4, atol=1e-4)
    assert [c[0].offset for c in caches] == [n + (p or 0) for n, p in zip(lengths, pending)]


def test_dflash2_drafts_propose_row_by_row(target):
    from dflash_mlx.models.draft.checkpoints import random_draft

    draft = random_draft(Target(target[0]), seed=5, num_layers=1, block_size=6, version=2)
    assert not draft.batches_rows([draft.make_cache(), draft.make_cache()])


@pytest.mark.parametrize("context", [4, 23])
def test_a_window_only_matters_past_it(target, context):
    """The same weights with non-causal sliding layers (window 12) propose exactly what
    they propose with full attention while the context fits the window, and differ once
    it does not: a window added to a trained draft leaves short prompts as they were."""
    from dflash_mlx.models.draft.checkpoints import random_draft

    t = Target(target[0])
    full = random_draft(t, seed=3, num_layers=2, block_size=8)
    windowed = random_draft(t, seed=3, num_layers=2, block_size=8, layer_types=["sliding_attention"] * 2,
                            sliding_window=12, is_causal=False)
    windowed.update(full.parameters())
    feats = mx.random.normal((1, context, len(full.config.target_layer_ids) * 64))
    last = mx.array([5])
    a = np.array(full.propose_logits(last, feats, full.make_cache(), 8))
    b = np.array(windowed.propose_logits(last, feats, windowed.make_cache(), 8))
    if context + 8 <= 12:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    else:
        assert np.abs(a - b).max() > 1e-3


def test_hub_id_offline_error(monkeypatch, tmp_path, target):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="offline"):
        load_draft("z-lab/not-a-real-draft-b16", target[0])


# ---------------------------------------------------------------------------
# DFlash 2 (architectures ["DFlash2DraftModel"])

K_CONV, GROUP, RANK, TOP_K = 3, 16, 8, 4


def zlab_dflash2_checkpoint(folder, seed=0, drop=None, cfg=None, kernel=K_CONV, group=GROUP):
    """A DFlash 2 checkpoint by hand, z-lab's names: the DFlash tensors plus per-layer
    `attention_conv`/`mlp_conv` and the candidate selector (bare codebook tensors).
    `kernel`/`group` shape the tensors; `cfg` overrides config keys (to break them)."""
    zlab_checkpoint(folder, seed=seed)
    rng = np.random.default_rng(seed + 1)
    w = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32) * 0.3)  # noqa: E731
    weights = mx.load(str(folder / "model.safetensors"))
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            p = f"layers.{i}.{conv}."
            weights[p + "base_kernel"] = w(2, kernel, H) + mx.zeros((2, kernel, H)).at[:, 0].add(1.0)
            weights[p + "kernel_projection.weight"] = w(2 * kernel * (H // group), H)
    weights["candidate_selector.predecessor_codebook"] = w(300, RANK) * 3
    weights["candidate_selector.successor_codebook"] = w(300, RANK) * 3
    weights["candidate_selector.hidden_projection.weight"] = w(RANK, H)
    if drop:
        weights.pop(drop)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"].update(conv_kernel_size=K_CONV, conv_group_size=GROUP, selector_rank=RANK,
                                   selector_top_k=TOP_K)
    for key, value in (cfg or {}).items():
        if value is None:
            config["dflash_config"].pop(key)
        else:
            config["dflash_config"][key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_dflash2_checkpoint_loads_and_is_lossless(tmp_path):
    from dflash_mlx.models.draft.dflash2 import DFlash2DraftModel

    model, tok = tiny_target("llama", seed=3)
    draft = load_draft(zlab_dflash2_checkpoint(tmp_path / "d"), model)
    assert isinstance(draft, DFlash2DraftModel)
    assert (draft.config.conv_kernel_size, draft.config.conv_group_size) == (K_CONV, GROUP)
    assert (draft.config.selector_rank, draft.config.selector_top_k) == (RANK, TOP_K)
    prompt = list(range(30, 90))
    ref = greedy_reference(model, prompt, 24, stop_ids=[EOS_ID])
    for block_size in (16, 5, "auto"):
        out = []
        for r in stream_generate(model, draft, tok, prompt, max_tokens=24, block_size=block_size):
            out += r.tokens
        assert out == ref, block_size


def test_dflash2_prompt_cache_multi_turn(tmp_path):
    """Second turn through the prompt cache (only the new tokens prefilled) is still exact."""
    from dflash_mlx.generate import make_prompt_cache

    model, tok = tiny_target("llama", seed=3)
    draft = load_draft(zlab_dflash2_checkpoint(tmp_path / "d"), model)
    cache = make_prompt_cache(model, draft)
    turn1 = list(range(30, 70))
    out1 = [t for r in stream_generate(model, draft, tok, turn1, max_tokens=12, prompt_cache=cache, block_size="draft") for t in r.tokens]
    assert out1 == greedy_reference(model, turn1, 12, stop_ids=[EOS_ID])
    turn2 = turn1 + out1 + list(range(100, 110))
    responses = list(stream_generate(model, draft, tok, turn2, max_tokens=12, prompt_cache=cache, block_size="draft"))
    assert [t for r in responses for t in r.tokens] == greedy_reference(model, turn2, 12, stop_ids=[EOS_ID])
    assert responses[-1].prefill_tokens < len(turn2)


@pytest.mark.parametrize("case, match", [
    (dict(drop="candidate_selector.predecessor_codebook"),
     r"missing the tensor 'candidate_selector\.predecessor_codebook'.*codebooks"),
    (dict(drop="layers.1.mlp_conv.base_kernel"), r"layers\.1\.mlp_conv\.base_kernel"),
    (dict(cfg={"conv_group_size": 32}),
     r"kernel_projection\.weight' has shape \(24, 64\), expected \(12, 64\).*conv_group_size"),
    (dict(cfg={"conv_group_size": 24}), r"conv_group_size 24 does not divide hidden_size 64"),
    (dict(cfg={"conv_kernel_size": 4}), r"base_kernel' has shape \(2, 3, 64\), expected \(2, 4, 64\).*conv_kernel_size is 4"),
    (dict(cfg={"selector_top_k": None}), r"dflash_config\.selector_top_k must be a positive integer"),
    (dict(cfg={"selector_rank": 4}), r"codebook' has shape \(300, 8\), expected \(300, 4\)"),
])
def test_malformed_dflash2_checkpoint(tmp_path, target, case, match):
    folder = zlab_dflash2_checkpoint(tmp_path / "d", **case)
    with pytest.raises(DraftMismatchError, match=match):
        load_draft(folder, target[0])


def test_dflash2_random_draft_saves_in_zlab_layout(tmp_path, target):
    from mlx.utils import tree_flatten

    from dflash_mlx.models.draft.checkpoints import random_draft

    model = target[0]
    draft = random_draft(model, num_layers=2, version=2, seed=4)
    save_draft(draft, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"} <= set(cfg["dflash_config"])
    names = set(mx.load(str(tmp_path / "d" / "model.safetensors")))
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "layers.1.attention_conv.base_kernel", "layers.0.mlp_conv.kernel_projection.weight"} <= names
    assert len(names) == 3 + 11 * 2 + 4 * 2 + 3
    again = load_draft(tmp_path / "d", model)
    a, b = dict(tree_flatten(draft.parameters())), dict(tree_flatten(again.parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)
    assert again.config.to_dict() == draft.config.to_dict()


def test_grouped_causal_conv_matches_its_formula():
    """y[t, c] = sum_o (base[o, c] + dynamic[t, o, c // group]) * x[t - o, c], written as loops."""
    from dflash_mlx.models.draft.dflash2 import grouped_causal_conv

    rng = np.random.default_rng(0)
    Bn, L, Hc, Kc, gs = 2, 7, 12, 3, 4
    x = rng.standard_normal((Bn, L, Hc)).astype(np.float32)
    base = rng.standard_normal((Kc, Hc)).astype(np.float32)
    dyn = rng.standard_normal((Bn, L, Kc, Hc // gs)).astype(np.float32)
    want = np.zeros_like(x)
    for b in range(Bn):
        for t in range(L):
            for c in range(Hc):
                for o in range(Kc):
                    if t - o >= 0:
                        want[b, t, c] += (base[o, c] + dyn[b, t, o, c // gs]) * x[b, t - o, c]
    got = grouped_causal_conv(mx.array(x), mx.array(base), mx.array(dyn), gs)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)


def test_dflash2_incremental_injection_and_reduced_vocabulary(target):
    """Cycle-by-cycle injection gives the one-shot logits and choices; a reduced draft
    vocabulary that holds every token (permuted) chooses the same target tokens, so the
    selector's codebooks are read at target ids."""
    from dflash_mlx.models.draft.checkpoints import random_draft

    model = target[0]
    draft = random_draft(model, num_layers=2, block_size=8, version=2, seed=2,
                         layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    feats = mx.random.normal((1, 23, len(draft.config.target_layer_ids) * 64), key=mx.random.key(1))
    last = mx.array([5])
    logits_one = draft.propose_logits(last, feats, draft.make_cache(), 8)
    chosen_one = draft.select_tokens(logits_one)
    inc = draft.make_cache()
    for s, e in [(0, 4), (4, 5), (5, 17), (17, 23)]:
        draft.inject(feats[:, s:e], inc)
    logits_inc = draft.propose_logits(last, None, inc, 8)
    np.testing.assert_allclose(np.array(logits_one), np.array(logits_inc), rtol=1e-4, atol=1e-4)
    assert draft.select_tokens(logits_inc).tolist() == chosen_one.tolist()
    # the selector must matter here, or this test would not see it
    assert chosen_one.tolist() != mx.argmax(logits_one, axis=-1).tolist()

    perm = mx.array(np.random.default_rng(0).permutation(300).astype(np.int32))
    draft.set_vocab(perm)
    logits_perm = draft.propose_logits(last, feats, draft.make_cache(), 8)
    assert draft.to_target_ids(draft.select_tokens(logits_perm)).tolist() == chosen_one.tolist()


def test_select_tokens_needs_a_proposal(target):
    from dflash_mlx.models.draft.checkpoints import random_draft

    draft = random_draft(target[0], version=2)
    with pytest.raises(RuntimeError, match="propose_logits"):
        draft.select_tokens(mx.zeros((1, 7, 300)))


def test_a_dflash2_config_needs_the_dflash2_class(target):
    """Code that builds `DFlashDraftModel(config)` itself (training, export) must not get a
    DFlash 2 draft without its conv and selector; `draft_class` picks the right one."""
    from dflash_mlx.models.draft.dflash import DFlashDraftModel
    from dflash_mlx.models.draft.checkpoints import draft_class, random_draft_config
    from dflash_mlx.models.draft.dflash2 import DFlash2DraftModel, dflash2_defaults

    config = random_draft_config(Target(target[0]), version=2, **dflash2_defaults(64))
    with pytest.raises(DraftMismatchError, match="draft_class"):
        DFlashDraftModel(config)
    assert draft_class(config) is DFlash2DraftModel
    assert isinstance(draft_class(config)(config), DFlash2DraftModel)


def test_neutral_dflash2_is_dflash(tmp_path, target):
    """A DFlash 2 draft with pass-through convs (base taps [1, 0, ...], no dynamic part) and
    zero codebooks computes exactly its DFlash weights' logits, and its selector picks the argmax."""
    from mlx.utils import tree_flatten

    from dflash_mlx.models.draft.checkpoints import random_draft
    from dflash_mlx.models.draft.dflash2 import dflash2_defaults

    model = target[0]
    v1 = random_draft(model, num_layers=2, seed=7)
    v2 = random_draft(model, num_layers=2, seed=8, version=2, **dflash2_defaults(64))
    v2.load_weights(tree_flatten(v1.parameters()), strict=False)
    for layer in v2.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = mx.zeros_like(conv.base_kernel).at[:, 0].add(1.0)
            conv.kernel_projection.weight = mx.zeros_like(conv.kernel_projection.weight)
    sel = v2.candidate_selector
    sel.predecessor_codebook = mx.zeros_like(sel.predecessor_codebook)
    feats = mx.random.normal((1, 20, len(v1.config.target_layer_ids) * 64), key=mx.random.key(3))
    last = mx.array([9])
    a = v1.propose_logits(last, feats, v1.make_cache(), 8)
    b = v2.propose_logits(last, feats, v2.make_cache(), 8)
    assert mx.array_equal(a, b)
    assert v2.select_tokens(b).tolist() == mx.argmax(a, axis=-1).tolist()


def test_library_never_imports_the_reference():
    """z-lab's `dflash` package is a test oracle only: importing every module of the
    library (in a fresh process) must not pull it in."""
    import subprocess
    import sys

    script = (
        "import importlib, pkgutil, sys\n"
        "import dflash_mlx\n"
        "for m in pkgutil.walk_packages(dflash_mlx.__path__, 'dflash_mlx.'):\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except ModuleNotFoundError as e:  # the CUDA-machine script needs torch, absent here\n"
        "        if e.name != 'torch':\n"
        "            raise\n"
        "print(sorted(n for n in sys.modules if n == 'dflash' or n.startswith('dflash.')))\n"
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "[]"
