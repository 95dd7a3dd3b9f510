"""Run mx.fast.metal_kernel bodies on the CPU through g++ and metal_compat.h.

`metal_kernel(...)` has the signature of `mx.fast.metal_kernel` and returns a
callable with the same call signature (inputs, output_shapes, output_dtypes,
grid, threadgroup, template, init_value). The kernel source is wrapped in a C++
function whose parameters are generated the way MLX generates the Metal
signature (same names, types, template parameters, `<name>_shape` /
`_strides` / `_ndim` extras and thread attributes), compiled once per distinct
generated source into a shared library, and run over the grid one threadgroup
at a time with every GPU thread as a fiber (see metal_compat.h).

Extra checks the GPU would not do: outputs start as NaN bytes (0xff) unless
`init_value` is given, so unwritten elements show up, and every output has
guard bytes on both sides that must survive the run (out-of-bounds writes).
"""

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
CXX = os.environ.get("CXX", "g++")
CXXFLAGS = ["-std=c++17", "-O1", "-shared", "-fPIC", "-w"]
GUARD = 64  # guard bytes on each side of every output

# MLX's get_type_string, and how each dtype travels through numpy.
_TYPE = {
    mx.bool_: ("bool", np.bool_),
    mx.uint8: ("uint8_t", np.uint8),
    mx.uint16: ("uint16_t", np.uint16),
    mx.uint32: ("uint32_t", np.uint32),
    mx.uint64: ("uint64_t", np.uint64),
    mx.int8: ("int8_t", np.int8),
    mx.int16: ("int16_t", np.int16),
    mx.int32: ("int32_t", np.int32),
    mx.int64: ("int64_t", np.int64),
    mx.float16: ("float16_t", np.uint16),
    mx.bfloat16: ("bfloat16_t", np.uint16),
    mx.float32: ("float", np.float32),
}

# Thread attributes MLX adds when the source mentions them (name, type).
_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]


def available() -> bool:
    return shutil.which(CXX) is not None


def cache_dir() -> Path:
    d = Path(os.environ.get("DFLASH_METAL_COMPAT_CACHE", Path(tempfile.gettempdir()) / "dflash_metal_compat"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _as_array(x):
    if isinstance(x, mx.array):
        return x
    if isinstance(x, bool):
        return mx.array(x)
    if isinstance(x, int):
        return mx.array(x, dtype=mx.int32)
    if isinstance(x, float):
        return mx.array(x, dtype=mx.float32)
    return mx.array(x)


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype in (mx.float16, mx.bfloat16):
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a))


def _from_numpy(buf: np.ndarray, dtype) -> mx.array:
    out = mx.array(buf)
    if dtype in (mx.float16, mx.bfloat16):
        out = out.view(dtype)
    return out


def _template_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    return _TYPE[v][0]


class CompatKernel:
    def __init__(self, name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, atomic_outputs=False, compile_options=None):
        if atomic_outputs:
            raise NotImplementedError("metal_compat: atomic outputs are not emulated")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.attributes = [(a, t) for a, t in _ATTRIBUTES if a in source]
        self.shape_info = [
            (f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source)
            for n in self.input_names
        ]

    # -- code generation -------------------------------------------------
    def _generate(self, inputs, output_dtypes, template):
        fname = f"custom_kernel_{re.sub(r'[^A-Za-z0-9_]', '_', self.name)}"
        params, args = [], []
        slot = 0
        for name, arr, (has_shape, has_strides, has_ndim) in zip(self.input_names, inputs, self.shape_info):
            ctype = _TYPE[arr.dtype][0]
            if arr.ndim == 0:
                params.append(f"const constant {ctype}& {name}")
                args.append(f"*(const {ctype}*)bufs[{slot}]")
            else:
                params.append(f"const device {ctype}* {name}")
                args.append(f"(const {ctype}*)bufs[{slot}]")
            slot += 1
            if arr.ndim > 0:
                if has_shape:
                    params.append(f"const constant int* {name}_shape")
                    args.append(f"(const int*)bufs[{slot}]")
                    slot += 1
                if has_strides:
                    params.append(f"const constant int64_t* {name}_strides")
                    args.append(f"(const int64_t*)bufs[{slot}]")
                    slot += 1
                if has_ndim:
                    params.append(f"const constant int& {name}_ndim")
                    args.append(f"*(const int*)bufs[{slot}]")
                    slot += 1
        for name, dt in zip(self.output_names, output_dtypes):
            ctype = _TYPE[dt][0]
            params.append(f"device {ctype}* {name}")
            args.append(f"({ctype}*)bufs[{slot}]")
            slot += 1
        for attr, atype in self.attributes:
            params.append(f"{atype} {attr}")
            args.append(f"ti.{attr}")

        tmpl_decl, tmpl_inst = "", ""
        if template:
            kinds = []
            for n, v in template:
                kind = "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename"
                kinds.append(f"{kind} {n}")
            tmpl_decl = "template <" + ", ".join(kinds) + ">\n"
            tmpl_inst = "<" + ", ".join(_template_value(v) for _, v in template) + ">"

        code = [
            '#include "metal_compat.h"',
            "using namespace metal;",
            self.header,
            f"{tmpl_decl}void {fname}(\n  " + ",\n  ".join(params) + ") {",
            self.source,
            "}",
            "static void mc_thread(void* ctx, const mcompat::ThreadInfo& ti) {",
            "  void** bufs = (void**)ctx;",
            f"  {fname}{tmpl_inst}(" + ", ".join(args) + ");",
            "}",
            'extern "C" int mc_run(void** bufs, const int* grid, const int* tg, char* err, int errlen) {',
            "  return mcompat::dispatch(grid, tg, mc_thread, bufs, err, errlen);",
            "}",
        ]
        return "\n".join(code) + "\n"

    # where the generated code's includes are found; the headers whose text keys the build cache
    INCLUDE_DIRS = (HERE,)
    HEADERS = (HERE / "metal_compat.h",)
    HARNESS = "metal_compat"

    def _library(self, code: str):
        header = "".join(h.read_text() for h in self.HEADERS)
        key = hashlib.sha256((code + header + " ".join(CXXFLAGS)).encode()).hexdigest()[:20]
        so = cache_dir() / f"{self.HARNESS}_{key}.so"
        if not so.exists():
            src = so.with_suffix(".cpp")
            src.write_text(code)
            tmp = so.with_suffix(f".{os.getpid()}.tmp")
            proc = subprocess.run(
                [CXX, *CXXFLAGS, *[f"-I{d}" for d in self.INCLUDE_DIRS], "-o", str(tmp), str(src)],
                capture_output=True, text=True,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"{self.HARNESS}: g++ failed for {self.name}:\n{proc.stderr[-4000:]}")
            os.replace(tmp, so)  # atomic: concurrent runs never load a half-written file
        lib = ctypes.CDLL(str(so))
        lib.mc_run.restype = ctypes.c_int
        return lib

    # -- call ------------------------------------------------------------
    def __call__(self, inputs, output_shapes, output_dtypes, grid, threadgroup,
                 template=None, init_value=None, verbose=False, stream=None):
        inputs = [_as_array(x) for x in inputs]
        if len(inputs) != len(self.input_names):
            raise ValueError(f"expected {len(self.input_names)} inputs, got {len(inputs)}")
        code = self._generate(inputs, output_dtypes, template or [])
        if verbose:
            print(code)
        lib = self._library(code)

        keep, ptrs = [], []
        for arr, (has_shape, has_strides, has_ndim) in zip(inputs, self.shape_info):
            buf = _to_numpy(arr)
            keep.append(buf)
            ptrs.append(buf.ctypes.data)
            if arr.ndim > 0:
                extras = []
                if has_shape:
                    extras.append(np.array(arr.shape, dtype=np.int32))
                if has_strides:
                    st = np.cumprod((list(arr.shape[1:]) + [1])[::-1])[::-1]
                    extras.append(np.ascontiguousarray(st, dtype=np.int64))
                if has_ndim:
                    extras.append(np.array([arr.ndim], dtype=np.int32))
                for e in extras:
                    keep.append(e)
                    ptrs.append(e.ctypes.data)

        outs = []
        for shape, dt in zip(output_shapes, output_dtypes):
            npt = _TYPE[dt][1]
            n = int(np.prod(shape, dtype=np.int64))
            itemsize = np.dtype(npt).itemsize
            raw = np.full(n * itemsize + 2 * GUARD, 0xA5, dtype=np.uint8)
            body = raw[GUARD:GUARD + n * itemsize].view(npt)
            if init_value is None:
                raw[GUARD:GUARD + n * itemsize] = 0xFF
            elif dt in (mx.float16, mx.bfloat16):
                body[:] = _to_numpy(mx.full((n,), init_value, dtype=dt))
            else:
                body[:] = init_value
            outs.append((raw, body, shape, dt))
            ptrs.append(raw.ctypes.data + GUARD)

        arr_t = ctypes.c_void_p * len(ptrs)
        grid_t = (ctypes.c_int * 3)(*[int(g) for g in grid])
        tg_t = (ctypes.c_int * 3)(*[int(t) for t in threadgroup])
        err = ctypes.create_string_buffer(1024)
        rc = lib.mc_run(arr_t(*ptrs), grid_t, tg_t, err, 1024)
        if rc != 0:
            raise RuntimeError(f"metal_compat: {self.name}: {err.value.decode()}")

        results = []
        for raw, body, shape, dt in outs:
            if not (np.all(raw[:GUARD] == 0xA5) and np.all(raw[-GUARD:] == 0xA5)):
                raise RuntimeError(f"metal_compat: {self.name} wrote outside an output buffer")
            results.append(_from_numpy(body.copy().reshape(shape), dt))
        return results


def metal_kernel(name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, atomic_outputs=False, compile_options=None):
    """Drop-in for mx.fast.metal_kernel that runs on the CPU (see module doc)."""
    return CompatKernel(name, input_names, output_names, source, header,
                        ensure_row_contiguous, atomic_outputs, compile_options)
