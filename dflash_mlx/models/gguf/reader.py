"""GGUF header and tensor reading: the lean parse, without `gguf.GGUFReader`.

`gguf.GGUFReader` builds a Python object per metadata array element and takes
~25 s to open a 262k-vocabulary file, so the header is parsed here directly
(well under a second): metadata and the tensor table, no tensor data. Tensor
bytes are memory-mapped and dequantized one tensor at a time, with MLX's ops
(`dequantize.py`, `tensor_to_mlx`) or, for the types it lacks, `gguf.quants`
(`tensor_to_numpy`).
"""

import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types: fixed-size scalars by struct format; 8 string, 9 array.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF this loader can read (corrupt, truncated, unsupported)."""


@dataclass
class TensorInfo:
    name: str
    shape: tuple  # numpy order (ggml's dims reversed): (out, in) for a matrix
    ggml_type: int
    offset: int  # absolute file offset of the tensor's bytes
    nbytes: int


@dataclass
class GGUFFile:
    path: str
    version: int
    metadata: Dict[str, object]
    tensors: Dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, key, default=None):
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Cursor:
    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt):
        try:
            value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        except struct.error:
            raise GGUFError(f"{self.path}: truncated GGUF header") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self):
        n = self.take("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header (string past end of file)")
        s = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return s

    def value(self, vtype):
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                end = self.pos + count * dt.itemsize
                if end > len(self.buf):
                    raise GGUFError(f"{self.path}: truncated GGUF header (array past end of file)")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
                self.pos = end
                return arr.astype(bool) if etype == 7 else arr
            if etype == _STRING:
                return self.strings(count)
            return [self.value(etype) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown GGUF metadata type {vtype}")

    def strings(self, count):
        # The hot loop for 262k-token vocabularies: keep it minimal.
        buf, pos, out = self.buf, self.pos, []
        unpack, n_buf = struct.Struct("<Q").unpack_from, len(buf)
        for _ in range(count):
            if pos + 8 > n_buf:
                raise GGUFError(f"{self.path}: truncated GGUF header (string past end of file)")
            n = unpack(buf, pos)[0]
            pos += 8
            if pos + n > n_buf:
                raise GGUFError(f"{self.path}: truncated GGUF header (string past end of file)")
            out.append(bytes(buf[pos:pos + n]).decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out


def read_gguf(path) -> GGUFFile:
    """Parse a GGUF header (metadata + tensor table) without reading tensor data."""
    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (bad magic number)")
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise GGUFError(f"{path}: empty or unreadable file") from None
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise GGUFError(f"{path}: corrupt GGUF header (implausible counts)")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("<I"))
    raw = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.take("<I")
        if n_dims > 8:
            raise GGUFError(f"{path}: corrupt tensor table ({name}: {n_dims} dims)")
        dims = [cur.take("<Q") for _ in range(n_dims)]
        raw.append((name, tuple(reversed(dims)), cur.take("<I"), cur.take("<Q")))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = (cur.pos + alignment - 1) // alignment * alignment

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = len(buf)
    tensors = {}
    for name, shape, ggml_type, offset in raw:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise GGUFError(f"{path}: tensor {name} has unknown ggml type {ggml_type}") from None
        n = int(np.prod(shape)) if shape else 1
        nbytes = n // block * type_size
        start = data_start + offset
        if start + nbytes > size:
            raise GGUFError(f"{path}: truncated file (tensor {name} past end of file)")
        tensors[name] = TensorInfo(name, shape, ggml_type, start, nbytes)
    buf.close()
    return GGUFFile(path, version, metadata, tensors)


def _tensor_bytes(gf: GGUFFile, name: str, data: Optional[np.ndarray]):
    """(the tensor's table entry, its bytes: a view of `data`, the file memory-mapped where None)."""
    info = gf.tensors[name]
    if data is None:
        data = np.memmap(gf.path, dtype=np.uint8, mode="r")
    return info, data[info.offset:info.offset + info.nbytes]


def tensor_to_numpy(gf: GGUFFile, name: str, data: Optional[np.ndarray] = None) -> np.ndarray:
    """One tensor dequantized to float32 (F16/BF16/F32 are converted, not copied twice)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    info, raw = _tensor_bytes(gf, name, data)
    qtype = GGMLQuantizationType(info.ggml_type)
    if qtype == GGMLQuantizationType.F32:
        return np.array(raw.view(np.float32).reshape(info.shape))
    if qtype == GGMLQuantizationType.F16:
        return raw.view(np.float16).astype(np.float32).reshape(info.shape)
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw.reshape(-1, info.shape[-1] // block * type_size)
    try:
        out = dequantize(rows, qtype)
    except NotImplementedError:
        raise GGUFError(f"{gf.path}: tensor {name}: ggml type {qtype.name} cannot be dequantized") from None
    return out.reshape(info.shape).astype(np.float32, copy=False)


def tensor_to_mlx(gf: GGUFFile, name: str, data: Optional[np.ndarray] = None):
    """One tensor as a float32 MLX array (lazy), the same values as `tensor_to_numpy`."""
    import mlx.core as mx
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from dflash_mlx.models.gguf.dequantize import dequantize

    info, raw = _tensor_bytes(gf, name, data)
    qtype = GGMLQuantizationType(info.ggml_type)
    floats = {GGMLQuantizationType.F32: mx.float32, GGMLQuantizationType.F16: mx.float16,
              GGMLQuantizationType.BF16: mx.bfloat16}.get(qtype)
    if floats is not None:
        return mx.array(np.asarray(raw)).view(floats).astype(mx.float32).reshape(info.shape)
    block = GGML_QUANT_SIZES[qtype][0]
    if not info.shape or info.shape[-1] % block:
        raise GGUFError(f"{gf.path}: tensor {name}: shape {info.shape} does not split into {qtype.name} blocks of "
                        f"{block} (a corrupt tensor table)")
    out = dequantize(raw, info.ggml_type, info.shape)
    return mx.array(tensor_to_numpy(gf, name, data)) if out is None else out
