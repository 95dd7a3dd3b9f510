"""z-lab's reference implementation (PyPI `dflash` 0.1.0, `dflash/model_mlx.py`) as a test oracle.

Losslessness holds for any draft, even a wrongly computed one; what decides acceptance
with z-lab's real checkpoints is that our draft computes what they were trained to
compute. So: the same random-weight checkpoints, written to a folder in z-lab's layout,
are loaded by both implementations (the reference through its own loader) and given the
same target features; draft logits must agree within float32 rounding, DFlash 2
candidate choices exactly, and on the embedded SmolLM2 target with the shipped draft
the two engines must accept the same number of tokens every cycle.

Only tests import the reference; the library never does.
"""

import numpy as np
import pytest

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
import mlx.core as mx

ref = pytest.importorskip(
    "dflash.model_mlx",
    reason="z-lab's reference is not installed: pip install --no-deps dflash==0.1.0",
)

from dflash_mlx.models.draft.checkpoints import load_draft, random_draft, save_draft  # noqa: E402
from dflash_mlx.models.target.adapter import Target  # noqa: E402
from dflash_mlx.testing.targets import TINY_CONFIGS, tiny_target  # noqa: E402

RTOL = 1e-5  # max |ours - reference| / max |reference|: float32 rounding, not a formula difference


@pytest.fixture
def reference_loader(monkeypatch):
    """The reference's own `load_draft`, pointed at a local folder instead of the hub."""
    monkeypatch.setattr(ref, "snapshot_download", lambda repo, **kw: repo)

    def load(folder, model):
        draft = ref.load_draft(str(folder))
        draft.set_dtype(mx.float32)  # ours takes the target's dtype (float32 here)
        return draft.bind(model)

    return load


def _relative_error(ours, theirs) -> float:
    ours, theirs = np.array(ours, dtype=np.float64), np.array(theirs, dtype=np.float64)
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def _reference_cycle(theirs, block, features, cache):
    """Logits (and DFlash 2 choices) from the reference for one block, its way."""
    if isinstance(theirs, ref.DFlash2DraftModel):
        # DFlash2DraftModel.propose's body, keeping the logits it scores from.
        hidden = theirs.hidden_states(block, features, cache, logits_start=1)
        logits = theirs.compute_logits(hidden)
        path, _, _ = theirs.candidate_selector.select(hidden, logits, block[:, 0], 0.0)
        return logits, path
    return theirs(block, features, cache, logits_start=1), None


def compare_cycles(ours, theirs, model, prompt, block_size=8, split=5):
    """Two draft cycles as the engine runs them: context = the prompt minus its last
    `split` tokens with the next token as the block's first (the engine's last committed
    token, not in the context yet), then those `split` tokens' context with another token.
    Returns [(our logits, theirs, our choices, their choices)] per cycle (choices None for DFlash 1)."""
    target = Target(model)
    _, features, _ = target.forward(mx.array([prompt]), target.make_cache(), ours.config.target_layer_ids)
    our_cache, their_cache = ours.make_cache(), theirs.make_cache()
    out = []
    for lo, hi in ((0, len(prompt) - split), (len(prompt) - split, len(prompt))):
        last = prompt[hi] if hi < len(prompt) else prompt[0]
        logits = ours.propose_logits(mx.array([last]), features[:, lo:hi], our_cache, block_size)
        chosen = ours.select_tokens(logits) if hasattr(ours, "select_tokens") else None
        block = mx.array([[last] + [ours.config.mask_token_id] * (block_size - 1)])
        their_logits, their_chosen = _reference_cycle(theirs, block, features[:, lo:hi], their_cache)
        out.append((logits, their_logits, chosen, their_chosen))
    return out


PROMPT = [(7 * i + 3) % 256 for i in range(40)]  # longer than every sliding window below

ARCHS = [a for a in TINY_CONFIGS if a != "gemma3_text"]  # Gemma 3: test_gemma3_embedding_scale
VARIANTS = {
    "sliding (causal by default)": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    "sliding, is_causal false": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                                     is_causal=False),
    "is_causal": dict(is_causal=True),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    "final_logit_softcapping": dict(final_logit_softcapping=3.0),
    "input_embedding_scale": dict(input_embedding_scale=1.7),
    "output_multiplier": dict(output_multiplier=0.6),
}


def _check(model, folder, reference_loader, expect_choices):
    ours = load_draft(folder, model)
    theirs = reference_loader(folder, model)
    for logits, their_logits, chosen, their_chosen in compare_cycles(ours, theirs, model, PROMPT):
        assert logits.shape == their_logits.shape
        assert _relative_error(logits, their_logits) < RTOL
        if expect_choices:
            assert chosen.tolist() == their_chosen.tolist()


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_draft_equals_reference_on_every_target_family(tmp_path, reference_loader, arch, version):
    model, _ = tiny_target(arch, seed=1)
    save_draft(random_draft(model, num_layers=2, version=version, seed=1), tmp_path / "d")
    _check(model, tmp_path / "d", reference_loader, expect_choices=version == 2)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_draft_variants_equal_reference(tmp_path, reference_loader, variant, version):
    model, _ = tiny_target("qwen3_5", seed=2)
    draft = random_draft(model, num_layers=2, version=version, seed=2, **VARIANTS[variant])
    save_draft(draft, tmp_path / "d")
    _check(model, tmp_path / "d", reference_loader, expect_choices=version == 2)


def test_rope_parameters_config_equals_reference(tmp_path, reference_loader):
    """Gemma-4-style drafts keep the RoPE base in `rope_parameters` (no top-level rope_theta)."""
    import json

    model, _ = tiny_target("gemma4_text", seed=3)
    save_draft(random_draft(model, num_layers=2, seed=3), tmp_path / "d")
    cfg_file = tmp_path / "d" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("rope_theta")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    cfg_file.write_text(json.dumps(cfg))
    assert load_draft(tmp_path / "d", model).config.rope_theta == 5000.0
    _check(model, tmp_path / "d", reference_loader, expect_choices=False)


def test_dflash2_selector_is_tested_where_it_matters(tmp_path, reference_loader):
    """Guard for the tests above: on these random drafts the selector's choice differs
    from the draft's argmax, so equal choices say something about the selector."""
    model, _ = tiny_target("llama", seed=1)
    save_draft(random_draft(model, num_layers=2, version=2, seed=1), tmp_path / "d")
    ours = load_draft(tmp_path / "d", model)
    (logits, _, chosen, their_chosen), _ = compare_cycles(ours, reference_loader(tmp_path / "d", model), model, PROMPT)
    argmax = mx.argmax(logits, axis=-1)
    assert (chosen != argmax).sum().item() >= 3
    assert chosen.tolist() == their_chosen.tolist()


@pytest.mark.parametrize("version", [1, 2])
def test_gemma3_embedding_scale(tmp_path, reference_loader, version):
    """Deliberate difference. mlx-lm's Gemma 3 multiplies the embedding by sqrt(hidden)
    inline in its forward (no `embed_scale` attribute), so the reference, which looks for
    that attribute, feeds the draft unscaled embeddings. HF's Gemma 3 embedding, the one
    such drafts are trained with, is scaled; we scale. Pinned: we equal the reference
    once its scale is set to Gemma 3's, and differ from it as shipped."""
    model, _ = tiny_target("gemma3_text", seed=1)
    save_draft(random_draft(model, num_layers=2, version=version, seed=1), tmp_path / "d")
    ours = load_draft(tmp_path / "d", model)
    as_shipped = compare_cycles(ours, reference_loader(tmp_path / "d", model), model, PROMPT)
    assert all(_relative_error(o, t) > 0.05 for o, t, _, _ in as_shipped)

    theirs = reference_loader(tmp_path / "d", model)
    assert theirs.embed_scale == 1.0
    hidden = TINY_CONFIGS["gemma3_text"]["hidden_size"]
    theirs.embed_scale = mx.array(hidden**0.5, mx.bfloat16).astype(mx.float32)  # as mlx-lm's Gemma 3
    for logits, their_logits, chosen, their_chosen in compare_cycles(ours, theirs, model, PROMPT):
        assert _relative_error(logits, their_logits) < RTOL
        if version == 2:
            assert chosen.tolist() == their_chosen.tolist()


# ---------------------------------------------------------------------------
# the embedded target with the shipped draft


PROMPTS = ["What is 12 * 7? Explain briefly.", "Write a Python function that reverses a string."]


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2):
    from dflash_mlx.generate import encode_prompt
    from dflash_mlx.models.loading import apply_chat_template

    model, tokenizer = smollm2
    prompts = [encode_prompt(tokenizer, apply_chat_template(tokenizer, p)) for p in PROMPTS]
    return model, tokenizer, prompts


@pytest.fixture(scope="module")
def shipped_draft_for_reference():
    """The shipped draft folder exactly as it ships: the reference's loader reads it
    unchanged (its reduced vocabulary is a .npy file, which that loader skips)."""
    from dflash_mlx.models import packaged

    folder = packaged.packaged_draft_dir("smollm2-135m")
    if folder is None:
        pytest.skip("no draft shipped for smollm2-135m")
    return folder


@pytest.mark.slow
def test_shipped_draft_logits_equal_reference(smollm2_prompts, reference_loader, shipped_draft_for_reference):
    """Also over the reduced draft vocabulary: ours scores only `vocab_ids`, the reference
    (which ignores draft_vocab.npy) everything; the shared columns agree."""
    model, _, prompts = smollm2_prompts
    ours = load_draft("smollm2-135m", model)
    theirs = reference_loader(shipped_draft_for_reference, model)
    vocab_ids = ours.vocab_ids
    assert vocab_ids is not None
    for logits, their_logits, _, _ in compare_cycles(ours, theirs, model, prompts[0], block_size=16):
        assert _relative_error(logits, their_logits[..., vocab_ids]) < RTOL


@pytest.mark.slow
def test_engines_accept_the_same_lengths_on_smollm2(smollm2_prompts, reference_loader, shipped_draft_for_reference):
    """Both engines, block 16, greedy, the shipped draft over the full vocabulary (the
    reference has no reduced vocabulary): same tokens, same accept length every cycle."""
    from dflash_mlx import stream_generate

    model, tokenizer, prompts = smollm2_prompts
    ours = load_draft("smollm2-135m", model)
    ours.set_vocab(None)
    # The reference engine wraps the model's layers for good: give it its own copy (its own
    # modules over the same weight arrays, which nothing changes: no second load).
    their_model = type(model)(model.args)
    their_model.update(model.parameters())
    their_model.eval()
    ids = mx.array([prompts[0]])
    assert mx.array_equal(their_model(ids), model(ids)).item()
    theirs = reference_loader(shipped_draft_for_reference, their_model)
    compared = 0
    for prompt in prompts:
        our_tokens, our_accepts = [], []
        for r in stream_generate(model, ours, tokenizer, prompt, max_tokens=24, block_size=16):
            our_tokens += r.tokens
            if r.accept_length is not None and r.verify_width == 16:
                our_accepts.append(r.accept_length)
        their_tokens, their_accepts = [], []
        for r in ref.stream_generate(their_model, theirs, tokenizer, prompt, block_size=16, max_tokens=24):
            their_tokens += r.tokens
            if r.accepted is not None:
                their_accepts.append(r.accepted - 1)  # it reports committed tokens: accepted + bonus
        assert our_tokens == their_tokens
        # Only full-width cycles: near max_tokens the two engines size the last block differently.
        assert our_accepts == their_accepts[: len(our_accepts)]
        compared += len(our_accepts)
    assert compared >= 10


# -- every architecture of dflash_mlx.testing.archs: tapped features and draft logits ------------

from dflash_mlx.testing.archs import FAMILY_ARCHS, MORE_ARCHS, build  # noqa: E402

# Layouts whose features the reference cannot tap right (ours are checked against mlx-lm's own
# decode in test_families.py); the draft is still compared on our features.
REFERENCE_TAPS_WRONG = {
    "olmo_hybrid": "its layer hooks hide the layer's class, by which OLMo hybrid picks each layer's mask "
                   "(its features come out 0.87 relative off)",
    "plamo2": "its _get_layers expects a list at model.model.layers; PLaMo 2 keeps the list in a decoder module",
}


def _reference_features(key, layer_ids, prompt):
    """The reference's own taps (`_patch_model`: it swaps the layers for hooks for good)
    on a second copy of the same weights."""
    theirs = build(key)
    ref._patch_model(theirs, layer_ids)
    from mlx_lm.models.cache import make_prompt_cache

    theirs(mx.array([prompt]), cache=make_prompt_cache(theirs))
    return mx.concatenate(theirs._hidden_states, axis=-1)


def _reference_draft(folder, model):
    """The reference's draft bound to `model`; where its `bind` cannot find the embedding
    (it looks for `embed_tokens`; Nemotron-H, Mamba 2, RWKV-7 ... name it otherwise), bound
    by hand to the embedding and head ours finds, so the draft's own arithmetic is compared."""
    draft = ref.load_draft(str(folder))
    draft.set_dtype(mx.float32)
    try:
        return draft.bind(model)
    except AttributeError:
        target = Target(model)
        draft.embed_tokens = target.embed_tokens
        draft.embed_scale = draft.config.input_embedding_scale
        draft.lm_head = target._lm_head or target.embed_tokens.as_linear
        return draft


@pytest.mark.parametrize("key", list(FAMILY_ARCHS) + list(MORE_ARCHS))
def test_features_and_draft_equal_reference_on_every_architecture(tmp_path, monkeypatch, key):
    model = build(key)
    draft = random_draft(model, num_layers=2, seed=1)
    layer_ids = draft.config.target_layer_ids
    target = Target(model)
    _, ours, _ = target.forward(mx.array([PROMPT]), target.make_cache(), layer_ids)
    if key not in REFERENCE_TAPS_WRONG:
        theirs = _reference_features(key, layer_ids, PROMPT)
        assert ours.shape == theirs.shape
        assert _relative_error(ours, theirs) < RTOL
    save_draft(draft, tmp_path / "d")
    monkeypatch.setattr(ref, "snapshot_download", lambda repo, **kw: repo)
    mine, theirs = load_draft(tmp_path / "d", model), _reference_draft(tmp_path / "d", model)
    for logits, their_logits, _, _ in compare_cycles(mine, theirs, model, PROMPT):
        assert logits.shape == their_logits.shape
        assert _relative_error(logits, their_logits) < RTOL
