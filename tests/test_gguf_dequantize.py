"""GGUF dequantization with MLX's ops (`models/gguf/dequantize.py`) is bit for bit
`gguf.quants.dequantize`, for every block type it takes, and the types it does not take still
load through `gguf.quants`."""

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from dflash_mlx.models.gguf import reader
from dflash_mlx.models.gguf.dequantize import dequantize, dequantizer

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_random_blocks_dequantize_as_gguf_does(qtype):
    # Any bytes are a valid block: every bit of the nibbles, high bits and packed scales is
    # exercised, and scales that are inf or NaN must give the same inf and NaN.
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(int(qtype)).integers(0, 256, size=(5, 4 * type_size), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = gguf.quants.dequantize(raw, qtype)
    got = np.array(dequantize(raw, int(qtype), expected.shape))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda q: q.name)
def test_quantized_weights_dequantize_as_gguf_does(qtype):
    weights = np.random.default_rng(0).normal(0, 0.05, size=(24, 64)).astype(np.float32)
    raw = gguf.quants.quantize(weights, qtype)
    expected = gguf.quants.dequantize(raw, qtype)
    got = np.array(dequantize(raw, int(qtype), weights.shape))
    np.testing.assert_array_equal(got, expected)
    assert np.abs(got - weights).max() < 0.05  # and it is the weights, roughly


def _write(path, name, raw, qtype):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor(name, raw, raw_dtype=qtype)  # raw: the bytes, [rows, bytes a row]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("qtype", [Q.IQ4_NL, Q.IQ4_XS, Q.F16, Q.BF16, Q.Q3_K, Q.Q6_K], ids=lambda q: q.name)
def test_a_file_tensor_is_the_same_through_mlx_and_through_gguf(tmp_path, qtype):
    # the IQ types have no MLX dequantizer here: they go through gguf.quants (F16 and BF16 are views)
    assert (dequantizer(int(qtype)) is None) == (qtype in (Q.IQ4_NL, Q.IQ4_XS, Q.F16, Q.BF16))
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows, columns = 3, 2 * 256
    raw = np.random.default_rng(1).integers(0, 256, size=(rows, columns // block * type_size), dtype=np.uint8)
    if qtype in (Q.F16, Q.BF16):  # finite floats: gguf's numpy BF16 path flushes NaN payloads
        raw = np.random.default_rng(1).normal(size=(rows, columns)).astype(np.float32)
        raw = (raw.astype(np.float16) if qtype == Q.F16 else (raw.view(np.uint32) >> 16).astype(np.uint16))
        raw = raw.view(np.uint8)
    path = tmp_path / "t.gguf"
    _write(path, "blk.0.attn_q.weight", raw, qtype)
    gf = reader.read_gguf(path)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = reader.tensor_to_numpy(gf, "blk.0.attn_q.weight")
        got = reader.tensor_to_mlx(gf, "blk.0.attn_q.weight")
    assert got.dtype == mx.float32 and tuple(got.shape) == (rows, columns)
    np.testing.assert_array_equal(np.array(got), expected)


def test_a_tensor_that_is_not_whole_blocks_is_a_clear_error(tmp_path):
    raw = np.zeros((2, 34), dtype=np.uint8)  # two Q8_0 blocks: 64 values
    path = tmp_path / "t.gguf"
    _write(path, "blk.0.attn_q.weight", raw, Q.Q8_0)
    gf = reader.read_gguf(path)
    info = gf.tensors["blk.0.attn_q.weight"]
    gf.tensors["blk.0.attn_q.weight"] = reader.TensorInfo(info.name, (2, 30), info.ggml_type, info.offset, 60)
    with pytest.raises(reader.GGUFError, match=r"shape \(2, 30\) does not split into Q8_0 blocks of 32"):
        reader.tensor_to_mlx(gf, "blk.0.attn_q.weight")
