"""Cost of one draft step, DFlash vs DFlash 2, interleaved in one process (only ratios count).

    python benchmarks/draft2_cost.py [--reps 10] [--layers 2] [--block 16]

Random drafts shaped for the packaged SmolLM2-135M-Instruct target (float32), the same
context (64 prompt tokens injected once), the same DFlash weights in both: the DFlash 2
draft adds the grouped convs and the candidate selector. Each rep times, back to back:
DFlash `propose_logits` + argmax; DFlash 2 `propose_logits` + argmax; DFlash 2
`propose_logits` + `select_tokens`, over the full vocabulary and over an 8k draft
vocabulary. Prints medians and the ratios to DFlash.
"""

import argparse
import statistics
import time

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
import mlx.core as mx
from mlx.utils import tree_flatten

from dflash_mlx import load
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.models.target.adapter import Target


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=16)
    args = ap.parse_args()

    model, _ = load("smollm2-135m", quiet=True)
    target = Target(model)
    v1 = random_draft(target, num_layers=args.layers, version=1, seed=0)
    v2 = random_draft(target, num_layers=args.layers, version=2, seed=0)
    v2.load_weights(tree_flatten(v1.parameters()), strict=False)
    prompt = mx.array([list(range(100, 164))])
    _, features, _ = target.forward(prompt, target.make_cache(), v1.config.target_layer_ids)
    mx.eval(features)
    last = mx.array([5])

    def step(draft, cache, select):
        logits = draft.propose_logits(last, None, cache, args.block)
        ids = draft.select_tokens(logits) if select else mx.argmax(logits, axis=-1)
        mx.eval(ids)

    for label, vocab in (("full vocabulary", None), ("8k draft vocabulary", mx.arange(8192, dtype=mx.int32))):
        v1.set_vocab(vocab)
        v2.set_vocab(vocab)
        caches = {}
        for name, draft in (("v1", v1), ("v2", v2)):
            caches[name] = draft.make_cache()
            draft.inject(features, caches[name])
        runs = {"DFlash": (v1, "v1", False), "DFlash 2, argmax": (v2, "v2", False),
                "DFlash 2, selector": (v2, "v2", True)}
        times = {k: [] for k in runs}
        for rep in range(args.reps + 2):
            for name, (draft, cache, select) in runs.items():
                t0 = time.perf_counter()
                step(draft, caches[cache], select)
                if rep >= 2:  # warm-up
                    times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["DFlash"])
        print(f"{label}, block {args.block}, {args.layers} layers, {args.reps} reps:")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"  {name:<20} {med * 1000:8.1f} ms   {med / base:5.2f}x")


if __name__ == "__main__":
    main()
