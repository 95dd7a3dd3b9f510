"""Small-M dense matmul on MLX's CUDA backend: the verify-width products of a float target.

MLX runs a one-row x @ w.T as its CUDA gemv and a wider one through cuBLAS, which rounds each
row otherwise; gemv_rows (cuda/gemv_rows.cu) takes verify widths 2..16 and rounds each row as
gemv rounds it alone, reading the weights once for all the rows. `linear` runs a bias-free
`nn.Linear` through it (Target's scoped verify swap), `rows_product` the dense LM head.
"""

import math

import mlx.core as mx

from dflash_mlx.kernels import selection

GEMV_ROWS_MIN_M = 2
GEMV_ROWS_MAX_M = 16
GEMV_ROWS_PASS = 4  # x rows a pass (their accumulators live in registers)
GEMV_ROWS_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def per_lane(K: int) -> int:
    """The elements a lane takes a step: MLX's gemv's choice for aligned operands."""
    return 4 if K % 128 == 0 else 2 if K % 64 == 0 else 1


def gemv_rows_reference(x, w):
    return x @ w.T


def _fits(x, w) -> bool:
    """Whether gemv_rows takes these operands (any width up to GEMV_ROWS_MAX_M)."""
    return x.dtype in GEMV_ROWS_DTYPES and w.dtype == x.dtype and w.ndim == 2


def gemv_rows_cuda(x, w, factory=None, rows_per_pass: int = GEMV_ROWS_PASS):
    """x: [..., K] with prod(leading) <= 16; w: [N, K]: x @ w.T."""
    K = x.shape[-1]
    N = w.shape[0]
    M = math.prod(x.shape[:-1]) if x.ndim > 1 else 1
    if M > GEMV_ROWS_MAX_M or not _fits(x, w):
        raise ValueError(f"gemv_rows: unsupported M={M} x {x.dtype} w {w.dtype} {w.shape}")
    if w.shape[1] != K:
        raise ValueError(f"gemv_rows: w {w.shape} does not match K={K}")
    out = selection.warp_per_row("gemv_rows", factory, [x.reshape(M, K), w],
                                 [("T", x.dtype), ("NPT", per_lane(K)), ("ROWS", rows_per_pass)], M, N, x.dtype)
    return out.reshape(*x.shape[:-1], N)


def custom_width(width: int) -> bool:
    """Whether a dense product of `width` rows goes to gemv_rows on this backend."""
    return GEMV_ROWS_MIN_M <= width <= GEMV_ROWS_MAX_M and selection.use_cuda("gemv_rows")


def rows_product(x, w):
    """x @ w.T, through gemv_rows where it is on and takes the width and dtypes."""
    M = math.prod(x.shape[:-1]) if x.ndim > 1 else 1
    if custom_width(M) and _fits(x, w):
        return gemv_rows_cuda(x, w)
    return gemv_rows_reference(x, w)


def linear(layer, x):
    """`layer(x)` for a bias-free nn.Linear, through `rows_product` (for a scoped verify swap)."""
    return rows_product(x, layer["weight"])
