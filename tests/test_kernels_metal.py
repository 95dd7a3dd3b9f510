"""The Metal kernels through mx.fast.metal_kernel on an Apple GPU, against their twins.

Skipped without Metal. Passing this file on Apple hardware is what allows a
kernel into selection.VERIFIED_ON_APPLE (see metal/README.md). Shapes are the
real ones (head_dim 128, Qwen3.5-style GDN heads, 4k hidden sizes) plus odd ones.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops
from mlx_lm.models.rope_utils import initialize_rope

from dflash_mlx.kernels import context_kv, gdn, qmm

pytestmark = [
    pytest.mark.metal,
    pytest.mark.skipif(not mx.metal.is_available(), reason="needs Apple Metal"),
]


def close(a, b, atol, rtol=0.0):
    a = np.array(a.astype(mx.float32))
    b = np.array(b.astype(mx.float32))
    assert a.shape == b.shape
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "rope_kind,dtype,D,L,Hkv,S,offset",
    [
        ("base", mx.float32, 128, 5, 8, 16, 0),
        ("base", mx.float32, 40, 3, 2, 5, 7),
        ("yarn", mx.float32, 128, 2, 4, 9, 300),
        ("base", mx.bfloat16, 128, 5, 8, 3, 1000),
        ("base", mx.float16, 64, 2, 2, 4, 33),
    ],
)
def test_kv_inject_metal(rope_kind, dtype, D, L, Hkv, S, offset):
    if rope_kind == "base":
        rope = nn.RoPE(D, traditional=False, base=1_000_000.0)
    else:
        rope = initialize_rope(D, 1_000_000.0, False, {"type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 64}, 256)
    mx.random.seed(0)
    kv = (2 * mx.random.normal((1, S, L, 2, Hkv, D))).astype(dtype)
    w = (1 + 0.3 * mx.random.normal((L, D))).astype(dtype)
    ref = context_kv.context_kv_reference(kv, w, offset, eps=1e-6, rope=rope)
    got = context_kv.context_kv_metal(kv, w, offset, eps=1e-6, rope=rope)
    tol = 5e-5 if dtype == mx.float32 else 5e-2
    for g, r in zip(got, ref):
        close(g, r, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "M,N,K,bits,gs,dtype",
    [
        (4, 4096, 4096, 4, 64, mx.float16),
        (16, 1000, 2048, 8, 32, mx.bfloat16),
        (7, 37, 384, 4, 128, mx.float32),
        (16, 512, 1024, 2, 64, mx.float32),
    ],
)
def test_qmm_small_m_metal(M, N, K, bits, gs, dtype):
    mx.random.seed(1)
    w = mx.random.normal((N, K)).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    x = mx.random.normal((M, K)).astype(dtype)
    f32 = lambda a: a.astype(mx.float32)
    truth = f32(x) @ mx.dequantize(wq, f32(s), f32(b), group_size=gs, bits=bits).T
    got = qmm.qmm_small_m_metal(x, wq, s, b, gs, bits)
    ref = qmm.qmm_small_m_reference(x, wq, s, b, gs, bits)
    scale = float(mx.abs(truth).max())
    tol = 1e-5 * np.sqrt(K) * scale if dtype == mx.float32 else 1e-2 * scale
    close(got, truth, atol=tol)
    close(ref, truth, atol=max(tol, 2e-2 * scale))


def _gdn(B, T, Hk, Hv, Dk, Dv, vec, dtype):
    mx.random.seed(2)
    q = mx.random.normal((B, T, Hk, Dk)) / np.sqrt(Dk)
    k = mx.random.normal((B, T, Hk, Dk))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, Hv, Dv))
    g = mx.exp(-mx.random.uniform(0.01, 0.5, (B, T, Hv, Dk) if vec else (B, T, Hv)))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)))
    state = 0.5 * mx.random.normal((B, Hv, Dv, Dk))
    return [a.astype(dtype) for a in (q, k, v)] + [g, beta.astype(dtype), state]


GDN = [
    (1, 16, 16, 32, 128, 128, False, mx.bfloat16),  # Qwen3.5/3.6 linear-attention heads
    (2, 6, 1, 2, 40, 12, False, mx.float32),
    (1, 5, 2, 2, 32, 8, True, mx.float32),
]


@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv,vec,dtype", GDN)
def test_gdn_tape_and_replay_metal(B, T, Hk, Hv, Dk, Dv, vec, dtype):
    q, k, v, g, beta, state = _gdn(B, T, Hk, Hv, Dk, Dv, vec, dtype)
    y, s_out, tape = gdn.gdn_tape_metal(q, k, v, g, beta, state)
    y_ops, s_ops = gated_delta_ops(q, k, v, g, beta, state)
    ytol = 1e-5 if dtype == mx.float32 else 2e-2
    close(y, y_ops, atol=ytol, rtol=ytol)
    close(s_out, s_ops, atol=1e-4, rtol=1e-4)
    for steps in sorted({0, 1, T // 2, T - 1, T}):
        want = state if steps == 0 else gated_delta_ops(
            q[:, :steps], k[:, :steps], v[:, :steps], g[:, :steps], beta[:, :steps], state)[1]
        close(gdn.gdn_replay_metal(state, k, g, tape, steps), want, atol=1e-4, rtol=1e-4)
        close(gdn.gdn_replay_metal(state, k, g, tape, mx.array(steps)), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch,quantize", [("qwen3_5", False), ("llama", True), ("qwen3", False)])
def test_engine_lossless_with_metal_kernels(monkeypatch, arch, quantize):
    """Every kernel on (DFLASH_MLX_KERNELS=metal), float32 on the GPU: greedy DFlash output is still
    plain mlx-lm greedy decoding, with a random draft (KV injection) and partial accepts."""
    from dflash_mlx import stream_generate
    from dflash_mlx.models.draft.checkpoints import random_draft
    from dflash_mlx.testing.targets import greedy_reference, tiny_target

    monkeypatch.setenv("DFLASH_MLX_KERNELS", "metal")
    model, tok = tiny_target(arch, seed=1)
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
    prompt = list(range(40, 75))
    ref = greedy_reference(model, prompt, 40)
    draft = random_draft(model, num_layers=2, block_size=8, seed=2)
    out = []
    for r in stream_generate(model, draft, tok, prompt, max_tokens=40, block_size=8, stop_token_ids=[]):
        out += r.tokens
    assert out == ref
