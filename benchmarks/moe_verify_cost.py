"""Verify cost by width on a small mixture-of-experts target vs a dense one (only ratios count).

    python benchmarks/moe_verify_cost.py [--reps 7] [--context 100] [--out DIR]

A random float32 Qwen3-MoE target (hidden 512, 8 layers, 64 experts, top-8, expert MLP 256:
OLMoE/Qwen3-30B-A3B proportions, scaled down) and a dense Qwen3 with the same attention and
the same active MLP width (8 x 256 = 2048). After a `--context`-token prefill, each rep times,
interleaved, a target forward of w rows for every width w (then trims it back), and counts the
distinct experts the w rows route to per layer. Prints t(w)/t(1) for both, writes
`results.json`, `README.md` and `verify_cost.png` to `--out`.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
import mlx.core as mx
import numpy as np
from mlx_lm.models import qwen3, qwen3_moe

from dflash_mlx.cli.doctor import machine
from dflash_mlx.models.target.adapter import Target

WIDTHS = (1, 2, 4, 8, 16)
COMMON = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
              max_position_embeddings=4096, tie_word_embeddings=False)
MOE = dict(COMMON, model_type="qwen3_moe", intermediate_size=2048, moe_intermediate_size=256, num_experts=64,
           num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
DENSE = dict(COMMON, model_type="qwen3", intermediate_size=8 * 256)


def build(module, cfg):
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def experts_touched(model, tokens, cache):
    """Mean over layers of the distinct experts the rows of `tokens` route to."""
    chosen, gates = [], []
    for layer in model.model.layers:
        gate = layer.mlp.gate
        k = layer.mlp.top_k

        def record(x, gate=gate, k=k):
            scores = gate(x)
            chosen.append(np.unique(np.array(mx.argpartition(-scores, k - 1, axis=-1)[..., :k])).size)
            return scores

        gates.append(gate)
        layer.mlp["gate"] = record
    try:
        mx.eval(model(tokens, cache=cache))
    finally:
        for layer, gate in zip(model.model.layers, gates):
            layer.mlp["gate"] = gate
    return float(np.mean(chosen))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--out", default="benchmarks/results/20261202-moe-verify-cost")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(0, 32000, (1, args.context)))
    models = {"moe": build(qwen3_moe, MOE), "dense": build(qwen3, DENSE)}
    targets = {name: Target(m) for name, m in models.items()}
    caches = {}
    for name, t in targets.items():
        caches[name] = t.make_cache()
        h, _, _ = t.forward(prompt, caches[name])
        mx.eval(h)
    rows = {w: mx.array(rng.integers(0, 32000, (1, w))) for w in WIDTHS}
    times = {(name, w): [] for name in targets for w in WIDTHS}
    for rep in range(args.reps + 1):
        for w in WIDTHS:
            for name, t in targets.items():
                t0 = time.perf_counter()
                h, _, _ = t.forward(rows[w], caches[name])
                mx.eval(t.logits(h))
                if rep:  # the first round warms up
                    times[(name, w)].append(time.perf_counter() - t0)
                t.rollback(caches[name], w, w, None)
    touched = {}
    for w in WIDTHS:
        touched[w] = experts_touched(models["moe"], rows[w], caches["moe"])
        targets["moe"].rollback(caches["moe"], w, w, None)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"widths": list(WIDTHS), "context": args.context, "reps": args.reps, "moe_config": MOE,
              "dense_config": DENSE, "machine": machine(),
              "seconds": {name: [med[(name, w)] for w in WIDTHS] for name in targets},
              "ratio": {name: [med[(name, w)] / med[(name, 1)] for w in WIDTHS] for name in targets},
              "experts_touched": [touched[w] for w in WIDTHS]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Verify cost by width: small MoE vs dense target ({time.strftime('%Y-%m-%d')})", "",
             f"Random float32 targets, {args.context}-token context, median of {args.reps} interleaved reps, "
             "`python benchmarks/moe_verify_cost.py`. t(1): "
             + ", ".join(f"{n} {med[(n, 1)] * 1000:.1f} ms" for n in targets) + ".", "",
             "| width | " + " | ".join(str(w) for w in WIDTHS) + " |", "|---|" + "---:|" * len(WIDTHS)]
    for name in targets:
        lines.append(f"| {name} t(w)/t(1) | " + " | ".join(f"{r:.2f}" for r in result["ratio"][name]) + " |")
    lines.append("| MoE experts touched per layer (of 64) | " + " | ".join(f"{x:.1f}" for x in touched.values())
                 + " |")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.4))
        for name in targets:
            ax.plot(WIDTHS, result["ratio"][name], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(WIDTHS, [str(w) for w in WIDTHS])
        ax.set_xlabel("verify width (rows)")
        ax.set_ylabel("t(width) / t(1)")
        ax.set_title(f"Verify cost, {args.context}-token context")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "verify_cost.png", dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
