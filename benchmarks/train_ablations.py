"""Short training runs that separate what matters in the draft recipe.

    python benchmarks/train_ablations.py --run-dir runs/smollm2 --steps 60 --out benchmarks/results/<name>

Every variant trains from the same records (a training run's `responses.jsonl`
and feature cache) for the same number of steps with the same data order, then
reports held-out top-1 accuracy per mask position and the expected accept length
tau^ on records never trained on. Results: `ablations.json` and `ablations.md`.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)

VARIANTS = {
    "recipe (target init, feature scale, q/k RMS, lr 1e-3)": {},
    "random layers": {"init": "random"},
    "random layers, raw features (the old recipe)": {"init": "random", "feature_scale": False},
    "target init, raw features": {"feature_scale": False},
    "target init, q/k norms at 1": {"qk_norm": False},
    "copy layers 26-27 (tap 25)": {"copy_layers": [26, 27]},
    "lr 3e-4": {"lr": 3e-4},
    "lr 3e-3": {"lr": 3e-3},
    "gamma 4": {"gamma": 4.0},
    "block size 8": {"block_size": 8},
    "self-distillation 0.5 (top-32 of the target's distribution)": {"distill": 0.5},
    "self-distillation 1.0": {"distill": 1.0},
    "MLP 1024 (target's 1536)": {"intermediate_size": 1024},
    "1024 block tokens per step": {"batch_tokens": 1024},
    "32 anchors per sequence (1024 block tokens)": {"blocks_per_seq": 32, "batch_tokens": 1024},
    "RoPE base 1e4 (target's 1e5)": {"rope_theta": 10000.0},
}


def run_variant(target, tokenizer, train, held, feature_dir, steps, base, opts, log):
    import mlx.core as mx
    import numpy as np

    from dflash_mlx.train import init as I
    from dflash_mlx.train.features import FeatureSource
    from dflash_mlx.train.config import TrainConfig
    from dflash_mlx.train.trainer import Trainer
    from dflash_mlx.models.draft.config import default_target_layer_ids

    o = dict(base, **opts)
    copy = o.get("copy_layers")
    n_layers = o["layers"]
    # a target-initialised config adds the tap feeding the first copied layer itself
    taps = default_target_layer_ids(target.num_layers, max(n_layers, 4))
    extra = {k: o[k] for k in ("intermediate_size", "rope_theta") if k in o}
    cfg = I.make_draft_config(target, tokenizer, train, n_layers, o["block_size"], o["init"], taps, copy,
                              o["mask_token_id"], **extra)
    # What a variant computes (features, the target's top-k) is kept for the next ones,
    # unless its taps are not among the cache's layers (it would leave narrower files).
    feats = FeatureSource(target, cfg.target_layer_ids, feature_dir, save_missing=True,
                          teacher_topk=32 if o.get("distill") else 0)
    layers_file = Path(feature_dir).parent / "feature_layers.json"
    if layers_file.exists() and feats.stored != json.loads(layers_file.read_text()):
        feats.save_missing = False
    mx.random.seed(0)
    draft, scale, _ = I.make_draft(cfg, target, train, feats, init=o["init"], copy_layers=copy,
                                   feature_scale=o.get("feature_scale", True), qk_norm=o.get("qk_norm", True),
                                   vocab=o["vocab"])
    tc = TrainConfig(steps=steps, batch_tokens=o["batch_tokens"], blocks_per_seq=o.get("blocks_per_seq", 16), lr=o["lr"],
                     gamma=o["gamma"], distill=o.get("distill", 0.0), eval_every=0, log_every=10**9,
                     checkpoint_every=10**9)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(draft, train, held, feats, tc, tmp, log=log, feature_scale=scale)
        t0 = time.perf_counter()
        tr.train()
        ev = tr.evaluate()
    ev["seconds"] = time.perf_counter() - t0
    return ev


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--run-dir", required=True, help="a training run folder (responses.jsonl, features/)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--held", type=int, default=24, help="held-out records")
    p.add_argument("--only", default="", help="comma-separated variant numbers (1-based)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import numpy as np

    from dflash_mlx import load
    from dflash_mlx.progress import Progress
    from dflash_mlx.models.target.adapter import Target
    from dflash_mlx.train import data as D
    from dflash_mlx.train.init import choose_mask_token
    from dflash_mlx.train.split import split_by_hash

    run = Path(args.run_dir)
    model, tokenizer = load(args.target)
    target = Target(model)
    records = [r for r in D.read_records(run / "responses.jsonl") if len(r["response"]) >= 2]
    train, held = split_by_hash(records, 0.1)
    held = held[: args.held]
    vocab = np.load(run / "draft_vocab.npy") if (run / "draft_vocab.npy").exists() else None
    base = dict(init="target", layers=2, block_size=16, lr=1e-3, gamma=7.0, batch_tokens=512,
                mask_token_id=choose_mask_token(tokenizer, records, target.vocab_size), vocab=vocab)
    names = list(VARIANTS)
    if args.only:
        names = [names[int(i) - 1] for i in args.only.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "ablations.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    progress = Progress(len(names), "ablations", "runs")
    for i, name in enumerate(names):
        ev = run_variant(target, tokenizer, train, held, run / "features", args.steps, base, VARIANTS[name],
                         log=lambda s: None)
        ev.update(steps=args.steps, train_records=len(train), held_records=len(held))
        results[name] = ev
        results_path.write_text(json.dumps(results, indent=2))
        print(f"\n{name}: acc {ev['val_acc']:.3f} tau^ {ev['val_tau_hat']:.2f} pos {ev['val_pos_acc'][:4]}",
              file=sys.stderr, flush=True)
        progress.update(i + 1, force=True)
    progress.close()
    (out / "ablations.md").write_text(table(results))
    print(table(results))
    return 0


def table(results) -> str:
    rows = ["| variant | held-out loss | top-1 | pos 1 | pos 2 | pos 3 | pos 4 | pos 8 | pos 15 | tau^ | s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, ev in results.items():
        pa = ev["val_pos_acc"] + [float("nan")] * 16
        rows.append(f"| {name} | {ev['val_loss']:.2f} | {ev['val_acc']:.3f} | {pa[0]:.3f} | {pa[1]:.3f} | "
                    f"{pa[2]:.3f} | {pa[3]:.3f} | {pa[7]:.3f} | {pa[14]:.3f} | {ev['val_tau_hat']:.2f} | "
                    f"{ev['seconds']:.0f} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())
