"""Is a trained draft limited by its depth or by its data? Continue a run's checkpoint
as it is, or grown to more layers (`grow.grow_draft`), from the same weights for the
same steps, and score held-out records the run never trained on.

    python benchmarks/train_continue_grow.py --run-dir runs/v5 --steps 400 --layers 2,4 \
        --out benchmarks/results/<name>

Every variant starts at `--lr` with a short warm-up and a cosine to 0.1x, with the run's
Adam moments where its parameters match (`Trainer.adopt_moments`; `--fresh-moments`: none);
`--dropout` applies to the training forward only. Writes `results.json`.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--run-dir", required=True, help="a training run folder with a checkpoint")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--layers", default="2,4", help="comma-separated layer counts (the run's own: continued)")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--fresh-moments", action="store_true", help="restart Adam from zero moments")
    p.add_argument("--held", type=int, default=160, help="held-out records (the run's own held-out side)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import numpy as np

    from dflash_mlx import load
    from dflash_mlx.models.draft.config import DraftConfig
    from dflash_mlx.models.target.adapter import Target
    from dflash_mlx.train import data as D
    from dflash_mlx.train.grow import grow_draft
    from dflash_mlx.train.features import FeatureSource
    from dflash_mlx.train.checkpoint import CHECKPOINT, load_run_draft
    from dflash_mlx.train.config import TrainConfig
    from dflash_mlx.train.split import split_by_hash
    from dflash_mlx.train.trainer import Trainer

    run = Path(args.run_dir)
    model, _ = load(args.target)
    target = Target(model)
    cfg = DraftConfig.from_dict(json.loads((run / "draft_config.json").read_text()))
    records = [r for r in D.read_records(run / "responses.jsonl") if len(r["response"]) >= 2]
    train, held = split_by_hash(records, 0.03)  # the split `dflash-mlx train` uses
    held = held[: args.held]
    feats = FeatureSource(target, cfg.target_layer_ids, run / "features", save_missing=True)
    scale_file = run / "feature_scale.npy"
    scale = np.load(scale_file) if scale_file.exists() else None
    print(f"{len(train)} training / {len(held)} held-out records", file=sys.stderr, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for n in [int(x) for x in args.layers.split(",")]:
        draft = load_run_draft(run, target)
        if n != cfg.num_hidden_layers:
            draft = grow_draft(draft, n)
        tc = TrainConfig(steps=args.steps, batch_tokens=512, blocks_per_seq=16, lr=args.lr, gamma=7.0,
                         dropout=args.dropout, weight_decay=args.weight_decay, eval_every=0, log_every=50,
                         checkpoint_every=10**9)
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(draft, train, held, feats, tc, tmp, feature_scale=scale)
            if not args.fresh_moments:
                trainer.adopt_moments(run / CHECKPOINT)
            start = trainer.evaluate()
            t0 = time.perf_counter()
            trainer.train()
            seconds = time.perf_counter() - t0
            end = trainer.evaluate()
        name = f"{n} layers" + ("" if n == cfg.num_hidden_layers else " (grown)") + \
            (f", dropout {args.dropout}" if args.dropout else "") + f", lr {args.lr:g}" + \
            (", fresh Adam moments" if args.fresh_moments else "")
        results[name] = {"start": start, "end": end, "seconds": seconds, "steps": args.steps}
        results_path.write_text(json.dumps(results, indent=1))
        print(f"{name}: held-out loss {start['val_loss']:.3f} -> {end['val_loss']:.3f}, tau^ "
              f"{start['val_tau_hat']:.3f} -> {end['val_tau_hat']:.3f}, positions 1-4 {end['val_pos_acc'][:4]}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
