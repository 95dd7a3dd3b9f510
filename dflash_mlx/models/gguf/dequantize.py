"""GGUF tensors dequantized with MLX's ops, bit for bit what `gguf.quants.dequantize` gives.

numpy's float16 -> float32 conversion and its many temporaries made loading slow: Gemma 3
270M's Q8_0 embedding (262,144 x 640) took 3.7-5.7 s through `gguf.quants`, and ~0.4 s here.
The block layouts are ggml's (`ggml-common.h`); each value is computed in float32 with the
same operations in the same order as `gguf.quants`, so the weights are identical (tests check
every type against it). Types not listed in `_DEQUANTIZERS` (the IQ, ternary and MXFP4 types)
go through `gguf.quants` in numpy.
"""

from typing import Callable, Dict, Optional

import mlx.core as mx
import numpy as np

QK_K = 256  # values in a K-quant super-block


def _f16(blocks: mx.array, start: int) -> mx.array:
    """The float16 at byte `start` of each block, as float32: [n, 1]."""
    return blocks[:, start:start + 2].view(mx.float16).astype(mx.float32)


def _nibbles(packed: mx.array) -> mx.array:
    """[..., k] bytes -> [..., 2, k]: the low nibbles, then the high ones (ggml's order)."""
    return mx.stack([packed & 0x0F, packed >> 4], axis=-2)


def _bits_of_u32(blocks: mx.array, start: int) -> mx.array:
    """The 32 bits of the little-endian uint32 at byte `start`, bit j at column j: [n, 32] uint8."""
    word = blocks[:, start:start + 4].view(mx.uint32)  # [n, 1]
    return ((word >> mx.arange(32, dtype=mx.uint32)) & 1).astype(mx.uint8)


def _q8_0(blocks):  # d, 32 x int8
    return blocks[:, 2:].view(mx.int8).astype(mx.float32) * _f16(blocks, 0)


def _q4_0(blocks):  # d, 16 bytes of nibbles; value (q - 8) * d
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 2:]).reshape(n, 32).astype(mx.int8) - 8
    return _f16(blocks, 0) * q.astype(mx.float32)


def _q4_1(blocks):  # d, m, 16 bytes of nibbles; value q * d + m
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 4:]).reshape(n, 32).astype(mx.float32)
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _q5_0(blocks):  # d, 32 high bits, 16 bytes of nibbles; value (q - 16) * d
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 6:]).reshape(n, 32) | (_bits_of_u32(blocks, 2) << 4)
    return _f16(blocks, 0) * (q.astype(mx.int8) - 16).astype(mx.float32)


def _q5_1(blocks):  # d, m, 32 high bits, 16 bytes of nibbles; value q * d + m
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 8:]).reshape(n, 32) | (_bits_of_u32(blocks, 4) << 4)
    return _f16(blocks, 0) * q.astype(mx.float32) + _f16(blocks, 2)


def _k_scales_and_mins(packed: mx.array):
    """Q4_K/Q5_K's twelve bytes -> the 8 sub-blocks' 6-bit scales and mins, each [n, 8]."""
    n = packed.shape[0]
    packed = packed.reshape(n, 3, 4)
    low_d, low_m, high = packed[:, 0], packed[:, 1], packed[:, 2]
    scales = mx.concatenate([low_d & 0x3F, (high & 0x0F) | ((low_d >> 2) & 0x30)], axis=-1)
    mins = mx.concatenate([low_m & 0x3F, (high >> 4) | ((low_m >> 2) & 0x30)], axis=-1)
    return scales, mins


def _k_affine(blocks, q):
    """d * scale * q - dmin * min over 8 sub-blocks of 32 (`q` [n, 8, 32] float32)."""
    n = blocks.shape[0]
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    step = (_f16(blocks, 0) * scales.astype(mx.float32)).reshape(n, 8, 1)
    offset = (_f16(blocks, 2) * mins.astype(mx.float32)).reshape(n, 8, 1)
    return (step * q - offset).reshape(n, QK_K)


def _q4_k(blocks):  # d, dmin, 12 scale bytes, 128 bytes of nibbles
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32)
    return _k_affine(blocks, q.astype(mx.float32))


def _q5_k(blocks):  # d, dmin, 12 scale bytes, 32 bytes of high bits, 128 bytes of nibbles
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    high = (blocks[:, 16:48].reshape(n, 1, 32) >> mx.arange(8, dtype=mx.uint8).reshape(1, 8, 1)) & 1
    return _k_affine(blocks, (low | (high << 4)).astype(mx.float32))


def _q2_k(blocks):  # 16 scale bytes (4-bit scale, 4-bit min), 64 bytes of 2-bit values, d, dmin
    n = blocks.shape[0]
    scales = blocks[:, :16]
    step = (_f16(blocks, 80) * (scales & 0x0F).astype(mx.float32)).reshape(n, 16, 1)
    offset = (_f16(blocks, 82) * (scales >> 4).astype(mx.float32)).reshape(n, 16, 1)
    shifts = mx.array([0, 2, 4, 6], dtype=mx.uint8).reshape(1, 1, 4, 1)
    q = ((blocks[:, 16:80].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 16, 16).astype(mx.float32)
    return (step * q - offset).reshape(n, QK_K)


def _q3_k(blocks):  # 32 bytes of high bits (set: no -4), 64 bytes of 2-bit values, 12 scale bytes, d
    n = blocks.shape[0]
    low, high = blocks[:, 96:104], blocks[:, 104:108]
    low = (low.reshape(n, 1, 8) >> mx.array([0, 4], dtype=mx.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (high.reshape(n, 1, 4) >> mx.array([0, 2, 4, 6], dtype=mx.uint8).reshape(1, 4, 1)).reshape(n, 16)
    scales = (((low & 0x0F) | ((high & 0x03) << 4)).astype(mx.int8) - 32).astype(mx.float32)
    step = (_f16(blocks, 108) * scales).reshape(n, 16, 1)
    shifts = mx.array([0, 2, 4, 6], dtype=mx.uint8).reshape(1, 1, 4, 1)
    q = ((blocks[:, 32:96].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 16, 16)
    bits = mx.arange(8, dtype=mx.uint8).reshape(1, 1, 8, 1)
    unset = ((blocks[:, :32].reshape(n, 1, 1, 32) >> bits) & 1).reshape(n, 16, 16) ^ 1
    return (step * (q.astype(mx.int8) - (unset << 2).astype(mx.int8)).astype(mx.float32)).reshape(n, QK_K)


def _q6_k(blocks):  # 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
    shifts = mx.array([0, 2, 4, 6], dtype=mx.uint8).reshape(1, 1, 4, 1)
    high = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    q = ((low | (high << 4)).astype(mx.int8) - 32).reshape(n, 16, 16).astype(mx.float32)
    step = (_f16(blocks, 208) * blocks[:, 192:208].view(mx.int8).astype(mx.float32)).reshape(n, 16, 1)
    return (step * q).reshape(n, QK_K)


# ggml type id -> (values a block, bytes a block, [n, bytes] uint8 -> [n, values] float32)
_DEQUANTIZERS: Dict[int, tuple] = {}


def _register():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    for qtype, fn in ((Q.Q4_0, _q4_0), (Q.Q4_1, _q4_1), (Q.Q5_0, _q5_0), (Q.Q5_1, _q5_1), (Q.Q8_0, _q8_0),
                      (Q.Q2_K, _q2_k), (Q.Q3_K, _q3_k), (Q.Q4_K, _q4_k), (Q.Q5_K, _q5_k), (Q.Q6_K, _q6_k)):
        _DEQUANTIZERS[int(qtype)] = (*GGML_QUANT_SIZES[qtype], fn)


def dequantizer(ggml_type: int) -> Optional[Callable]:
    """The MLX dequantizer of a ggml block type, or None where `gguf.quants` must do it."""
    if not _DEQUANTIZERS:
        _register()
    entry = _DEQUANTIZERS.get(int(ggml_type))
    return None if entry is None else entry[2]


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple) -> Optional[mx.array]:
    """A tensor's bytes (`raw`, uint8) as float32 of `shape`, or None for a type not here."""
    fn = dequantizer(ggml_type)
    if fn is None:
        return None
    nbytes = _DEQUANTIZERS[int(ggml_type)][1]
    blocks = mx.array(np.asarray(raw)).reshape(-1, nbytes)
    return fn(blocks).reshape(shape)
