"""Run mx.fast.cuda_kernel bodies on the CPU through g++ and cuda_compat.h.

`cuda_kernel(...)` has the signature of `mx.fast.cuda_kernel`. The body is wrapped the way MLX's
CUDA backend wraps it (mlx/backend/cuda/custom_kernel.cpp: inputs as `const T*`, `<name>_shape`
/ `_strides` / `_ndim` where the source mentions them, outputs as `T*`, template arguments as
`constexpr` constants and `using` aliases at the top of the body, the header before the
function), and run through tests/metal_compat's dispatcher: MLX's grid is in threads and its
threadgroup is the CUDA block, as there, so the body sees `threadIdx`, `blockIdx`, `blockDim`
and `gridDim` derived from the same launch. Outputs start as NaN bytes and carry guard bytes
(tests/metal_compat/driver.py).
"""

import importlib.util
import re
from pathlib import Path

import mlx.core as mx

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("dflash_metal_compat_driver_for_cuda",
                                               HERE.parent / "metal_compat" / "driver.py")
metal_driver = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(metal_driver)

# MLX's dtype_to_cuda_type
_CUDA_TYPE = {
    mx.bool_: "bool", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
    mx.uint64: "uint64_t", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
    mx.int64: "int64_t", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float",
}
_INDICES = ("threadIdx", "blockIdx", "blockDim", "gridDim")


class CudaCompatKernel(metal_driver.CompatKernel):
    INCLUDE_DIRS = (HERE, HERE / "include", HERE.parent / "metal_compat")
    HEADERS = (HERE / "cuda_compat.h", HERE / "include" / "cooperative_groups" / "reduce.h",
               HERE.parent / "metal_compat" / "metal_compat.h")
    HARNESS = "cuda_compat"

    def __init__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 shared_memory=0):
        super().__init__(name, input_names, output_names, source, header, ensure_row_contiguous)
        self.attributes = [("thread_position_in_threadgroup", "uint3"),
                           ("threadgroup_position_in_grid", "uint3"),
                           ("threads_per_threadgroup", "uint3"), ("threadgroups_per_grid", "uint3")]

    def _generate(self, inputs, output_dtypes, template):
        fname = f"custom_kernel_{re.sub(r'[^A-Za-z0-9_]', '_', self.name)}"
        params, args = [], []
        slot = 0
        for name, arr, (has_shape, has_strides, has_ndim) in zip(self.input_names, inputs, self.shape_info):
            ctype = _CUDA_TYPE[arr.dtype]
            params.append(f"const {ctype}* {name}")
            args.append(f"(const {ctype}*)bufs[{slot}]")
            slot += 1
            if arr.ndim > 0:
                for present, decl, cast in ((has_shape, "const int* {}_shape", "(const int*)"),
                                            (has_strides, "const int64_t* {}_strides", "(const int64_t*)"),
                                            (has_ndim, "int {}_ndim", "*(const int*)")):
                    if present:
                        params.append(decl.format(name))
                        args.append(f"{cast}bufs[{slot}]")
                        slot += 1
        for name, dt in zip(self.output_names, output_dtypes):
            ctype = _CUDA_TYPE[dt]
            params.append(f"{ctype}* {name}")
            args.append(f"({ctype}*)bufs[{slot}]")
            slot += 1
        for index, (attr, atype) in zip(_INDICES, self.attributes):
            params.append(f"{atype} {index}")
            args.append(f"ti.{attr}")
        constants = []
        for n, v in template:
            if isinstance(v, bool):
                constants.append(f"  constexpr bool {n} = {'true' if v else 'false'};")
            elif isinstance(v, int):
                constants.append(f"  constexpr int {n} = {v};")
            else:
                constants.append(f"  using {n} = {_CUDA_TYPE[v]};")
        code = [
            '#include "cuda_compat.h"',
            self.header,
            f"void {fname}(\n  " + ",\n  ".join(params) + ") {",
            *constants,
            self.source,
            "}",
            "static void mc_thread(void* ctx, const mcompat::ThreadInfo& ti) {",
            "  void** bufs = (void**)ctx;",
            f"  {fname}(" + ", ".join(args) + ");",
            "}",
            'extern "C" int mc_run(void** bufs, const int* grid, const int* tg, char* err, int errlen) {',
            "  return mcompat::dispatch(grid, tg, mc_thread, bufs, err, errlen);",
            "}",
        ]
        return "\n".join(code) + "\n"


def cuda_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                shared_memory=0):
    """Drop-in for mx.fast.cuda_kernel that runs on the CPU (see module doc)."""
    return CudaCompatKernel(name, input_names, output_names, source, header, ensure_row_contiguous,
                            shared_memory)
