"""Which hot-path kernel runs: a custom Metal or CUDA kernel where it is verified, else its pure-MLX twin.

Each op has three functions in its family's module (`context_kv`, `qmm`,
`gdn`): `<op>` (the dispatcher the engine calls), `<op>_reference` (plain MLX
ops, the definition of correct) and `<op>_metal` (the `mx.fast.metal_kernel`
path; its `factory` argument lets the Linux test harness run the very same
kernel source and launch parameters on the CPU). This module holds what they
share: the selection and the kernel objects built from metal/<name>.metal.

Selection: the Metal path runs only where `mx.metal.is_available()` and the
kernel is listed in `VERIFIED_ON_APPLE`. That set is empty: none of these
kernels has run on Apple hardware yet (see metal/README.md). Environment:
`DFLASH_MLX_KERNELS=reference` forces the twins everywhere;
`DFLASH_MLX_KERNELS=metal` enables the unverified kernels on a Metal machine
(for `tests/test_kernels_metal.py` and `benchmarks/kernels_bench.py`).

CUDA kernels (bodies and headers in dflash_mlx/kernels/cuda/, `mx.fast.cuda_kernel`) follow the
same rule on MLX's CUDA backend: they run where `mx.cuda.is_available()` and the kernel is in
`VERIFIED_ON_CUDA` (empty: none has run on a GPU yet), or everywhere on CUDA with
`DFLASH_MLX_KERNELS=cuda` (the GPU check, `benchmarks/gpu/kernels_part.py`). The Linux test
harness runs their bodies on the CPU through `tests/cuda_compat`.
The dispatchers call `selection.use_metal` / `selection.on_metal` at call
time, so tests switch a path by patching them here.

Kernels
  kv_inject     DFlash draft KV injection: k_norm + RoPE + cache layout, all layers (context_kv)
  qmm_small_m   affine-quantized matmul for verify widths M <= 16 (qmm)
  gdn_tape      Gated DeltaNet recurrence over a verify block, recording a tape (gdn)
  gdn_replay    rebuild the Gated DeltaNet state after an accepted prefix (gdn)
  qmv_rows      (CUDA) affine-quantized matmul for verify widths 2..16, each row rounded as
                MLX's CUDA qmv rounds it alone (qmm)
  gemv_rows     (CUDA) dense x @ w.T for verify widths 2..16, each row rounded as MLX's CUDA
                gemv rounds it alone (gemv)
"""

import os
from importlib import resources
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

# Kernels whose Metal path has passed tests/test_kernels_metal.py on an Apple GPU.
VERIFIED_ON_APPLE: frozenset = frozenset()

KERNELS = ("kv_inject", "qmm_small_m", "gdn_tape", "gdn_replay")

# name -> (input names, output names); sources are metal/<name>.metal.
_SPECS = {
    "kv_inject": (["kv", "k_weight", "inv_freq", "offset", "eps", "mscale"], ["k_out", "v_out"]),
    "qmm_small_m": (["x", "w", "scales", "biases"], ["out"]),
    "gdn_tape": (["q", "k", "v", "g", "beta", "state_in", "T"], ["y", "state_out", "tape"]),
    "gdn_replay": (["state_in", "k", "g", "tape", "steps", "T"], ["state_out"]),
}


# Kernels whose CUDA path has passed the GPU check's kernel part on an NVIDIA GPU.
VERIFIED_ON_CUDA: frozenset = frozenset()

# name -> (input names, output names); body dflash_mlx/kernels/cuda/<name>.cu, header <name>.cuh.
_CUDA_SPECS = {
    "qmv_rows": (["x", "w", "scales", "biases"], ["out"]),
    "gemv_rows": (["x", "w"], ["out"]),
}


def mode() -> str:
    """'auto' (default), 'reference', 'metal' or 'cuda' from DFLASH_MLX_KERNELS."""
    m = os.environ.get("DFLASH_MLX_KERNELS", "auto").strip().lower()
    return m if m in ("auto", "reference", "metal", "cuda") else "auto"


def on_metal() -> bool:
    return mx.metal.is_available()


def use_metal(name: str) -> bool:
    m = mode()
    if m == "reference" or not on_metal():
        return False
    return m == "metal" or name in VERIFIED_ON_APPLE


def on_cuda() -> bool:
    return hasattr(mx, "cuda") and mx.cuda.is_available()


def use_cuda(name: str) -> bool:
    m = mode()
    if m == "reference" or not on_cuda():
        return False
    return m == "cuda" or name in VERIFIED_ON_CUDA


def summary() -> str:
    """Which custom kernels this process runs, in one line (`dflash-mlx doctor`)."""
    if mode() == "reference":
        return "pure-MLX twins everywhere (DFLASH_MLX_KERNELS=reference)"
    if on_metal():
        names, use, flag = KERNELS, use_metal, "metal"
    elif on_cuda():
        names, use, flag = tuple(_CUDA_SPECS), use_cuda, "cuda"
    else:
        return "pure-MLX twins (no Metal or CUDA GPU here)"
    on = [n for n in names if use(n)]
    off = [n for n in names if n not in on]
    line = f"{flag}: " + ", ".join([f"{n} on" for n in on] + [f"{n} off" for n in off])
    if off:
        line += f" (unverified on this backend; DFLASH_MLX_KERNELS={flag} turns them on)"
    return line


def kernel_source(name: str) -> str:
    """The body of metal/<name>.metal (installed as the package dflash_mlx.metal)."""
    fname = f"{name}.metal"
    try:
        return resources.files("dflash_mlx.metal").joinpath(fname).read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        # Source checkout without an install: metal/ sits next to dflash_mlx/
        # (this file is dflash_mlx/kernels/selection.py).
        return (Path(__file__).resolve().parents[2] / "metal" / fname).read_text()


_cache = {}


def _built(factory: Callable, name: str, specs: dict, **sources):
    """`factory`'s kernel object for `name` (its input and output names in `specs`), built once."""
    key = (factory, name)
    if key not in _cache:
        inputs, outputs = specs[name]
        _cache[key] = factory(name=f"dflash_{name}", input_names=inputs, output_names=outputs, **sources)
    return _cache[key]


def kernel(name: str, factory: Optional[Callable] = None):
    """The kernel object for metal/<name>.metal, built once per factory."""
    return _built(factory or mx.fast.metal_kernel, name, _SPECS, source=kernel_source(name))


def cuda_source(name: str, suffix: str) -> str:
    """dflash_mlx/kernels/cuda/<name><suffix> ('' where there is none): a CUDA kernel's body (.cu) or header (.cuh)."""
    path = resources.files("dflash_mlx.kernels").joinpath("cuda").joinpath(name + suffix)
    return path.read_text() if path.is_file() else ""


def cuda_header(name: str) -> str:
    """A CUDA kernel's header: the shared helpers (cuda/common.cuh), then its own (<name>.cuh)."""
    return cuda_source("common", ".cuh") + cuda_source(name, ".cuh")


def cuda_kernel(name: str, factory: Optional[Callable] = None):
    """The kernel object for dflash_mlx/kernels/cuda/<name>.cu, built once per factory."""
    return _built(factory or mx.fast.cuda_kernel, name, _CUDA_SPECS,
                  source=cuda_source(name, ".cu"), header=cuda_header(name))


def warp_per_row(name: str, factory: Optional[Callable], inputs, template, M: int, N: int, dtype):
    """Launch CUDA kernel `name` that gives a warp to each of the N rows of its weights and
    writes an [M, N] `dtype` output (blocks of 8 warps: qmv_rows, gemv_rows)."""
    return cuda_kernel(name, factory)(
        inputs=inputs, template=template, grid=(32 * -(-N // 8), 8, 1), threadgroup=(32, 8, 1),
        output_shapes=[(M, N)], output_dtypes=[dtype],
    )[0]
