"""qmv_rows on MLX's CUDA backend itself (skipped without a CUDA GPU; `benchmarks/gpu/run.sh`
runs this file): each row of a 2-16-row product equals MLX's own quantized_matmul of that row
alone (its qmv), bit for bit, in bfloat16, float16 and float32, 4 and 8 bits. With this and the GPU
check's `kernels` times (faster than MLX's product at verify widths), "qmv_rows" goes into
`kernels.selection.VERIFIED_ON_CUDA`. (A verify's attention still rounds otherwise than a decode
step's on this backend, so whole answers are the GPU check's exactness part's to measure.)"""

import mlx.core as mx
import pytest

from dflash_mlx.kernels import qmm, selection

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

