"""Small-M affine-quantized matmul: the verify-width products of a quantized target.

MLX's own quantized matmul is tuned for decode (one row, qmv) and for wide
prefills (qmm); a verify block of 4..16 rows sits between the two. On Metal the
qmm_small_m kernel covers exactly those widths (`QMM_MIN_M`..`QMM_MAX_M`); on
CUDA, qmv_rows covers 2..16 (`QMV_ROWS_MIN_M`..`QMM_MAX_M`): MLX's CUDA qmv
reads the weights once a row and its qmm rounds otherwise from 8 rows on, where
qmv_rows reads them once for every row and rounds each row as qmv rounds it alone.
`quantized_linear` runs an `nn.QuantizedLinear` through them (Target's scoped
verify hook, and its LM head); `custom_width` says whether a width goes there.
"""

import math

import mlx.core as mx

from dflash_mlx.kernels import selection

QMM_MIN_M = 4
QMM_MAX_M = 16
QMM_ROWS = 4  # weight rows per SIMD-group
QMV_ROWS_MIN_M = 2
QMV_ROWS_PASS = 4  # x rows a pass of qmv_rows (their accumulators live in registers)
QMV_ROWS_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def qmm_small_m_reference(x, w, scales, biases, group_size: int = 64, bits: int = 4):
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)


def qmm_small_m_metal(x, w, scales, biases, group_size: int = 64, bits: int = 4, factory=None):
    """x: [..., K] with prod(leading) <= 16; w: [N, K * bits / 32] uint32."""
    K = x.shape[-1]
    N = w.shape[0]
    M = math.prod(x.shape[:-1]) if x.ndim > 1 else 1
    if M > QMM_MAX_M or bits not in (2, 4, 8) or K % group_size or group_size < 32:
        raise ValueError(f"qmm_small_m: unsupported M={M} bits={bits} group_size={group_size}")
    if w.shape[1] * 32 // bits != K:
        raise ValueError(f"qmm_small_m: w {w.shape} does not match K={K} at {bits} bits")
    out = selection.kernel("qmm_small_m", factory)(
        inputs=[x.reshape(M, K), w, scales, biases],
        template=[("T", x.dtype), ("M", M), ("N", N), ("K", K), ("BITS", bits),
                  ("GS", group_size), ("ROWS", QMM_ROWS)],
        grid=(32, -(-N // QMM_ROWS), 1),
        threadgroup=(32, 2, 1),
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )[0]
    return out.reshape(*x.shape[:-1], N)


def qmv_rows_cuda(x, w, scales, biases, group_size: int = 64, bits: int = 4, factory=None,
                  rows_per_pass: int = QMV_ROWS_PASS):
    """x: [..., K] with prod(leading) <= 16; w: [N, K * bits / 32] uint32; scales, biases: [N, K / group_size].
    `rows_per_pass`: x rows whose accumulators a lane holds at once (registers against passes)."""
    K = x.shape[-1]
    N = w.shape[0]
    M = math.prod(x.shape[:-1]) if x.ndim > 1 else 1
    if M > QMM_MAX_M or not _qmv_rows_fits(bits, group_size, K, x.dtype, biases):
        raise ValueError(f"qmv_rows: unsupported M={M} bits={bits} group_size={group_size} dtype={x.dtype}")
    if w.shape[1] * 32 // bits != K:
        raise ValueError(f"qmv_rows: w {w.shape} does not match K={K} at {bits} bits")
    out = selection.warp_per_row(
        "qmv_rows", factory, [x.reshape(M, K), w, scales.astype(x.dtype), biases.astype(x.dtype)],
        [("T", x.dtype), ("BITS", bits), ("GS", group_size), ("ROWS", rows_per_pass)], M, N, x.dtype)
    return out.reshape(*x.shape[:-1], N)


def _qmv_rows_fits(bits, group_size, K, dtype, biases) -> bool:
    """Whether qmv_rows takes these weights and activations (any width up to QMM_MAX_M)."""
    return (bits in (2, 4, 8) and group_size in (32, 64, 128) and K % group_size == 0 and dtype in QMV_ROWS_DTYPES
            and biases is not None)


def _metal_width(M: int) -> bool:
    return QMM_MIN_M <= M <= QMM_MAX_M and selection.use_metal("qmm_small_m")


def _cuda_width(M: int) -> bool:
    return QMV_ROWS_MIN_M <= M <= QMM_MAX_M and selection.use_cuda("qmv_rows")


def custom_width(width: int) -> bool:
    """Whether a quantized product of `width` rows may go to a custom kernel on this backend."""
    return _metal_width(width) or _cuda_width(width)


def qmm_small_m(x, w, scales, biases, group_size: int = 64, bits: int = 4):
    """mx.quantized_matmul(x, w, scales, biases, transpose=True, ...) with a small-M kernel when on.

    The kernels take verify widths (Metal QMM_MIN_M..QMM_MAX_M, CUDA QMV_ROWS_MIN_M..QMM_MAX_M);
    other products stay on MLX's own qmv (tuned for decode) and qmm.
    """
    M = math.prod(x.shape[:-1]) if x.ndim > 1 else 1
    K = x.shape[-1]
    if _metal_width(M) and bits in (2, 4, 8) and group_size >= 32 and K % group_size == 0:
        return qmm_small_m_metal(x, w, scales, biases, group_size, bits)
    if _cuda_width(M) and _qmv_rows_fits(bits, group_size, K, x.dtype, biases):
        return qmv_rows_cuda(x, w, scales, biases, group_size, bits)
    return qmm_small_m_reference(x, w, scales, biases, group_size, bits)


def quantized_linear(layer, x):
    """`layer(x)` for an affine nn.QuantizedLinear, through qmm_small_m (for a scoped verify hook)."""
    if getattr(layer, "mode", "affine") != "affine":
        return layer(x)
    out = qmm_small_m(x, layer["weight"], layer["scales"], layer.get("biases"),
                      layer.group_size, layer.bits)
    if "bias" in layer:
        out = out + layer["bias"]
    return out
