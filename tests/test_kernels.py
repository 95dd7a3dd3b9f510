"""Kernel sources vs their pure-MLX twins, run on the CPU through tests/metal_compat.

Every kernel body in metal/*.metal is compiled as C++ with g++ against
metal_compat.h and executed over its full grid (SIMD collectives and barriers
emulated with fibers), using the same launch code as the Metal path
(`<family>.<op>_metal(..., factory=driver.metal_kernel)`).
"""

import importlib.util
import shutil
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops
from mlx_lm.models.rope_utils import initialize_rope

from dflash_mlx.kernels import context_kv, gdn, qmm, selection

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal-compat harness")

_spec = importlib.util.spec_from_file_location(
    "dflash_metal_compat_driver", Path(__file__).parent / "metal_compat" / "driver.py"
)
driver = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(driver)
compat = driver.metal_kernel


def close(a, b, atol, rtol=0.0):
    a = np.array(a.astype(mx.float32))
    b = np.array(b.astype(mx.float32))
    assert a.shape == b.shape
    assert np.all(np.isfinite(a)), "kernel left unwritten (NaN) elements"
    np.testing.assert_allclose(a, b, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- harness


def test_harness_emulates_simd_collectives_and_barriers():
    # Partial last SIMD-group (48 threads), xor shuffles, a threadgroup array
    # shared across SIMD-groups, and a barrier between writes and reads.
    src = """
      uint lane = thread_index_in_simdgroup;
      uint sg = simdgroup_index_in_threadgroup;
      threadgroup float part[4];
      float v = x[thread_position_in_grid.x];
      float s = simd_sum(v);
      float nb = simd_shuffle_xor(v, 1);
      if (lane == 0) part[sg] = s;
      threadgroup_barrier(mem_flags::mem_threadgroup);
      float total = 0.0f;
      for (uint i = 0; i < simdgroups_per_threadgroup; ++i) total += part[i];
      out[thread_position_in_grid.x] = total;
      swapped[thread_position_in_grid.x] = nb;
    """
    k = compat("collectives", ["x"], ["out", "swapped"], src)
    x = mx.arange(96, dtype=mx.float32)
    out, swapped = k(inputs=[x], grid=(96, 1, 1), threadgroup=(48, 1, 1),
                     output_shapes=[(96,), (96,)], output_dtypes=[mx.float32, mx.float32])
    xs = np.arange(96, dtype=np.float32)
    want = np.repeat([xs[:48].sum(), xs[48:].sum()], 48)
    np.testing.assert_array_equal(np.array(out), want)
    # Lanes 32..47 of each group form a 16-lane SIMD-group; xor 1 stays inside it.
    np.testing.assert_array_equal(np.array(swapped), xs[np.arange(96) ^ 1])


def test_harness_reports_deadlock_and_out_of_bounds_writes():
    k = compat("deadlock", ["x"], ["out"], """
      if (thread_position_in_threadgroup.x == 0) return;
      threadgroup_barrier(mem_flags::mem_threadgroup);
      out[thread_position_in_grid.x] = x[thread_position_in_grid.x];
      if (thread_position_in_grid.x == 1) out[-1] = 0;
    """)
    x = mx.ones((8,))
    # Thread 0 exits early, the rest still meet at the barrier: no deadlock,
    # but the deliberate write before the buffer is caught.
    with pytest.raises(RuntimeError, match="outside an output buffer"):
        k(inputs=[x], grid=(8, 1, 1), threadgroup=(8, 1, 1), output_shapes=[(8,)], output_dtypes=[mx.float32])
    k2 = compat("deadlock2", ["x"], ["out"], """
      if (thread_position_in_grid.x < 4) threadgroup_barrier(mem_flags::mem_threadgroup);
      else out[0] = simd_sum(x[0]);
    """)
    with pytest.raises(RuntimeError, match="deadlock"):
        k2(inputs=[x], grid=(8, 1, 1), threadgroup=(8, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])


def test_harness_16bit_floats_round_like_mlx():
    k = compat("cast16", ["x"], ["h", "bf"], """
      uint i = thread_position_in_grid.x;
      h[i] = static_cast<half>(x[i]);
      bf[i] = static_cast<bfloat16_t>(x[i]);
    """)
    mx.random.seed(0)
    x = mx.concatenate([
        mx.random.normal((200,)) * 10.0 ** mx.random.randint(-9, 6, (200,)).astype(mx.float32),
        mx.array([0.0, -0.0, 65504.0, 65520.0, 1e6, 6e-8, 3e-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11]),
    ])
    h, bf = k(inputs=[x], grid=(x.size, 1, 1), threadgroup=(64, 1, 1),
              output_shapes=[x.shape, x.shape], output_dtypes=[mx.float16, mx.bfloat16])
    np.testing.assert_array_equal(np.array(h.view(mx.uint16)), np.array(x.astype(mx.float16).view(mx.uint16)))
    np.testing.assert_array_equal(np.array(bf.view(mx.uint16)), np.array(x.astype(mx.bfloat16).view(mx.uint16)))


# ----------------------------------------------------------- KV injection


def _rope(kind, D):
    if kind == "base":
        return nn.RoPE(D, traditional=False, base=1_000_000.0)
    if kind == "partial":
        return nn.RoPE(D - 16, traditional=False, base=10_000.0)
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
               "beta_fast": 32, "beta_slow": 1}
    rope = initialize_rope(D, 1_000_000.0, False, scaling, 256)
    assert getattr(rope, "mscale", 1.0) != 1.0  # exercises the pre-rotation scale
    return rope


@pytest.mark.parametrize(
    "kind,dtype,D,L,Hkv,B,S,offset",
    [
        ("base", mx.float32, 40, 3, 2, 2, 5, 7),  # D/2 = 20 < 32 lanes
        ("yarn", mx.float32, 64, 2, 1, 1, 9, 300),
        ("partial", mx.float32, 48, 1, 3, 1, 3, 0),  # rotary dims 32 of 48
        ("base", mx.bfloat16, 64, 2, 2, 1, 4, 33),
    ],
)
def test_kv_inject_matches_reference(kind, dtype, D, L, Hkv, B, S, offset):
    mx.random.seed(1)
    rope = _rope(kind, D)
    kv = (2.0 * mx.random.normal((B, S, L, 2, Hkv, D))).astype(dtype)
    w = (1.0 + 0.3 * mx.random.normal((L, D))).astype(dtype)
    ref = context_kv.context_kv_reference(kv, w, offset, eps=1e-6, rope=rope)
    got = context_kv.context_kv_metal(kv, w, offset, eps=1e-6, rope=rope, factory=compat)
    atol = 2e-5 if dtype == mx.float32 else 4e-2
    for g, r in zip(got, ref):
        assert g.dtype == dtype and g.shape == (L, B, Hkv, S, D)
        close(g, r, atol=atol, rtol=atol)
    # The values are a pure relayout: exact.
    np.testing.assert_array_equal(np.array(got[1].astype(mx.float32)), np.array(ref[1].astype(mx.float32)))


def _tiny_draft(num_layers=2):
    from dflash_mlx.models.draft.dflash import DFlashDraftModel
    from dflash_mlx.models.draft.config import DraftConfig

    cfg = DraftConfig(hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=50,
                      target_layer_ids=[0, 1], mask_token_id=49, num_target_layers=2,
                      rope_theta=10_000.0)
    mx.random.seed(3)
    draft = DFlashDraftModel(cfg)
    draft.update(nn.utils.tree_map(lambda p: 0.2 * mx.random.normal(p.shape), draft.parameters()))
    return draft


@pytest.mark.parametrize("stacked", [False, True])
def test_draft_inject_kernel_matches_draft(monkeypatch, stacked):
    # The whole opt-in path (stacked matmul + kernel + cache writes) against
    # the draft's own per-layer injection, over steps so offsets move, then the
    # draft's block forward on both caches.
    draft = _tiny_draft()
    monkeypatch.setattr(context_kv, "context_kv", partial(context_kv.context_kv_metal, factory=compat))
    ref_cache = draft.make_cache()
    ker_cache = context_kv.make_stacked_cache(draft) if stacked else draft.make_cache()
    for S in (5, 2, 0):
        feats = mx.random.normal((1, S, 128))
        draft.inject(feats, ref_cache)
        context_kv.draft_inject(draft, feats, ker_cache)
    context_kv.draft_inject(draft, None, ker_cache)
    for rc, kc in zip(ref_cache, ker_cache):
        assert rc.offset == kc.offset == 7
        (rk, rv), (kk, kv) = rc.fetch(), kc.fetch()
        close(kk, rk, atol=2e-5, rtol=1e-5)
        close(kv, rv, atol=2e-5, rtol=1e-5)
    x = mx.random.normal((1, 4, 64))
    h_ref, h_ker = x, x
    for layer, rc, kc in zip(draft.layers, ref_cache, ker_cache):
        h_ref, h_ker = layer(h_ref, draft._rope, rc), layer(h_ker, draft._rope, kc)
    close(h_ker, h_ref, atol=1e-4, rtol=1e-4)


def test_stacked_cache_views_behave_like_context_cache():
    # The reference path (draft.inject -> per-layer append) and trim work on views.
    draft = _tiny_draft()
    ref, views = draft.make_cache(), context_kv.make_stacked_cache(draft)
    feats = mx.random.normal((1, 300, 128))  # crosses the 256-entry growth step
    draft.inject(feats, ref)
    draft.inject(feats, views)
    for rc, vc in zip(ref, views):
        assert rc.trim(3) == vc.trim(3) == 3 and rc.offset == vc.offset == 297
        (rk, rv), (vk, vv) = rc.fetch(), vc.fetch()
        close(vk, rk, atol=0)
        close(vv, rv, atol=0)


# ------------------------------------------------------ small-M quantized matmul


@pytest.mark.parametrize(
    "M,N,K,bits,gs,dtype",
    [
        (4, 37, 256, 4, 64, mx.float32),  # N not a multiple of the 4 rows per SIMD-group
        (16, 20, 128, 8, 32, mx.float32),
        (7, 9, 384, 4, 128, mx.float32),
        (5, 12, 128, 2, 64, mx.float32),
        (16, 24, 256, 4, 64, mx.bfloat16),
    ],
)
def test_qmm_small_m_matches_quantized_matmul(M, N, K, bits, gs, dtype):
    mx.random.seed(2)
    w = mx.random.normal((N, K)).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=gs, bits=bits)
    x = mx.random.normal((1, M, K)).astype(dtype)
    ref = qmm.qmm_small_m_reference(x, wq, scales, biases, gs, bits)
    got = qmm.qmm_small_m_metal(x, wq, scales, biases, gs, bits, factory=compat)
    assert got.shape == ref.shape == (1, M, N) and got.dtype == dtype
    if dtype == mx.float32:
        close(got, ref, atol=2e-4 * np.sqrt(K), rtol=1e-4)
        return
    # MLX's CPU quantized_matmul loses precision in bf16 (errors of several
    # bf16 ulps); judge both against the float32 product of the same weights:
    # the kernel (float accumulation, one final rounding) must be within bf16
    # output rounding and no worse than MLX.
    f32 = lambda a: a.astype(mx.float32)
    truth = f32(x) @ mx.dequantize(wq, f32(scales), f32(biases), group_size=gs, bits=bits).T
    close(got, truth, atol=0.02, rtol=2 ** -8)
    assert mx.abs(f32(got) - truth).max().item() <= mx.abs(f32(ref) - truth).max().item()


def test_qmm_small_m_dispatch_falls_back_for_wide_m():
    w = mx.random.normal((8, 64))
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((32, 64))
    with pytest.raises(ValueError):
        qmm.qmm_small_m_metal(x, wq, s, b, 64, 4, factory=compat)
    close(qmm.qmm_small_m(x, wq, s, b, 64, 4),
          mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4), atol=0)


# ------------------------------------------------------- Gated DeltaNet


def _gdn_inputs(B, T, Hk, Hv, Dk, Dv, vec_gate, dtype, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk)) / np.sqrt(Dk)
    k = mx.random.normal((B, T, Hk, Dk))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)  # l2-normalized, as in the models
    v = mx.random.normal((B, T, Hv, Dv))
    gshape = (B, T, Hv, Dk) if vec_gate else (B, T, Hv)
    g = mx.exp(-mx.random.uniform(0.01, 0.5, gshape))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)))
    state = 0.5 * mx.random.normal((B, Hv, Dv, Dk))
    return [a.astype(dtype) for a in (q, k, v)] + [g, beta.astype(dtype), state]


GDN_CASES = [
    # B, T, Hk, Hv, Dk, Dv, vec_gate, dtype
    (2, 6, 1, 2, 40, 12, False, mx.float32),  # GQA, Dk not a multiple of 32
    (1, 5, 2, 2, 32, 8, True, mx.float32),  # per-Dk gate
    (1, 4, 1, 1, 64, 16, False, mx.bfloat16),
]


@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv,vec_gate,dtype", GDN_CASES)
def test_gdn_tape_matches_ops(B, T, Hk, Hv, Dk, Dv, vec_gate, dtype):
    q, k, v, g, beta, state = _gdn_inputs(B, T, Hk, Hv, Dk, Dv, vec_gate, dtype)
    y, s_out, tape = gdn.gdn_tape_metal(q, k, v, g, beta, state, factory=compat)
    y_ops, s_ops = gated_delta_ops(q, k, v, g, beta, state)
    y_ref, s_ref, tape_ref = gdn.gdn_tape_reference(q, k, v, g, beta, state)
    ytol = 1e-5 if dtype == mx.float32 else 2e-2
    assert y.dtype == dtype and s_out.dtype == mx.float32 and tape.shape == (B, T, Hv, Dv)
    close(y, y_ops, atol=ytol, rtol=ytol)
    close(s_out, s_ops, atol=1e-5, rtol=1e-5)
    close(tape, tape_ref, atol=1e-5, rtol=1e-5)
    # The twin is the mlx-lm recurrence itself.
    close(y_ref, y_ops, atol=0)
    close(s_ref, s_ops, atol=0)


@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv,vec_gate,dtype", GDN_CASES)
def test_gdn_replay_rebuilds_accepted_prefix(B, T, Hk, Hv, Dk, Dv, vec_gate, dtype):
    q, k, v, g, beta, state = _gdn_inputs(B, T, Hk, Hv, Dk, Dv, vec_gate, dtype, seed=5)
    _, s_full, tape = gdn.gdn_tape_metal(q, k, v, g, beta, state, factory=compat)
    for steps in range(T + 1):
        # Reference: mlx-lm's ops path re-run on the accepted prefix only.
        if steps:
            _, want = gated_delta_ops(q[:, :steps], k[:, :steps], v[:, :steps],
                                      g[:, :steps], beta[:, :steps], state)
        else:
            want = state
        got = gdn.gdn_replay_metal(state, k, g, tape, steps, factory=compat)
        close(got, want, atol=1e-5, rtol=1e-5)
        twin = gdn.gdn_replay_reference(state, k, g, tape, steps)
        close(twin, want, atol=1e-5, rtol=1e-5)
    # Full accept reproduces the recording pass bit for bit; a device-side
    # accept length (no host sync) gives the same state as the int.
    full = gdn.gdn_replay_metal(state, k, g, tape, T, factory=compat)
    np.testing.assert_array_equal(np.array(full), np.array(s_full))
    a = mx.array(2)
    close(gdn.gdn_replay_metal(state, k, g, tape, a, factory=compat),
          gdn.gdn_replay_reference(state, k, g, tape, 2), atol=1e-6)
    close(gdn.gdn_replay_reference(state, k, g, tape, a),
          gdn.gdn_replay_reference(state, k, g, tape, 2), atol=0)


# ------------------------------------------------------------- selection


def test_selection_defaults_to_reference(monkeypatch):
    assert selection.VERIFIED_ON_APPLE == frozenset()
    for name in selection.KERNELS:
        assert selection.kernel_source(name).strip()
        monkeypatch.delenv("DFLASH_MLX_KERNELS", raising=False)
        if not mx.metal.is_available():
            assert not selection.use_metal(name)
        monkeypatch.setenv("DFLASH_MLX_KERNELS", "reference")
        assert not selection.use_metal(name)
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "metal")
    assert selection.use_metal("gdn_tape") == mx.metal.is_available()


# ------------------------------------------------------------ engine glue


def test_quantized_linear_hook_matches_layer(monkeypatch):
    mx.random.seed(4)
    lin = nn.Linear(128, 40, bias=True)
    lin.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape), lin.parameters()))
    qlin = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4)
    x = mx.random.normal((1, 6, 128))
    want = qlin(x)
    close(qmm.quantized_linear(qlin, x), want, atol=0)  # twin on this machine
    monkeypatch.setattr(selection, "use_metal", lambda name: True)
    monkeypatch.setattr(qmm, "qmm_small_m_metal", partial(qmm.qmm_small_m_metal, factory=compat))
    close(qmm.quantized_linear(qlin, x), want, atol=5e-3, rtol=1e-4)
