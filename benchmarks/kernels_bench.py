"""Micro-benchmark: each custom Metal kernel vs its pure-MLX twin (Apple Metal only).

    python benchmarks/kernels_bench.py [--iters 50]

Prints milliseconds per call (median of --iters, after warm-up) at verify-time
shapes. Elsewhere it says that it needs Metal and exits 0.
"""

import argparse
import statistics
import sys
import time


def _time(fn, iters):
    import mlx.core as mx

    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def cases():
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.gated_delta import gated_delta_kernel, gated_delta_ops

    from dflash_mlx.kernels import context_kv, gdn, qmm

    mx.random.seed(0)
    # KV injection: Qwen3-8B-DFlash-b16 shapes (5 layers, 8 kv heads, d 128).
    rope = nn.RoPE(128, traditional=False, base=1_000_000.0)
    for S in (1, 16):
        kv = mx.random.normal((1, S, 5, 2, 8, 128)).astype(mx.bfloat16)
        w = mx.ones((5, 128), dtype=mx.bfloat16)
        yield (f"kv_inject S={S}",
               lambda kv=kv, w=w: context_kv.context_kv_metal(kv, w, 1000, eps=1e-6, rope=rope),
               lambda kv=kv, w=w: context_kv.context_kv_reference(kv, w, 1000, eps=1e-6, rope=rope))

    # Small-M quantized matmul: 4k hidden projections at verify widths.
    for bits in (4, 8):
        for N, K in ((4096, 4096), (12288, 4096)):
            wq, s, b = mx.quantize(mx.random.normal((N, K)).astype(mx.bfloat16), group_size=64, bits=bits)
            for M in (4, 8, 16):
                x = mx.random.normal((M, K)).astype(mx.bfloat16)
                yield (f"qmm {bits}-bit M={M} {N}x{K}",
                       lambda x=x, wq=wq, s=s, b=b, bits=bits: qmm.qmm_small_m_metal(x, wq, s, b, 64, bits),
                       lambda x=x, wq=wq, s=s, b=b, bits=bits: qmm.qmm_small_m_reference(x, wq, s, b, 64, bits))

    # Gated DeltaNet: Qwen3.5-style linear-attention layer, 16-token verify.
    B, T, Hk, Hv, D = 1, 16, 16, 32, 128
    q = mx.random.normal((B, T, Hk, D)).astype(mx.bfloat16)
    k = (mx.random.normal((B, T, Hk, D)) / D**0.5).astype(mx.bfloat16)
    v = mx.random.normal((B, T, Hv, D)).astype(mx.bfloat16)
    g = mx.exp(-mx.random.uniform(0.01, 0.5, (B, T, Hv)))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv))).astype(mx.bfloat16)
    state = mx.random.normal((B, Hv, D, D))
    yield ("gdn_tape T=16 (vs mlx-lm kernel)",
           lambda: gdn.gdn_tape_metal(q, k, v, g, beta, state),
           lambda: gated_delta_kernel(q, k, v, g, beta, state))
    _, _, tape = gdn.gdn_tape_metal(q, k, v, g, beta, state)
    mx.eval(tape)
    for a in (3, 8):
        yield (f"gdn_replay {a} steps (vs mlx-lm kernel rerun)",
               lambda a=a: gdn.gdn_replay_metal(state, k, g, tape, a),
               lambda a=a: gated_delta_kernel(q[:, :a], k[:, :a], v[:, :a], g[:, :a], beta[:, :a], state)[1])
    yield ("gdn_replay 8 steps (vs ops twin)",
           lambda: gdn.gdn_replay_metal(state, k, g, tape, 8),
           lambda: gated_delta_ops(q[:, :8], k[:, :8], v[:, :8], g[:, :8], beta[:, :8], state)[1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args(argv)
    import dflash_mlx  # noqa: F401  (routes BLAS before mlx.core loads)
    import mlx.core as mx

    if not mx.metal.is_available():
        print("kernels_bench: needs Apple Metal (mx.metal.is_available() is False); nothing to measure here.")
        return 0
    print(f"{'case':44s} {'kernel ms':>10s} {'twin ms':>10s} {'speed-up':>9s}")
    for name, kernel, twin in cases():
        tk, tr = _time(kernel, args.iters), _time(twin, args.iters)
        print(f"{name:44s} {tk:10.3f} {tr:10.3f} {tr / tk:8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
