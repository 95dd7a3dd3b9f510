"""The GPU check's `kernels` part: dflash-mlx's CUDA kernels against MLX's own, on this GPU.

qmv_rows and gemv_rows (`dflash_mlx/kernels/cuda/`) claim that each of their rows rounds as MLX's
CUDA qmv (quantized) or gemv (dense) rounds that row alone, so a verify's projections give plain
decoding's values bit for bit, and that they read the weights once for all the rows. Here, on the
GPU, for each (gemv_rows likewise, dense weights, MLX's gemv alone and cuBLAS at M):
  rows     for each shape, dtype and bit width: how many of M rows equal the row alone through
           MLX's quantized_matmul (its qmv), bit for bit, for qmv_rows and for MLX's own product
           at M (qmv under 8 rows, a tiled qmm from 8 on); and how many equal qmv_rows' own row alone;
  times    one Qwen3-8B-shaped layer's seven 4-bit projections (4 layers' weights, so that L2 does
           not hold them), for M = 1..16: MLX's product against qmv_rows (2, 4 and 8 rows a pass);
           then the same in bf16 against gemv_rows (2, 4, 8 and 16 rows a pass).
On the CPU (the smoke run CI makes) the rows run through tests/cuda_compat's harness where g++ is
found; MLX's rows are then the CPU's (another order: only qmv_rows' own invariance is asked there),
and no time is taken.
"""

import importlib.util
import shutil
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash_mlx.kernels import gemv, qmm, selection

SHAPES = {  # name: (N, K)
    "qwen3-8b q/o": (4096, 4096), "qwen3-8b k/v": (1024, 4096), "qwen3-8b up/gate": (12288, 4096),
    "qwen3-8b down": (4096, 12288), "smollm2 up": (1536, 576), "smollm2 down": (576, 1536),
}
SMOKE_SHAPES = {"tiny": (40, 576), "tiny down": (24, 320)}


def _factory():
    """mx.fast.cuda_kernel on a GPU; the CPU harness elsewhere (None where there is no g++)."""
    if selection.on_cuda():
        return mx.fast.cuda_kernel
    if shutil.which("g++") is None:
        return None
    path = Path(__file__).resolve().parents[2] / "tests" / "cuda_compat" / "driver.py"
    spec = importlib.util.spec_from_file_location("dflash_cuda_compat_driver_gpu_check", path)
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    return driver.cuda_kernel


def _products(N, K, bits, dtype, seed, factory):
    """x [16, K] and (MLX's product, the kernel's) for 4/8-bit weights, or dense ones (bits None)."""
    kw, kx = mx.random.split(mx.random.key(seed))
    x = mx.random.normal((16, K), key=kx).astype(dtype)
    w = mx.random.normal((N, K), key=kw).astype(dtype) * 0.05
    if bits is None:
        return x, (lambda a: a @ w.T), lambda a: gemv.gemv_rows_cuda(a, w, factory=factory)
    w, scales, biases = mx.quantize(w, group_size=64, bits=bits)
    return (x, lambda a: mx.quantized_matmul(a, w, scales, biases, transpose=True, group_size=64, bits=bits),
            lambda a: qmm.qmv_rows_cuda(a, w, scales, biases, 64, bits, factory=factory))


# (dtype, bits) in the order the rows are asked for, most used first (bits None: dense)
KINDS = [(mx.bfloat16, 4), (mx.bfloat16, None), (mx.float16, 4), (mx.bfloat16, 8), (mx.float16, None),
         (mx.float32, 4), (mx.float32, None), (mx.float16, 8), (mx.float32, 8)]


def rows(shapes, kinds, widths, factory, deadline, log):
    out = []
    for (dtype, bits), (name, (N, K)) in ((kind, shape) for kind in kinds for shape in shapes.items()):
        if time.perf_counter() > deadline:
            log("  kernels: out of time (rows)")
            break
        x, mlx_product, kernel = _products(N, K, bits, dtype, len(out), factory)
        alone = [mlx_product(x[m:m + 1]) for m in range(16)]
        ours_alone = [kernel(x[m:m + 1]) for m in range(16)]
        mx.eval(alone, ours_alone)
        for M in widths:
            ours = kernel(x[:M])
            theirs = mlx_product(x[:M])
            eq_ours = sum(bool(mx.array_equal(ours[m], alone[m][0])) for m in range(M))
            eq_theirs = sum(bool(mx.array_equal(theirs[m], alone[m][0])) for m in range(M))
            invariant = sum(bool(mx.array_equal(ours[m], ours_alone[m][0])) for m in range(M))
            diff = float(mx.max(mx.abs(ours.astype(mx.float32) - mx.concatenate(alone[:M]).astype(mx.float32))))
            out.append(dict(shape=name, dtype=str(dtype).split(".")[-1], bits=bits or "dense",
                            kernel="gemv_rows" if bits is None else "qmv_rows", M=M, kernel_equal=eq_ours,
                            mlx_equal=eq_theirs, kernel_invariant=invariant,
                            kernel_max_abs_diff=diff))
        log(f"  kernels: {name} {dtype} {bits or 'dense'}: rows equal to alone "
            f"{[r['kernel_equal'] for r in out[-len(widths):]]} of {list(widths)}; "
            f"MLX's {[r['mlx_equal'] for r in out[-len(widths):]]}")
    return out


def times(layers: int, widths, passes, deadline, log, reps: int = 5, bits=4):
    """ms for one layer's seven projections at M rows: MLX's product and the kernel (qmv_rows at
    `bits`, gemv_rows for bits None; each of `passes` rows a pass)."""
    shapes = [SHAPES[n] for n in ("qwen3-8b q/o", "qwen3-8b k/v", "qwen3-8b k/v", "qwen3-8b q/o",
                                  "qwen3-8b up/gate", "qwen3-8b up/gate", "qwen3-8b down")]
    weights = []
    for layer in range(layers):
        for i, (N, K) in enumerate(shapes):
            w = mx.random.normal((N, K), key=mx.random.key(100 * layer + i)).astype(mx.bfloat16) * 0.05
            weights.append((w, None, None) if bits is None else mx.quantize(w, group_size=64, bits=bits))
    mx.eval(weights)
    xs = {K: mx.random.normal((16, K), key=mx.random.key(K)).astype(mx.bfloat16) for K in (4096, 12288)}
    k_of = (lambda w: w.shape[1]) if bits is None else (lambda w: w.shape[1] * 32 // bits)

    def timed(product, M):
        best = float("inf")
        for _ in range(reps + 1):
            mx.synchronize()
            t0 = time.perf_counter()
            mx.eval([product(xs[k_of(w)][:M], w, s, b) for w, s, b in weights])
            mx.synchronize()
            best = min(best, time.perf_counter() - t0)
        return 1000 * best / layers

    def mlx_product(x, w, s, b):
        return x @ w.T if bits is None else mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=bits)

    out = []
    for M in widths:
        if time.perf_counter() > deadline:
            log("  kernels: out of time (times)")
            break
        row = dict(M=M, mlx_ms=round(timed(mlx_product, M), 4))
        for rows_per_pass in passes:
            if bits is None:
                name = f"gemv_rows_{rows_per_pass}_ms"
                ours = lambda x, w, s, b, p=rows_per_pass: gemv.gemv_rows_cuda(x, w, rows_per_pass=p)  # noqa: E731
            else:
                name = f"qmv_rows_{rows_per_pass}_ms"
                ours = lambda x, w, s, b, p=rows_per_pass: qmm.qmv_rows_cuda(x, w, s, b, 64, bits, rows_per_pass=p)  # noqa: E731
            row[name] = round(timed(ours, M), 4)
        out.append(row)
        log(f"  kernels: M={M} {row}")
    return out


def run(smoke: bool, deadline: float, log) -> dict:
    factory = _factory()
    if factory is None:
        return {"skipped": "no CUDA and no g++ for the CPU harness"}
    on_gpu = selection.on_cuda()
    result = {"backend": "cuda" if on_gpu else "cpu harness (tests/cuda_compat)"}
    if smoke or not on_gpu:
        result["rows"] = rows(SMOKE_SHAPES, [(mx.bfloat16, 4), (mx.bfloat16, None), (mx.float32, 4),
                                             (mx.float32, None)], (2, 5), factory, deadline, log)
        return result
    # (each new variant compiles first, ~3 s of NVRTC: the rows' first kinds and the times' first widths
    # come before the rest of either)
    start = time.perf_counter()
    result["rows"] = rows(SHAPES, KINDS, (2, 4, 8, 16), factory, start + 0.5 * (deadline - start), log)
    result["times"] = times(4, range(1, 17), (2, 4, 8), start + 0.75 * (deadline - start), log)
    result["times_dense"] = times(4, range(1, 17), (2, 4, 8, 16), deadline, log, bits=None)
    return result
