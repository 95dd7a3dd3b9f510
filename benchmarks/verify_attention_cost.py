"""What a 16-row verify's attention costs over a one-row step's, op by op, on this backend.

The oracle probe (`benchmarks/engine_overhead.py`) caps width 16 at w t(1) / t(w) of the target's own
forwards. This splits the gap t(16) - t(1) of the probe's tiny target (`benchmarks/gpu/parts.TINY`:
4 heads, 2 KV heads, head dim 16, 2 layers) into one layer's attention and its parts at the probe's
contexts: the fused SDPA call mlx-lm makes, the scores' softmax, `exp` alone over the same scores, and
an add over them (what any op costs to dispatch here).

    python benchmarks/verify_attention_cost.py --out benchmarks/results/<date>-verify-attention-cost

Best of --reps runs of --iters calls each, microseconds a call, every call evaluated.
"""

import dflash_mlx  # noqa: F401,I001  (before mlx.core: BLAS routing)

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import parts  # noqa: E402


def best_us(fn, iters: int, reps: int) -> float:
    return 1e6 * parts.best_call_seconds(fn, iters, reps, warm=20)


def layer_ops(rows: int, context: int, iters: int, reps: int) -> dict:
    cfg = parts.TINY
    heads, kv_heads, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    mx.random.seed(0)
    q = mx.random.normal((1, heads, rows, dim))
    k, v = mx.random.normal((1, kv_heads, context, dim)), mx.random.normal((1, kv_heads, context, dim))
    scores = mx.random.normal((1, heads, rows, context))
    mx.eval(q, k, v, scores)
    mask = "causal" if rows > 1 else None  # as mlx-lm's attention asks for a multi-token forward
    return {
        "sdpa": best_us(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5, mask=mask),
                        iters, reps),
        "softmax": best_us(lambda: mx.softmax(scores, axis=-1, precise=True), iters, reps),
        "exp": best_us(lambda: mx.exp(scores), iters, reps),
        "add": best_us(lambda: scores + 1.0, iters, reps),
        "scores": heads * rows * context,
    }


def forwards(contexts, iters: int, reps: int) -> dict:
    """t(1), t(16): the tiny target's own forward of so many tokens after `context` cached, in us."""
    from mlx_lm.models.cache import make_prompt_cache

    model = parts.build(parts.TINY, parts.default_dtype())
    out = {}
    for context in contexts:
        for rows in (1, 16):
            cache = make_prompt_cache(model)
            mx.eval(model(mx.arange(10, 10 + context)[None], cache=cache))
            tokens = mx.arange(rows)[None] + 3

            def forward():
                h = model(tokens, cache=cache)
                for c in cache:
                    c.trim(rows)
                return h

            out[f"{rows}@{context}"] = best_us(forward, iters, reps)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="64,128,256")
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    table = {c: {rows: layer_ops(rows, c + rows, args.iters, args.reps) for rows in (1, 16)} for c in contexts}
    whole = forwards(contexts, args.iters // 2, args.reps)
    lines = [f"backend: {mx.default_device()}, MLX {mx.__version__}, microseconds a call (best of {args.reps} x "
             f"{args.iters})", "",
             "| context | rows | scores | SDPA (one layer) | softmax | exp | add | forward (2 layers, whole model) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in contexts:
        for rows in (1, 16):
            r = table[c][rows]
            lines.append(f"| {c} | {rows} | {r['scores']} | {r['sdpa']:.1f} | {r['softmax']:.1f} | {r['exp']:.1f} | "
                         f"{r['add']:.1f} | {whole[f'{rows}@{c}']:.1f} |")
    for c in contexts:
        one, sixteen = table[c][1], table[c][16]
        gap = whole[f"16@{c}"] - whole[f"1@{c}"]
        extra_exp = sixteen["exp"] - one["exp"]
        per = 1e3 * extra_exp / (sixteen["scores"] - one["scores"])
        extra_sdpa = 2 * (sixteen["sdpa"] - one["sdpa"])
        lines.append(f"\ncontext {c}: t(16) - t(1) = {gap:.0f} us; two layers' SDPA add {extra_sdpa:.0f} us, of which "
                     f"exp over the extra scores {2 * extra_exp:.0f} us ({per:.1f} ns a score)")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"layer": {str(c): table[c] for c in contexts},
                                                            "forward_us": whole, "mlx": mx.__version__,
                                                            "device": str(mx.default_device())}, indent=1))
        (args.out / "table.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
