"""Compile dflash-mlx's CUDA kernels with NVRTC as MLX's CUDA backend would, without a GPU.

`mx.fast.cuda_kernel` wraps a body (mlx/backend/cuda/custom_kernel.cpp: MLX's default header, the
kernel's header, a `__global__` function with the inputs as `const T*`, `<name>_shape` where the
body mentions it, the outputs, template arguments as constants) and compiles it with NVRTC
(mlx/backend/cuda/jit_module.cpp: `--device-as-default-execution-space`, `--gpu-architecture`,
include paths for MLX's device headers, CCCL and the CUDA runtime headers). This writes the same
source for every variant the engine launches and compiles it, so a kernel that NVRTC would refuse
is found here, before a GPU's minutes are spent. It checks that the source compiles, nothing of
what it computes (tests/test_kernels_cuda.py runs it on the CPU; benchmarks/gpu/kernels_part.py on
a GPU).

    pip download --no-deps "nvidia-cuda-nvrtc>=13,<14" "nvidia-cuda-runtime>=13,<14" "nvidia-cuda-cccl>=13,<14"
    (unzip the wheels; MLX's device headers: mlx/backend/cuda/device/ of MLX's source, or the
    include/ folder of an installed mlx-cuda wheel)
    python benchmarks/gpu/nvrtc_check.py --nvrtc .../libnvrtc.so.13 --include .../include \\
        --include .../include/cccl --include <folder holding mlx/backend/cuda/device> --arch sm_90a
"""

import argparse
import ctypes
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash_mlx.kernels import gemv, qmm, selection  # noqa: E402

MLX_DEFAULT_HEADER = '#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
CUDA_TYPE = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}


def wrapped(name: str, inputs, outputs, template) -> str:
    """The source MLX's build_kernel makes of kernel `name`: inputs [(name, ctype, ndim)]."""
    body = selection.cuda_source(name, ".cu")
    params = []
    for arg, ctype, ndim in inputs:
        params.append(f"    const {ctype}* {arg}")
        if ndim > 0 and f"{arg}_shape" in body:
            params.append(f"    const __grid_constant__ Shape {arg}_shape")
        if ndim > 0 and f"{arg}_strides" in body:
            params.append(f"    const __grid_constant__ Strides {arg}_strides")
        if ndim > 0 and f"{arg}_ndim" in body:
            params.append(f"    const __grid_constant__ int {arg}_ndim")
    params += [f"    {ctype}* {arg}" for arg, ctype in outputs]
    constants = [f"  using {k} = {v};" if isinstance(v, str) else f"  constexpr int {k} = {v};"
                 for k, v in template]
    return (MLX_DEFAULT_HEADER + selection.cuda_header(name)
            + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + f"__global__ void custom_kernel_dflash_{name}(\n" + ",\n".join(params) + ") {\n"
            + "\n".join(constants) + "\n\n" + body + "\n}\n\n} // namespace mlx::core::cu\n")


def qmv_rows_variants():
    for dtype, bits, gs in itertools.product(CUDA_TYPE, (2, 4, 8), (32, 64, 128)):
        t = CUDA_TYPE[dtype]
        yield (f"qmv_rows {dtype} {bits}-bit group {gs}",
               wrapped("qmv_rows", [("x", t, 2), ("w", "uint32_t", 2), ("scales", t, 2), ("biases", t, 2)],
                       [("out", t)], [("T", t), ("BITS", bits), ("GS", gs), ("ROWS", qmm.QMV_ROWS_PASS)]))


def gemv_rows_variants():
    for dtype, npt in itertools.product(CUDA_TYPE, (1, 2, 4)):
        t = CUDA_TYPE[dtype]
        yield (f"gemv_rows {dtype} {npt} a lane a step",
               wrapped("gemv_rows", [("x", t, 2), ("w", t, 2)], [("out", t)],
                       [("T", t), ("NPT", npt), ("ROWS", gemv.GEMV_ROWS_PASS)]))


def compile_source(lib, source: str, options):
    """(whether NVRTC compiled `source`, its log)."""
    prog = ctypes.c_void_p()
    src = source.encode()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"kernel.cu", 0, None, None) != 0:
        return "nvrtcCreateProgram failed"
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    rc = lib.nvrtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value + 1)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log.value.decode(errors="replace")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvrtc", required=True, help="path of libnvrtc.so")
    p.add_argument("--include", action="append", default=[], help="an include folder (repeat)")
    p.add_argument("--arch", default="sm_90a", help="NVRTC's --gpu-architecture (MLX: sm_XYa from 9.0 on)")
    p.add_argument("--show", action="store_true", help="print the first variant's source")
    p.add_argument("--ptxas-info", action="store_true", help="print ptxas' registers and spills a variant")
    args = p.parse_args(argv)
    lib = ctypes.CDLL(args.nvrtc)
    options = ["--device-as-default-execution-space", f"--gpu-architecture={args.arch}"]
    options += [f"--include-path={i}" for i in args.include]
    if args.ptxas_info:
        options.append("--ptxas-options=-v")
    failed = 0
    for i, (label, source) in enumerate(itertools.chain(qmv_rows_variants(), gemv_rows_variants())):
        if args.show and i == 0:
            print(source)
        ok, log = compile_source(lib, source, options)
        print(f"{'ok  ' if ok else 'FAIL'} {label}", flush=True)
        failed += not ok
        if not ok or args.ptxas_info:
            print(log[-3000:])
    print(f"{failed} of {i + 1} variants failed to compile" if failed else f"all {i + 1} variants compile")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
