"""qmv_rows on MLX's CUDA backend itself (skipped without a CUDA GPU; `benchmarks/gpu/run.sh`
runs this file): each row of a 2-16-row product equals MLX's own product of that row alone, bit
for bit, in bfloat16, float16 and float32: qmv_rows against quantized_matmul (its qmv) at 4 and 8
bits, gemv_rows against x @ w.T (its gemv). With this and the GPU check's `kernels` times (faster
than MLX's product at verify widths), a kernel's name goes into `kernels.selection.VERIFIED_ON_CUDA`. (A verify's attention still rounds otherwise than a decode
step's on this backend, so whole answers are the GPU check's exactness part's to measure.)"""

import mlx.core as mx
import pytest

from dflash_mlx.kernels import gemv, qmm, selection

pytestmark = pytest.mark.skipif(not selection.on_cuda(), reason="needs MLX's CUDA backend and a GPU")


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("N,K", [(1024, 4096), (576, 1536), (13, 576)])
def test_rows_equal_mlx_qmv_alone(dtype, bits, N, K):
    kw, kx = mx.random.split(mx.random.key(N + K + bits))
    w, scales, biases = mx.quantize(mx.random.normal((N, K), key=kw).astype(dtype) * 0.05, group_size=64, bits=bits)
    x = mx.random.normal((16, K), key=kx).astype(dtype)
    alone = mx.concatenate([mx.quantized_matmul(x[m:m + 1], w, scales, biases, transpose=True, group_size=64,
                                                bits=bits) for m in range(16)])
    for M in (2, 3, 8, 16):
        got = qmm.qmv_rows_cuda(x[:M], w, scales, biases, 64, bits)
        assert mx.array_equal(got, alone[:M]).item(), (M, mx.max(mx.abs(got - alone[:M])).item())



@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("N,K", [(1024, 4096), (576, 1536), (13, 576), (7, 100)])
def test_dense_rows_equal_mlx_gemv_alone(dtype, N, K):
    kw, kx = mx.random.split(mx.random.key(N + K))
    w = (mx.random.normal((N, K), key=kw) * 0.05).astype(dtype)
    x = mx.random.normal((16, K), key=kx).astype(dtype)
    alone = mx.concatenate([x[m:m + 1] @ w.T for m in range(16)])
    for M in (2, 3, 8, 16):
        got = gemv.gemv_rows_cuda(x[:M], w)
        assert mx.array_equal(got, alone[:M]).item(), (M, mx.max(mx.abs(got - alone[:M])).item())
