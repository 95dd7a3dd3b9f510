"""Engine tau of a training run's weight snapshots: the learning curve in the unit that matters.

    python benchmarks/snapshot_tau.py --run-dir runs/v4 --suite gsm8k --limit 8

Each snapshot (`<run>/snapshots/step*.safetensors`, written with `--snapshot-every`)
is exported as users get it (feature scale folded into `fc`, float16, the run's
draft vocabulary) and decoded greedily at block 16 on benchmark prompts never
trained on. Points are appended to `<run>/tau_curve.jsonl`, which the run's
export plots (`training_curve.png`, with a log-linear trend); snapshots already
measured there are skipped, so the script can be rerun as the run goes on.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--suite", default="gsm8k")
    p.add_argument("--limit", type=int, default=8, help="prompts of the suite")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)

    import mlx.core as mx
    import numpy as np

    from dflash_mlx import load
    from dflash_mlx.models.draft.config import DraftConfig
    from dflash_mlx.models.draft.checkpoints import draft_class, load_draft
    from dflash_mlx.models.target.adapter import Target
    from dflash_mlx.train.evaluate import measure_tau
    from dflash_mlx.train.export import export_draft

    run = Path(args.run_dir)
    model, tokenizer = load(args.target, quiet=True)
    target = Target(model)
    config = DraftConfig.from_dict(json.loads((run / "draft_config.json").read_text()))
    scale = np.load(run / "feature_scale.npy") if (run / "feature_scale.npy").exists() else None
    vocab = np.load(run / "draft_vocab.npy") if (run / "draft_vocab.npy").exists() else None
    curve = run / "tau_curve.jsonl"
    done = set()
    if curve.exists():
        done = {json.loads(line)["step"] for line in curve.read_text().splitlines() if line.strip()}
    for snap in sorted((run / "snapshots").glob("step*.safetensors")):
        weights, meta = mx.load(str(snap), return_metadata=True)
        step, tokens = int(meta["step"]), int(meta["tokens"])
        if step in done:
            continue
        draft = draft_class(config)(config)
        draft.load_weights(list(weights.items()))
        if vocab is not None:
            draft.set_vocab(mx.array(vocab))
        with tempfile.TemporaryDirectory() as tmp:
            export_draft(draft, tmp, feature_scale=scale)
            shipped = load_draft(tmp, model, quiet=True)
            shipped.bind(target)
            res = measure_tau(model, tokenizer, shipped, [args.suite], limit=args.limit,
                              max_tokens=args.max_tokens, block_size=16)[args.suite]
        point = {"step": step, "tokens": tokens, "tau": res["tau"], "suite": args.suite,
                 "prompts": res["prompts"], "cycles": res["cycles"]}
        with curve.open("a") as f:
            f.write(json.dumps(point) + "\n")
        print(f"step {step} ({tokens} supervised tokens): {args.suite} tau {res['tau']:.3f} "
              f"over {res['cycles']} cycles", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
