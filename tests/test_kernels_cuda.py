"""CUDA kernel bodies vs their pure-MLX twins and vs the arithmetic they claim, on the CPU.

(gemv_rows likewise claims MLX's CUDA gemv's order: `gemv_order` below.)

Each body in dflash_mlx/kernels/cuda/ runs, with its header, through tests/cuda_compat (g++, a
fiber a GPU thread) with the launch code of its CUDA path (`qmm.qmv_rows_cuda(..., factory=...)`).
qmv_rows claims to round each row as MLX's CUDA qmv rounds it alone: `qmv_order` below writes
that order out in numpy (fused multiply-adds per lane and element, the lane's elements summed in
float, a warp butterfly, one rounding to the dtype), and the harness must match it bit for bit;
whether MLX's GPU qmv rounds that way is the GPU check's (benchmarks/gpu/kernels_part.py).
"""

import importlib.util
import shutil
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx.kernels import gemv, qmm, selection
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.models.target.head import TargetHead
from dflash_mlx.testing.targets import clean_case, tiny_target

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the CUDA-compat harness")

_spec = importlib.util.spec_from_file_location("dflash_cuda_compat_driver",
                                               Path(__file__).parent / "cuda_compat" / "driver.py")
driver = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(driver)
qmv_rows = partial(qmm.qmv_rows_cuda, factory=driver.cuda_kernel)
gemv_rows = partial(gemv.gemv_rows_cuda, factory=driver.cuda_kernel)


def quantized(N, K, bits, gs, dtype, M=16, seed=0):
    key = mx.random.key(seed)
    kw, kx = mx.random.split(key)
    w, scales, biases = mx.quantize(mx.random.normal((N, K), key=kw) * 0.1, group_size=gs, bits=bits)
    x = mx.random.normal((M, K), key=kx).astype(dtype)
    return x, w, scales.astype(dtype), biases.astype(dtype)


def as_f32(a):
    return np.array(a.astype(mx.float32))


def kernels_on(monkeypatch, widths):
    """Both CUDA kernels on, run by the harness, their row counts appended to `widths`."""
    monkeypatch.setattr(selection, "on_cuda", lambda: True)
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "cuda")
    monkeypatch.setattr(gemv, "gemv_rows_cuda", lambda x, w: widths.append(x.size // x.shape[-1]) or gemv_rows(x, w))
    monkeypatch.setattr(qmm, "qmv_rows_cuda",
                        lambda x, *a, **k: widths.append(x.size // x.shape[-1]) or qmv_rows(x, *a, **k))
    monkeypatch.setattr(TargetHead, "_transposed_head", lambda self, layer: None)


def rounded(values: np.ndarray, dtype) -> np.ndarray:
    """float32 values rounded to `dtype` (to nearest even), back as float32."""
    return as_f32(mx.array(values.astype(np.float32)).astype(dtype))


def fma32(a, b, c):
    return (a.astype(np.float64) * b + c).astype(np.float32)


def qmv_order(x, w, scales, biases, gs, bits):
    """MLX's CUDA qmv for every row alone, step by step as qmv_rows.cuh states it (with
    cuda_compat's roundings: a 16-bit fused multiply-add rounds to float, then to the dtype)."""
    dtype = x.dtype
    M, K = x.shape
    N = w.shape[0]
    E = 16 if dtype != mx.float32 and bits <= 4 else 8
    per_word = 32 / bits
    words = np.array(w).astype(np.uint64)
    j = np.arange(K)
    q = ((words[:, (j // per_word).astype(int)] >> ((j % per_word) * bits).astype(np.uint64))
         & ((1 << bits) - 1)).astype(np.float32)  # [N, K]
    s = np.repeat(as_f32(scales), gs, axis=1)
    b = np.repeat(as_f32(biases), gs, axis=1)
    if dtype == mx.float32:
        wdq = fma32(q, s, b)
    else:
        wdq = rounded(rounded(q * s, dtype) + b, dtype)
    acc_in_dtype = dtype != mx.float32 and bits < 8
    xs = as_f32(x)
    lane_of = (j // E) % 32  # the lane that takes element j, and its slot
    slot = j % E
    out = np.zeros((M, N), np.float32)
    for m in range(M):
        acc = np.zeros((N, 32, E), np.float32)
        for k in range(K):  # tiles in order: k // (32 * E), then the residue
            acc[:, lane_of[k], slot[k]] = fma32(xs[m, k], wdq[:, k], acc[:, lane_of[k], slot[k]])
            if acc_in_dtype:
                acc[:, lane_of[k], slot[k]] = rounded(acc[:, lane_of[k], slot[k]], dtype)
        lane_sum = np.zeros((N, 32), np.float32)
        for i in range(E):
            lane_sum = (lane_sum + acc[:, :, i]).astype(np.float32)
        for offset in (16, 8, 4, 2, 1):
            lane_sum = (lane_sum + lane_sum[:, np.arange(32) ^ offset]).astype(np.float32)
        out[m] = rounded(lane_sum[:, 0], dtype)
    return out


CASES = [  # N, K, bits, group size, dtype: K = 576 leaves a residue tile (E = 16), 13 rows a partial block
    (13, 576, 4, 64, mx.bfloat16),
    (24, 512, 4, 32, mx.float16),
    (16, 256, 8, 128, mx.bfloat16),
    (9, 576, 2, 64, mx.bfloat16),
    (20, 320, 4, 64, mx.float32),
    (11, 384, 8, 32, mx.float32),
    (10, 320, 2, 32, mx.float32),  # a tile of 8 2-bit weights: half a word
]


@pytest.mark.parametrize("N,K,bits,gs,dtype", CASES)
def test_qmv_rows_rounds_each_row_in_qmv_order(N, K, bits, gs, dtype):
    x, w, scales, biases = quantized(N, K, bits, gs, dtype, M=5)
    got = qmv_rows(x, w, scales, biases, gs, bits)
    assert got.shape == (5, N) and got.dtype == dtype
    np.testing.assert_array_equal(as_f32(got), qmv_order(x, w, scales, biases, gs, bits))


@pytest.mark.parametrize("N,K,bits,gs,dtype", CASES)
def test_qmv_rows_matches_quantized_matmul(N, K, bits, gs, dtype):
    x, w, scales, biases = quantized(N, K, bits, gs, dtype)
    ref = as_f32(mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=gs, bits=bits))
    got = as_f32(qmv_rows(x, w, scales, biases, gs, bits))
    # float32: sums in another order; 16-bit: qmv's 16-bit accumulators and 16-bit weights
    tol = 1e-5 if dtype == mx.float32 else 0.08
    assert np.all(np.isfinite(got))
    assert np.max(np.abs(got - ref)) <= tol * np.max(np.abs(ref))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_a_row_rounds_the_same_whatever_the_width(dtype):
    """Row m of an M-row product is that row alone, bit for bit: the property a verify needs to
    give plain decoding's logits (M = 1 is what qmv computes for a decode step)."""
    x, w, scales, biases = quantized(21, 576, 4, 64, dtype)
    alone = [as_f32(qmv_rows(x[m:m + 1], w, scales, biases, 64, 4))[0] for m in range(16)]
    for M in (2, 3, 4, 5, 8, 16):  # passes of QMV_ROWS_PASS rows, the last one partial or whole
        got = as_f32(qmv_rows(x[:M], w, scales, biases, 64, 4))
        for m in range(M):
            np.testing.assert_array_equal(got[m], alone[m], err_msg=f"M={M} row {m}")


def test_leading_dimensions_and_refusals():
    x, w, scales, biases = quantized(16, 256, 4, 64, mx.bfloat16, M=6)
    flat = as_f32(qmv_rows(x, w, scales, biases, 64, 4))
    np.testing.assert_array_equal(as_f32(qmv_rows(x.reshape(2, 3, 256), w, scales, biases, 64, 4)).reshape(6, 16),
                                  flat)
    with pytest.raises(ValueError, match="M=18"):
        qmm.qmv_rows_cuda(mx.concatenate([x, x, x]), w, scales, biases, 64, 4, factory=driver.cuda_kernel)
    with pytest.raises(ValueError, match="does not match K"):
        qmm.qmv_rows_cuda(x, w, scales, biases, 64, 8, factory=driver.cuda_kernel)
    with pytest.raises(ValueError, match="bits=3"):
        qmm.qmv_rows_cuda(x, w, scales, biases, 64, 3, factory=driver.cuda_kernel)


def test_dispatch_takes_verify_widths_only_on_cuda(monkeypatch):
    x, w, scales, biases = quantized(16, 256, 4, 64, mx.float32)
    assert not selection.use_cuda("qmv_rows")  # no CUDA here: the twin
    assert not qmm.custom_width(16)
    taken = []
    monkeypatch.setattr(selection, "on_cuda", lambda: True)
    monkeypatch.setattr(qmm, "qmv_rows_cuda", lambda x, *a, **k: taken.append(x.shape[0]) or qmv_rows(x, *a, **k))
    assert not selection.use_cuda("qmv_rows")  # on CUDA but not verified: still off
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "cuda")
    assert selection.use_cuda("qmv_rows") and not selection.use_metal("qmm_small_m")
    assert [qmm.custom_width(m) for m in (1, 2, 16, 17)] == [False, True, True, False]
    for M in (1, 2, 16):
        qmm.qmm_small_m(x[:M], w, scales, biases, 64, 4)
    qmm.qmm_small_m(mx.concatenate([x, x]), w, scales, biases, 64, 4)  # a prefill width: MLX's qmm
    assert taken == [2, 16]
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "reference")
    assert not selection.use_cuda("qmv_rows")


def test_lossless_with_qmv_rows_on_verify(monkeypatch):
    """A 4-bit target whose verify projections and head run qmv_rows (through the harness):
    greedy output is plain decoding's token for token, with partial accepts."""
    from test_verify_kernels import decode_with_partial_accepts

    model, tok = tiny_target("llama", seed=1)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    prompt, ref = clean_case(model, 25, 30, seed=2)
    widths = []
    kernels_on(monkeypatch, widths)
    out, accepts = decode_with_partial_accepts(model, tok, prompt, ref, block_size=8, seed=1)
    assert out == ref and len(set(accepts)) > 2
    n_proj = len(Target(model)._quantized)
    assert len(widths) >= (len(accepts) - 1) * (n_proj + 1) and set(widths) <= set(range(2, 17))


# ------------------------------------------------------------------------------ gemv_rows


def gemv_order(x, w):
    """MLX's CUDA gemv for every row alone: lane l takes NPT elements at NPT*l + 32*NPT*step,
    one float accumulator, a fused multiply-add an element; the warp butterfly; one rounding."""
    M, K = x.shape
    npt = gemv.per_lane(K)
    xs, ws = as_f32(x), as_f32(w)
    out = np.zeros((M, w.shape[0]), np.float32)
    for m in range(M):
        acc = np.zeros((w.shape[0], 32), np.float32)
        for start in range(0, K, 32 * npt):
            for lane in range(32):
                for j in range(npt):
                    k = start + npt * lane + j
                    if start + npt * lane < K:
                        acc[:, lane] = fma32(ws[:, k], xs[m, k], acc[:, lane])
        for offset in (16, 8, 4, 2, 1):
            acc = (acc + acc[:, np.arange(32) ^ offset]).astype(np.float32)
        out[m] = rounded(acc[:, 0], x.dtype)
    return out


GEMV_CASES = [(13, 576, mx.bfloat16), (24, 512, mx.float16), (20, 320, mx.float32), (7, 100, mx.bfloat16)]


def dense(N, K, dtype, M=16, seed=0):
    kw, kx = mx.random.split(mx.random.key(seed))
    return mx.random.normal((M, K), key=kx).astype(dtype), (mx.random.normal((N, K), key=kw) * 0.1).astype(dtype)


@pytest.mark.parametrize("N,K,dtype", GEMV_CASES)
def test_gemv_rows_rounds_each_row_in_gemv_order(N, K, dtype):
    x, w = dense(N, K, dtype, M=5)
    got = gemv_rows(x, w)
    assert got.shape == (5, N) and got.dtype == dtype
    np.testing.assert_array_equal(as_f32(got), gemv_order(x, w))


@pytest.mark.parametrize("N,K,dtype", GEMV_CASES)
def test_gemv_rows_matches_matmul_and_each_row_is_its_own(N, K, dtype):
    x, w = dense(N, K, dtype)
    ref = as_f32(x.astype(mx.float32) @ w.astype(mx.float32).T)
    got = as_f32(gemv_rows(x, w))
    tol = 1e-5 if dtype == mx.float32 else 1e-2
    assert np.max(np.abs(got - ref)) <= tol * np.max(np.abs(ref))
    for M in (2, 5, 16):
        part = as_f32(gemv_rows(x[:M], w))
        for m in range(M):
            np.testing.assert_array_equal(part[m], got[m], err_msg=f"M={M} row {m}")


def test_gemv_dispatch_and_refusals(monkeypatch):
    x, w = dense(16, 256, mx.float32)
    assert not gemv.custom_width(4)
    with pytest.raises(ValueError, match="does not match K"):
        gemv.gemv_rows_cuda(x, w[:, :128], factory=driver.cuda_kernel)
    with pytest.raises(ValueError, match="unsupported"):
        gemv.gemv_rows_cuda(x, w.astype(mx.float16), factory=driver.cuda_kernel)
    taken = []
    monkeypatch.setattr(selection, "on_cuda", lambda: True)
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "cuda")
    monkeypatch.setattr(gemv, "gemv_rows_cuda", lambda x, w: taken.append(x.shape[0]) or gemv_rows(x, w))
    assert [gemv.custom_width(m) for m in (1, 2, 16, 17)] == [False, True, True, False]
    for M in (1, 3, 16):
        np.testing.assert_allclose(as_f32(gemv.rows_product(x[:M], w)), as_f32(x[:M] @ w.T), rtol=1e-5, atol=1e-6)
    gemv.rows_product(x[:3], w.astype(mx.float16))  # another dtype than x's: MLX's product
    assert taken == [3, 16]


def test_lossless_with_gemv_rows_on_verify(monkeypatch):
    """A float target whose verify projections (bias-free linears) and LM head run gemv_rows
    (through the harness): greedy output is plain decoding's token for token, with partial accepts."""
    from test_verify_kernels import decode_with_partial_accepts

    model, tok = tiny_target("llama", seed=1)
    prompt, ref = clean_case(model, 25, 30, seed=2)
    widths = []
    kernels_on(monkeypatch, widths)  # (and without the head's CPU-only transposed copy, as on a GPU)
    target = Target(model)
    before = [id(layer) for _, _, layer in target._dense]
    out, accepts = decode_with_partial_accepts(model, tok, prompt, ref, block_size=8, seed=1)
    assert out == ref and len(set(accepts)) > 2
    assert len(target._dense) == 7 * len(model.model.layers)
    assert len(widths) >= (len(accepts) - 1) * (len(target._dense) + 1) and set(widths) <= set(range(2, 17))
    assert [id(layer) for _, _, layer in Target(model)._dense] == before  # the swaps were scoped


def test_tiles_are_read_alike_from_slices_that_start_anywhere():
    """common.cuh's `load_tile`: vector loads where the start allows them, one by one elsewhere (a
    verify's LM head may take rows of a slice); `tiles_aligned` tells the two apart."""
    body = """
      const int i = threadIdx.x;
      const float* start = x + OFFSET + 4 * i;
      const bool aligned = dflash::tiles_aligned<float, 4>(start, 4);
      const auto tile = dflash::load_tile<float, 4>(start, aligned);
      for (int j = 0; j < 4; ++j) {
        out[4 * i + j] = tile.v[j];
      }
      flags[i] = aligned;
    """
    kernel = driver.cuda_kernel("tile_probe", ["x"], ["out", "flags"], body, header=selection.cuda_header("gemv_rows"))
    x = mx.arange(64, dtype=mx.float32)
    for offset, aligned in ((0, 1), (1, 0), (4, 1)):
        out, flags = kernel(inputs=[x], template=[("OFFSET", offset)], grid=(8, 1, 1), threadgroup=(8, 1, 1),
                            output_shapes=[(32,), (8,)], output_dtypes=[mx.float32, mx.int32])
        np.testing.assert_array_equal(np.array(out), np.arange(offset, offset + 32))
        assert set(np.array(flags).tolist()) == {aligned}, offset


def test_a_batch_verifies_its_rows_through_the_kernels(monkeypatch):
    """The batch engine's verify (B rows x S tokens, B * S <= 16) through gemv_rows: every row's
    answer is its plain decoding's."""
    from dflash_mlx.engine.engine import BatchEngine
    from dflash_mlx.engine.rows import BatchRequest
    from dflash_mlx.options import GenerationOptions
    from dflash_mlx.testing.serving import serve
    from dflash_mlx.testing.targets import RowScriptedDrafts, byte_tokenizer

    model = tiny_target("llama", seed=2, layer_types=None, sliding_window=None)[0]
    cases = [clean_case(model, 6 + 11 * i, 14, seed=i) for i in range(3)]
    widths = []
    kernels_on(monkeypatch, widths)
    draft = RowScriptedDrafts(Target(model), cases, lambda c: (c * 3) % 5, block_size=4)
    engine = BatchEngine(model, draft, byte_tokenizer(), max_batch=3, prefill_chunk=8, block_size=4)
    tokens, _, _ = serve(engine, [BatchRequest(p, GenerationOptions(max_tokens=len(ref))) for p, ref in cases])
    assert [tokens[i] for i in range(3)] == [ref for _, ref in cases]
    assert max(widths) > 4  # (rows of several requests in one product)


def test_a_token_tree_verifies_through_the_kernels(monkeypatch):
    """A tree's verify forward (its mask and positions handed over by stand-ins) with the
    projections swapped for the kernels: the same hidden states as without them."""
    from dflash_mlx.models.target import tree_attention as ta

    model, _ = tiny_target("qwen3", seed=4)
    nn.quantize(model, group_size=32, bits=4)
    target = Target(model)
    tree = ta.TokenTree([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 2, 4], [0, 1, 1, 2, 2, 3])
    outs = []
    for on in (False, True):
        widths = []
        if on:
            kernels_on(monkeypatch, widths)
        cache = target.make_cache()
        target.forward(mx.array([[3, 9, 27, 81]]), cache)
        h, _, _ = target.forward(mx.array([tree.tokens]), cache, tree=tree, record=True)
        outs.append(h)
    assert widths and set(widths) == {len(tree)}
    assert mx.allclose(outs[0], outs[1], atol=1e-4).item()


def test_prompt_chunks_run_mlx_products_and_batched_steps_the_kernels(monkeypatch):
    """Which forwards take the kernels: a verify's rows and a batched step's rows stand for one-token
    decode steps (each as a step alone would be); a prompt's chunk runs MLX's own product, as
    mlx-lm's prefill does, so the caches it leaves are plain decoding's."""
    model, _ = tiny_target("llama", seed=1)
    target = Target(model)
    widths = []
    kernels_on(monkeypatch, widths)
    cache = target.make_cache()
    target.forward(mx.array([list(range(9))]), cache)  # a prompt's chunk
    target.forward(mx.array([[4]]), cache)  # a plain step
    assert widths == []
    target.forward(mx.array([list(range(5))]), cache, record=True)  # a verify
    assert set(widths) == {5}
    widths.clear()
    batch_cache = [c for c in target.make_cache()]
    target.forward(mx.array([[1], [2], [3]]), batch_cache)  # a batched step: 3 rows of one token
    assert set(widths) == {3}
