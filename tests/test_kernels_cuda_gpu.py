"""The CUDA kernels on MLX's CUDA backend itself (skipped without a CUDA GPU; `benchmarks/gpu/run.sh`
runs this file): each row of a 2-16-row product equals MLX's own product of that row alone, bit
for bit, in bfloat16, float16 and float32: qmv_rows against quantized_matmul (its qmv) at 4 and 8
bits, gemv_rows against x @ w.T (its gemv). With this and the GPU check's `kernels` times (faster
than MLX's product at verify widths), a kernel's name goes into `kernels.selection.VERIFIED_ON_CUDA`.
(A verify's attention still rounds otherwise than a decode step's on this backend, so whole answers
are the GPU check's exactness part's to measure.) Each test tries every case and names all that
fail in its one message (run.sh keeps the last lines of the output)."""

import mlx.core as mx
import pytest

from dflash_mlx.kernels import gemv, qmm, selection

pytestmark = pytest.mark.skipif(not selection.on_cuda(), reason="needs MLX's CUDA backend and a GPU")

DTYPES = (mx.bfloat16, mx.float16, mx.float32)
WIDTHS = (2, 3, 8, 16)


def parted_rows(kernel, mlx_product, x):
    """[(M, rows that differ, largest difference)] where the kernel's rows part from MLX's row alone."""
    alone = mx.concatenate([mlx_product(x[m:m + 1]) for m in range(x.shape[0])])
    parted = []
    for M in WIDTHS:
        got = kernel(x[:M])
        differ = [m for m in range(M) if not mx.array_equal(got[m], alone[m]).item()]
        if differ:
            parted.append((M, differ, mx.max(mx.abs(got.astype(mx.float32) - alone[:M].astype(mx.float32))).item()))
    return parted


def test_quantized_rows_equal_mlx_qmv_alone():
    failures = []
    for dtype in DTYPES:
        for bits in (4, 8):
            for N, K in ((1024, 4096), (576, 1536), (13, 576)):
                kw, kx = mx.random.split(mx.random.key(N + K + bits))
                w, s, b = mx.quantize(mx.random.normal((N, K), key=kw).astype(dtype) * 0.05, group_size=64, bits=bits)
                x = mx.random.normal((16, K), key=kx).astype(dtype)
                parted = parted_rows(lambda a: qmm.qmv_rows_cuda(a, w, s, b, 64, bits),
                                     lambda a: mx.quantized_matmul(a, w, s, b, transpose=True, group_size=64,
                                                                   bits=bits), x)
                failures += [f"{dtype} {bits}-bit {N}x{K}: {p}" for p in parted]
    assert not failures, "; ".join(failures)


def test_dense_rows_equal_mlx_gemv_alone():
    failures = []
    for dtype in DTYPES:
        for N, K in ((1024, 4096), (576, 1536), (13, 576), (7, 100)):
            kw, kx = mx.random.split(mx.random.key(N + K))
            w = (mx.random.normal((N, K), key=kw) * 0.05).astype(dtype)
            x = mx.random.normal((16, K), key=kx).astype(dtype)
            parted = parted_rows(lambda a: gemv.gemv_rows_cuda(a, w), lambda a: a @ w.T, x)
            failures += [f"{dtype} dense {N}x{K}: {p}" for p in parted]
    assert not failures, "; ".join(failures)
