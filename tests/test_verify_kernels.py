"""The kernels wired into the engine's verify step, end to end.

On this machine the kernels' Metal path cannot run, so these tests switch the
engine onto it and execute the very kernel sources through the Linux
Metal-compat harness (tests/metal_compat): greedy output must still equal
plain mlx-lm greedy decoding token for token, with partial accepts that make
every rollback path run. The same tests on the reference path pin the twins.
"""

import importlib.util
import random
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx import stream_generate
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.kernels import context_kv, gdn, qmm, selection
from dflash_mlx.models.target.rollback import GDNTape
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import ScriptedDraft, clean_case, tiny_target

_spec = importlib.util.spec_from_file_location(
    "dflash_metal_compat_driver_verify", Path(__file__).parent / "metal_compat" / "driver.py"
)
driver = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(driver)

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal-compat harness")


def emulate(monkeypatch, names):
    """Run kernels `names` through their Metal path, executed by the compat harness; count launches."""
    calls = {n: 0 for n in names}
    monkeypatch.setattr(selection, "use_metal", lambda name: name in names)
    for name in names:
        fn_name = {"kv_inject": "context_kv_metal"}.get(name, f"{name}_metal")
        family = {"kv_inject": context_kv, "qmm_small_m": qmm}.get(name, gdn)
        original = getattr(family, fn_name)

        def counted(*args, _name=name, _fn=original, **kw):
            calls[_name] += 1
            return _fn(*args, factory=driver.metal_kernel, **kw)

        monkeypatch.setattr(family, fn_name, counted)
    return calls


def decode_with_partial_accepts(model, tok, prompt, ref, block_size, seed):
    rng = random.Random(seed)
    wrong = [rng.randrange(0, block_size) for _ in range(200)]
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: wrong[c], block_size=block_size)
    out, accepts = [], []
    for r in stream_generate(model, draft, tok, prompt, max_tokens=len(ref), stop_token_ids=[], block_size="draft"):
        out += r.tokens
        accepts = r.accept_lengths
    return out, accepts


# ----------------------------------------------------------- Gated DeltaNet


def test_taped_verify_forward_matches_mlx_lm():
    """The taped token mixer gives mlx-lm's hidden states and caches; the tape holds one entry per step."""
    model, _ = tiny_target("qwen3_5", seed=3)
    target = Target(model)
    prompt, block = mx.array([list(range(3, 40))]), mx.array([[7, 9, 11, 2, 5, 8]])
    plain, taped = target.make_cache(), target.make_cache()
    target.forward(prompt, plain)
    target.forward(prompt, taped)
    h_plain, _, none = target.forward(block, plain)
    h_taped, _, record = target.forward(block, taped, record=True)
    assert none is None
    np.testing.assert_allclose(np.array(h_taped), np.array(h_plain), rtol=1e-5, atol=1e-5)
    assert sorted(record.gdn) == target._gdn_layers and target._gdn_layers
    for idx, tape in record.gdn.items():
        assert isinstance(tape, GDNTape)
        assert tape.deltas.shape[:2] == tape.k.shape[:2] == (1, 6)
        assert tape.conv_input.shape[1] == 6 + target.args.linear_conv_kernel_dim - 1
        for a, b in zip(plain[idx].cache, taped[idx].cache):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)
    # scoped: the model's own mixers are back
    assert all(type(target.text_model.layers[i].linear_attn).__name__ == "GatedDeltaNet"
               for i in target._gdn_layers)


def test_gdn_rollback_is_replay_not_forward(monkeypatch):
    """A partial accept rebuilds the state from the tape: no target layer runs again."""
    model, _ = tiny_target("qwen3_5", seed=3)
    target = Target(model)
    cache = target.make_cache()
    target.forward(mx.array([[1, 2, 3, 4]]), cache)
    _, _, record = target.forward(mx.array([[5, 6, 7, 8, 9]]), cache, record=True)
    replays = []
    monkeypatch.setattr(gdn, "gdn_replay", lambda *a: replays.append(a[-1]) or a[0])

    def forbidden(*a, **k):
        raise AssertionError("rollback ran a layer forward")

    for i in target._gdn_layers:
        monkeypatch.setattr(type(target.text_model.layers[i].linear_attn), "__call__", forbidden)
    target.rollback(cache, 5, 3, record)
    assert replays == [2] * len(target._gdn_layers)


@needs_gxx
def test_lossless_with_gdn_kernels_on_verify(monkeypatch):
    model, tok = tiny_target("qwen3_5", seed=1)
    prompt, ref = clean_case(model, 30, 40, seed=11)
    calls = emulate(monkeypatch, {"gdn_tape", "gdn_replay"})
    out, accepts = decode_with_partial_accepts(model, tok, prompt, ref, block_size=8, seed=5)
    assert out == ref
    assert len(set(accepts)) > 2  # rollbacks of different lengths happened
    assert calls["gdn_tape"] > 0 and calls["gdn_replay"] > 0


# ----------------------------------------------------------- quantized verify


def quantized_llama():
    model, tok = tiny_target("llama", seed=1)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model, tok


def test_quantized_target_is_lossless_on_the_reference_path():
    model, tok = quantized_llama()
    prompt, ref = clean_case(model, 25, 30, seed=2)
    out, accepts = decode_with_partial_accepts(model, tok, prompt, ref, block_size=8, seed=1)
    assert out == ref and len(set(accepts)) > 2


def test_a_reduced_vocabulary_draft_on_a_quantized_tied_head_is_lossless():
    """The draft's reduced vocabulary takes its rows of the target's quantized, tied embedding
    (`TargetHead._head_rows` keeps their packing), as a 4-bit mlx-community target with the
    shipped draft has it."""
    model, tok = quantized_llama()
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    prompt, ref = clean_case(model, 25, 30, seed=2)
    vocab_ids = mx.array(sorted(set(range(0, model.args.vocab_size, 3)) | set(ref)), dtype=mx.int32)
    target = Target(model)
    h = mx.random.normal((1, 3, model.args.hidden_size), key=mx.random.key(1))
    assert mx.allclose(target.head(h, vocab_ids), target.head(h)[..., vocab_ids], atol=1e-5).item()
    draft = random_draft(model, num_layers=1, block_size=8, seed=3)
    draft.set_vocab(vocab_ids)
    for block_size in (8, "auto"):
        out = []
        for r in stream_generate(model, draft, tok, prompt, max_tokens=len(ref), stop_token_ids=[],
                                 block_size=block_size):
            out += r.tokens
        assert out == ref, block_size


@needs_gxx
def test_lossless_with_small_m_kernel_on_verify(monkeypatch):
    model, tok = quantized_llama()
    prompt, ref = clean_case(model, 25, 30, seed=2)
    calls = emulate(monkeypatch, {"qmm_small_m"})
    target = Target(model)
    before = [id(l) for _, _, l in target._quantized]
    out, accepts = decode_with_partial_accepts(model, tok, prompt, ref, block_size=8, seed=1)
    assert out == ref and len(set(accepts)) > 2
    # Every verify of 4+ tokens (all but the last, cut by max_tokens) ran each
    # decoder projection and the head through the kernel.
    n_proj = len(target._quantized)
    assert n_proj == 7 * len(model.model.layers)
    assert calls["qmm_small_m"] >= (len(accepts) - 1) * (n_proj + 1)
    assert [id(l) for _, _, l in Target(model)._quantized] == before  # swaps were scoped


def test_small_m_swap_only_for_verify_widths(monkeypatch):
    model, _ = quantized_llama()
    target = Target(model)
    seen = []
    monkeypatch.setattr(selection, "use_metal", lambda name: name == "qmm_small_m")
    monkeypatch.setattr(qmm, "qmm_small_m_metal",
                        lambda x, *a, **k: seen.append(x.shape) or qmm.qmm_small_m_reference(x, *a, **k))
    cache = target.make_cache()
    target.forward(mx.array([list(range(40))]), cache, record=True)  # prefill width: MLX's qmm
    target.forward(mx.array([[3]]), cache)  # decode width: MLX's qmv
    assert seen == []
    target.forward(mx.array([list(range(6))]), cache, record=True)
    assert seen and all(np.prod(s[:-1]) == 6 for s in seen)


def test_unverified_apple_gpu_keeps_mlx_lm_recurrence(monkeypatch):
    """On an Apple GPU without a verified gdn_tape, verify runs mlx-lm's own fused recurrence
    (stood in for here by its ops twin) and a rollback re-runs only the recurrence over the kept steps."""
    from mlx_lm.models import gated_delta

    model, tok = tiny_target("qwen3_5", seed=1, linear_key_head_dim=32)
    prompt, ref = clean_case(model, 30, 40, seed=11)
    fused = []

    def fake_kernel(q, k, v, g, beta, state, mask=None):
        fused.append(q.shape[1])
        return gated_delta.gated_delta_ops(q, k, v, g, beta, state, mask)

    monkeypatch.setattr(selection, "on_metal", lambda: True)
    monkeypatch.setattr(selection.mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(gated_delta, "gated_delta_kernel", fake_kernel)
    monkeypatch.setattr(gdn, "gdn_tape", lambda *a: pytest.fail("twin ran on the GPU path"))
    out, accepts = decode_with_partial_accepts(model, tok, prompt, ref, block_size=8, seed=5)
    assert out == ref and len(set(accepts)) > 2
    widths = set(fused)
    assert 8 in widths and widths & set(range(1, 7))  # verify blocks, then kept-prefix re-runs


# ----------------------------------------------------------- KV injection


@needs_gxx
@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_lossless_with_kv_inject_kernel_in_the_draft(monkeypatch, arch):
    """The draft's caches become one preallocated stack filled by the kernel; output stays exact
    and the draft proposes what it proposes on the reference path."""
    from dflash_mlx.models.draft.checkpoints import random_draft
    from dflash_mlx.kernels.context_kv import _StackedView

    model, tok = tiny_target(arch, seed=1)
    prompt, ref = clean_case(model, 40, 24, seed=3)
    draft = random_draft(model, num_layers=2, block_size=8, seed=4)

    def decode():
        out, proposals, widths = [], [], []
        for r in stream_generate(model, draft, tok, prompt, max_tokens=len(ref), stop_token_ids=[], block_size="draft"):
            out += r.tokens
            proposals.append(r.accept_length)
            widths.append(r.verify_width)
        return out, proposals, widths

    out_ref, accepts_ref, _ = decode()
    calls = emulate(monkeypatch, {"kv_inject"})
    assert all(isinstance(c, _StackedView) for c in draft.make_cache())
    out, accepts, widths = decode()
    assert out == out_ref == ref
    assert accepts == accepts_ref
    # one injection per drafted cycle (width-1 cycles leave their features for the next draft)
    assert calls["kv_inject"] >= sum(1 for w in widths if (w or 0) > 1) > 0
