"""Small-M affine-quantized matmul: the verify-width products of a quantized target.

MLX's own quantized matmul is tuned for decode (one row, qmv) and for wide
prefills (qmm); a verify block of 4..16 rows sits between the two. The
qmm_small_m kernel covers exactly those widths (`QMM_MIN_M`..`QMM_MAX_M`);
`quantized_linear` runs an `nn.QuantizedLinear` through it (Target's scoped
verify hook, and its LM head).
"""

import math

import mlx.core as mx

from dflash_mlx.kernels import selection

QMM_MIN_M = 4
QMM_MAX_M = 16
QMM_ROWS = 4  # weight rows per SIMD-group


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


def qmm_small_m(x, w, scales, biases, group_size: int = 64, bits: int = 4):
    """mx.quantized_matmul(x, w, scales, biases, transpose=True, ...) with the small-M kernel when on.

    The kernel takes verify widths QMM_MIN_M..QMM_MAX_M; narrower products stay
    on MLX's own qmv (tuned for decode), wider ones on its qmm.
    """
    M = math.prod(x.shape[:-1]) if x.ndim > 1 else 1
    if (QMM_MIN_M <= M <= QMM_MAX_M and bits in (2, 4, 8) and group_size >= 32
            and x.shape[-1] % group_size == 0 and selection.use_metal("qmm_small_m")):
        return qmm_small_m_metal(x, w, scales, biases, group_size, bits)
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
