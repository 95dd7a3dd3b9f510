"""`dflash-mlx train`'s flags, and the checks on them that argparse cannot make.

The parser is also the one `--export-for` extends (train/export_for.py), so the
recipe's defaults live in one place.
"""

import argparse

DESCRIPTION = "`dflash-mlx train`: data generation, training and export in one resumable command."


def build_parser():
    from dflash_mlx.cli.common import ArgumentParser  # a bad flag is one line, as in every subcommand

    p = ArgumentParser(prog="dflash-mlx train", description=DESCRIPTION)
    p.add_argument("--target", required=True, help="packaged name, mlx-lm folder, .gguf file or hub id")
    p.add_argument("--out", required=True, help="folder for the exported draft")
    p.add_argument("--run-dir", help="working folder (default: <out>.run)")
    g = p.add_argument_group("data")
    g.add_argument("--gsm8k", type=int, default=None, help="GSM8K train prompts (default: all 7473)")
    g.add_argument("--sharegpt", type=int, default=6000, help="ShareGPT prompts (0: none)")
    g.add_argument("--code-first", action="store_true",
                   help="answer ShareGPT's programming questions before the other prompts")
    g.add_argument("--max-new-tokens", type=int, default=192)
    g.add_argument("--max-prompt-tokens", type=int, default=320)
    g.add_argument("--gen-batch", type=int, default=32)
    g.add_argument("--gen-minutes", type=float, default=45.0,
                   help="stop generating after this long (0: answer every prompt)")
    g.add_argument("--skip-gen", action="store_true", help="train on the responses already generated")
    g.add_argument("--data", default=None,
                   help="responses merged into the run first, so generation continues where an earlier "
                        "machine stopped: packed (.jsonl.gz from --pack) or the run format (.jsonl[.gz], "
                        "prompts given as ids or null: rebuilt by id; records that cannot be are skipped)")
    g.add_argument("--depth-data", default=None, metavar="DIR",
                   help="deep records built by `python -m dflash_mlx.train.depth_data build` "
                   "(DIR/depth-train.jsonl joins the training records, DIR/depth-eval.jsonl is "
                   "evaluated apart); use with --max-seq-len 8192")
    g.add_argument("--depth-repeat", type=int, default=1, metavar="N",
                   help="each deep training record appears N times per epoch (default: 1)")
    g.add_argument("--pack", default=None, metavar="PATH",
                   help="write the run's responses compactly to PATH (token ids only, committable) and exit")
    g.add_argument("--no-feature-cache", action="store_true",
                   help="recompute target features every step instead of caching them (fp16) on disk")
    g = p.add_argument_group("draft")
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--target-layers", type=str, default=None,
                   help="comma-separated target layer ids to tap (default: 4 spread taps)")
    g.add_argument("--intermediate-size", type=int, default=None)
    g.add_argument("--kv-heads", type=int, default=None, help="draft KV heads (default: as many as heads)")
    g.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary (0: full)")
    g.add_argument("--init", choices=["target", "random"], default="target",
                   help="target: copy the target's last layers, fuse features so the first layer's context "
                        "is the target's own (dflash_mlx/train/init.py); random: fresh layers")
    g.add_argument("--copy-layers", default=None,
                   help="comma-separated target layers copied into the draft layers (default: the last ones)")
    g.add_argument("--no-feature-scale", action="store_true",
                   help="train fc on raw features instead of per-dimension 1/RMS-scaled ones")
    g.add_argument("--no-qk-norm-init", action="store_true",
                   help="leave q/k norms at 1 instead of the target's typical q/k RMS")
    g.add_argument("--mask-token", default="auto",
                   help="mask token id (auto: an unused special token, else an id absent from the data)")
    g.add_argument("--grow-from", default=None, metavar="RUN_DIR",
                   help="start from another run folder's checkpoint (its taps, feature scale and vocabulary), "
                        "grown to --layers: new layers copy its last ones with zeroed output matrices, so "
                        "training starts at its loss (train/grow.py)")
    g.add_argument("--sliding-window", type=int, default=None, metavar="N",
                   help="sliding-window attention over the context, N tokens (z-lab's sliding_window); "
                   "every layer unless --layer-types says which")
    g.add_argument("--layer-types", default=None, metavar="LIST",
                   help="per draft layer, comma list of full|sliding (e.g. full,sliding), or one "
                   "value for all; sliding needs --sliding-window")
    g.add_argument("--block-causal", action="store_true",
                   help="causal attention inside each block (z-lab's default on sliding layers); "
                   "without it the block is bidirectional, as the recipe trains, and is_causal "
                   "is written as false into the config so loaders do not guess")
    g.add_argument("--init-from", default=None, metavar="DRAFT",
                   help="start from an exported draft (packaged name or folder, e.g. smollm2-135m's "
                   "shipped one): its weights, vocabulary and layout; the window flags may change its "
                   "attention. Exported drafts carry no Adam moments: use a low --lr")
    g.add_argument("--rebuild-vocab", action="store_true",
                   help="recount the draft vocabulary from the data now present (the weights do not depend on it)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=1000)
    g.add_argument("--batch-tokens", type=int, default=1024, help="block tokens per step")
    g.add_argument("--blocks-per-seq", type=int, default=16)
    g.add_argument("--max-seq-len", type=int, default=512,
                   help="tokens of each record trained on (depth records: up to the target's window, 8192)")
    g.add_argument("--lr", type=float, default=5e-4)
    g.add_argument("--warmup", type=float, default=0.04)
    g.add_argument("--gamma", type=float, default=7.0)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--weight-decay", type=float, default=0.01, help="on weight matrices only")
    g.add_argument("--dropout", type=float, default=0.0,
                   help="dropout on the fused context and the residual branches, training only")
    g.add_argument("--distill", type=float, default=0.0, metavar="LAMBDA",
                   help="self-distillation: weight of the cross-entropy against the target's top-k "
                        "distribution (0: the target's tokens alone; 1: its distribution alone)")
    g.add_argument("--teacher-topk", type=int, default=32,
                   help="how many of the target's most likely tokens the distillation keeps per position")
    g.add_argument("--overfit", type=int, default=0, metavar="N",
                   help="overfit check: train on N sequences, print per-position accuracy on those "
                        "same sequences and exit (no export); a recipe that cannot fit N sequences is broken")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--minutes", type=float, default=60.0,
                   help="stop training after this long, then export (0: run all steps)")
    g.add_argument("--checkpoint-every", type=float, default=180.0, help="seconds")
    g.add_argument("--snapshot-every", type=int, default=0, help="steps between weight snapshots")
    g.add_argument("--eval-every", type=int, default=100)
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--resume", action="store_true", help="continue from the run folder's checkpoint")
    g.add_argument("--follow-data", type=int, default=0, metavar="STEPS",
                   help="every STEPS steps, add the responses another process appended meanwhile "
                        "(train while data generation runs)")
    g.add_argument("--export-only", action="store_true", help="no training: export the run's checkpoint")
    g = p.add_argument_group("evaluation (engine tau, greedy, on benchmark prompts never trained on)")
    g.add_argument("--tau-suites", default="gsm8k,humaneval,mtbench")
    g.add_argument("--tau-prompts", type=_tau_prompts, default={"*": 4},
                   help="prompts per suite: a number for every suite, or per suite as "
                        "gsm8k=20,humaneval=6 (0: skip)")
    g.add_argument("--tau-max-tokens", type=int, default=128)
    g.add_argument("--compute", default="", help="free text for the model card (machine, load)")
    g.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                   help="dtype of the exported weights")
    return p


def _tau_prompts(text: str) -> dict:
    """'4' -> {'*': 4}; 'gsm8k=20,humaneval=6' -> {'gsm8k': 20, 'humaneval': 6}."""
    try:
        if "=" not in text:
            return {"*": int(text)}
        return {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(",") if part.strip())}
    except ValueError:
        raise argparse.ArgumentTypeError("expected a number or suite=number,... (e.g. gsm8k=20,humaneval=6), "
                                         f"got {text!r}")


def attention_overrides(args, num_layers: int) -> dict:
    """DraftConfig fields for --sliding-window / --layer-types / --block-causal ({} when none given)."""
    if args.sliding_window is None and args.layer_types is None and not args.block_causal:
        return {}
    if args.sliding_window is not None and args.sliding_window < 2:
        raise SystemExit(f"--sliding-window must be at least 2 tokens, got {args.sliding_window}")
    names = {"full": "full_attention", "sliding": "sliding_attention",
             "full_attention": "full_attention", "sliding_attention": "sliding_attention"}
    if args.layer_types is None:
        kinds = ["sliding" if args.sliding_window else "full"]
    else:
        kinds = [k.strip() for k in args.layer_types.split(",") if k.strip()]
    bad = [k for k in kinds if k not in names]
    if bad or not kinds:
        raise SystemExit(f"--layer-types takes full or sliding per layer (e.g. full,sliding), got {args.layer_types!r}")
    if len(kinds) == 1:
        kinds = kinds * num_layers
    if len(kinds) != num_layers:
        raise SystemExit(f"--layer-types names {len(kinds)} layers but the draft has {num_layers}: "
                         "give one per layer or one for all")
    types = [names[k] for k in kinds]
    if "sliding_attention" in types and not args.sliding_window:
        raise SystemExit("--layer-types has sliding layers: give --sliding-window N")
    # Pinned either way: z-lab's loaders make sliding layers block-causal when the config is silent.
    return {"layer_types": types, "sliding_window": args.sliding_window if "sliding_attention" in types else None,
            "is_causal": bool(args.block_causal)}
