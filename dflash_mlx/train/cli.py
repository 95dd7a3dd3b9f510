"""`dflash-mlx train`: data generation, training and export in one resumable command.

    dflash-mlx train --target smollm2-135m --out drafts/smollm2

Everything lives in a run folder (default `<out>.run`): the target's responses
(token ids), the fp16 feature cache, checkpoints, snapshots and the curve.
Generation always skips prompts already answered; `--resume` continues training
from the run's checkpoint. The defaults (45 min of generation, then at most
60 min or 1000 steps of training) fit about two hours on a 2-core CPU; on a
faster machine raise --gen-minutes/--minutes/--steps and --batch-tokens.
"""

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)


def build_parser():
    from dflash_mlx.cli.common import ArgumentParser  # a bad flag is one line, as in every subcommand

    p = ArgumentParser(prog="dflash-mlx train", description=__doc__.split("\n\n")[0])
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
                   help="packed responses (.jsonl.gz from --pack) merged into the run first, so generation "
                        "continues where an earlier machine stopped")
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
                        "training starts at its loss (train/init.py grow_draft)")
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


def load_target(spec: str):
    """(model, tokenizer) for a target spec; uses dflash_mlx.load."""
    from dflash_mlx import load

    out = load(spec)
    return out[0], out[1]


def _layer_ids(arg, num_layers: int, n_draft: int):
    from dflash_mlx.models.draft.config import default_target_layer_ids

    if arg:
        return [int(x) for x in arg.split(",")]
    return default_target_layer_ids(num_layers, max(n_draft, 4))


def _grown_draft(src: Path, target, layers: int):
    """The checkpoint of run folder `src`, grown to `layers` layers."""
    from dflash_mlx.models.draft.config import DraftConfig
    from dflash_mlx.train.init import grow_draft
    from dflash_mlx.train.trainer import CHECKPOINT, load_run_draft

    ck = src / CHECKPOINT
    if not (src / "draft_config.json").exists() or not (ck / "draft.safetensors").exists():
        raise SystemExit(f"--grow-from {src}: not a training run folder with a checkpoint "
                         f"(draft_config.json and {CHECKPOINT}/draft.safetensors); give the --run-dir of a run")
    cfg = DraftConfig.from_dict(json.loads((src / "draft_config.json").read_text()))
    if cfg.hidden_size != target.hidden_size or cfg.num_target_layers != target.num_layers:
        raise SystemExit(f"--grow-from {src}: its draft was made for another target (hidden size "
                         f"{cfg.hidden_size}, {cfg.num_target_layers} layers; this one: {target.hidden_size}, "
                         f"{target.num_layers})")
    try:
        return grow_draft(load_run_draft(src, target), layers)
    except ValueError as e:
        raise SystemExit(f"--grow-from {src}: {e}")


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


def _draft_from_export(spec: str, target, model, overrides: dict, records, feature_dir, run: Path):
    """An exported draft as the start of a run: weights in training space (its feature
    scale, measured again on the run's records, taken back out of `fc`), its vocabulary
    and the attention `overrides`. Writes draft_config.json, feature_scale.npy and
    draft_vocab.npy into the run folder."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from dflash_mlx.models.draft.dflash import DFlashDraftModel
    from dflash_mlx.models.draft.config import DraftConfig, DraftMismatchError
    from dflash_mlx.models.draft.checkpoints import load_draft
    from dflash_mlx.train.init import measure_feature_scale
    from dflash_mlx.train.features import FeatureSource

    try:
        src = load_draft(spec, model, dtype=mx.float32, quiet=True)
    except (DraftMismatchError, FileNotFoundError, ValueError) as e:
        raise SystemExit(f"--init-from {spec}: {e}")
    if src.config.version != 1:
        raise SystemExit(f"--init-from {spec}: only DFlash 1 drafts can be continued")
    d = src.config.to_dict() | {k: v for k, v in overrides.items() if v is not None}
    if overrides and overrides.get("sliding_window") is None:
        d.pop("sliding_window", None)
    cfg = DraftConfig.from_dict(d)
    draft = DFlashDraftModel(cfg)
    draft.bind(target)
    feats = FeatureSource(target, cfg.target_layer_ids, feature_dir, save_missing=feature_dir is not None)
    scale = measure_feature_scale([feats(r) for r in records[:32]])
    weights = dict(tree_flatten(src.parameters()))
    weights["fc.weight"] = weights["fc.weight"] / mx.array(scale)[None, :]  # undo the export's fold
    draft.load_weights(list(weights.items()))
    vocab = None if src.vocab_ids is None else np.array(src.vocab_ids)
    if vocab is not None:
        draft.set_vocab(src.vocab_ids)
    mx.eval(draft.parameters())
    (run / "draft_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    np.save(run / "feature_scale.npy", scale)
    if vocab is not None:
        np.save(run / "draft_vocab.npy", vocab)
    return draft


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--export-for" or a.startswith("--export-for=") for a in argv):
        # data + settings for a GPU trainer (speculators, SpecForge): dflash_mlx/train/export_for.py
        from dflash_mlx.train.export_for import main as export_for

        return export_for(argv, build_parser())
    args = build_parser().parse_args(argv)
    import mlx.core as mx
    import numpy as np

    from dflash_mlx.models.target.adapter import Target
    from dflash_mlx.train import data as D
    from dflash_mlx.train import init as I
    from dflash_mlx.train.export import export_draft, model_card
    from dflash_mlx.train.features import FeatureSource
    from dflash_mlx.train.trainer import TrainConfig, Trainer, plot_curves, split_by_hash, split_records
    from dflash_mlx.train.vocab import build_vocab, coverage

    out = Path(args.out)
    run = Path(args.run_dir or str(out) + ".run")
    model, tokenizer = load_target(args.target)  # a bad target fails before anything is written
    run.mkdir(parents=True, exist_ok=True)
    log_file = (run / "train.log").open("a")

    def log(s):
        print(s, file=sys.stderr, flush=True)
        log_file.write(s + "\n")
        log_file.flush()

    target = Target(model)
    responses = run / "responses.jsonl"
    feat_dir = None if args.no_feature_cache else run / "features"
    copy_layers = [int(x) for x in args.copy_layers.split(",")] if args.copy_layers else None
    cfg_path = run / "draft_config.json"
    grown = None
    if args.grow_from and args.overfit:
        raise SystemExit("--overfit checks the recipe from its initialisation; leave out --grow-from")
    if args.grow_from and args.init_from:
        raise SystemExit("--grow-from and --init-from both name where the draft starts: give one")
    # bad flags fail before anything runs (an exported draft's layer count is checked when it loads)
    attn = attention_overrides(args, args.layers) if not args.init_from else {}
    if args.grow_from and not cfg_path.exists():  # checked before any generation
        grown = _grown_draft(Path(args.grow_from), target, args.layers)
        layer_ids = list(grown.config.target_layer_ids)
    else:
        layer_ids = _layer_ids(args.target_layers, target.num_layers, args.layers)
        if args.init == "target":
            # the last layers, or on hybrid targets the last ones with attention
            copy_layers = copy_layers or I.target_copy_layers(target, args.layers)
            layer_ids = I.target_init_layer_ids(target.num_layers, args.layers, copy_layers, layer_ids)

    if args.data:
        _merge_packed(args.data, responses, tokenizer, log)
    if args.pack:
        packed = D.read_records(responses)
        n = D.pack_responses(packed, args.pack)
        log(f"packed {len(packed)} records into {args.pack} ({n / 1e6:.1f} MB)")
        return 0
    if not args.skip_gen and not args.overfit:
        prompts = D.default_prompts(args.gsm8k, args.sharegpt, seed=args.seed, code_first=args.code_first)
        deadline = time.time() + 60 * args.gen_minutes if args.gen_minutes else None
        log(f"generating responses for up to {len(prompts)} prompts -> {responses}")
        D.generate_responses(
            model, tokenizer, prompts, responses, max_tokens=args.max_new_tokens,
            max_prompt_tokens=args.max_prompt_tokens, batch_size=args.gen_batch, deadline=deadline,
            feature_layers=None if feat_dir is None else layer_ids, feature_dir=feat_dir,
        )
    records = [r for r in D.read_records(responses) if len(r["response"]) >= 2]
    if not records:
        hint = (f"; a grown run brings no data of its own: pass --data <packed file> or copy "
                f"{Path(args.grow_from) / 'responses.jsonl'} there") if args.grow_from else ""
        raise SystemExit(f"no responses in {responses}: run without --skip-gen first{hint}")
    train, held = split_by_hash(records, 0.03)
    held = held[:48]
    if not held and len(records) > 1:  # tiny data sets: keep one record aside anyway
        train, held = split_records(records, 1)
    depth_train, depth_eval = _depth_records(args.depth_data) if args.depth_data else ([], [])
    if depth_train:
        train = train + depth_train * max(args.depth_repeat, 1)
        log(f"depth data: {len(depth_train)} deep training records (x{max(args.depth_repeat, 1)}), "
            f"{len(depth_eval)} held out")
        if args.max_seq_len < max(len(r["prompt"]) + len(r["response"]) for r in depth_train):
            log(f"note: --max-seq-len {args.max_seq_len} cuts the deep records; 8192 keeps them whole")
    if args.overfit:
        # the check: can the recipe fit exactly what it trains on? (deep records first when given)
        train = (depth_train + train)[: args.overfit]
        held = train

    scale_path = run / "feature_scale.npy"
    vocab_path = run / "draft_vocab.npy"
    if args.init_from and not (cfg_path.exists() and not args.overfit):
        if args.overfit:
            run = Path(tempfile.mkdtemp(prefix="overfit-init-"))
            scale_path, vocab_path, cfg_path = run / "feature_scale.npy", run / "draft_vocab.npy", run / "draft_config.json"
        grown = _draft_from_export(args.init_from, target, model, attention_overrides(
            args, _export_layers(args.init_from, model)), train, feat_dir, run)
        log(f"starting from exported draft {args.init_from}: {grown.config.num_hidden_layers} layers, "
            f"layer types {grown.config.layer_types}, window {grown.config.sliding_window}, "
            f"is_causal {grown.config.is_causal}; no Adam moments (exported drafts have none)")
    resumed = cfg_path.exists() and not args.overfit  # a resumed run keeps its architecture and vocabulary
    if args.init_from and args.overfit:
        resumed = True
    if grown is not None and not args.overfit and not args.init_from:
        cfg_path.write_text(json.dumps(grown.config.to_dict(), indent=2))
        for name in ("feature_scale.npy", "draft_vocab.npy"):
            if (Path(args.grow_from) / name).exists():
                shutil.copyfile(Path(args.grow_from) / name, run / name)
        resumed = True  # from here on it is a run folder like any other
    if resumed:
        from dflash_mlx.models.draft.config import DraftConfig

        dcfg = DraftConfig.from_dict(json.loads(cfg_path.read_text()))
        if attn and not args.init_from:
            # a new leg may change the attention (same weights): the run folder records it
            n = dcfg.num_hidden_layers
            dcfg = DraftConfig.from_dict({k: v for k, v in dcfg.to_dict().items() if k != "sliding_window"}
                                         | {k: v for k, v in attention_overrides(args, n).items() if v is not None})
            if not args.overfit:
                cfg_path.write_text(json.dumps(dcfg.to_dict(), indent=2))
    else:
        extra = dict(attn)
        if extra.get("sliding_window") is None:
            extra.pop("sliding_window", None)
        if args.intermediate_size:
            extra["intermediate_size"] = args.intermediate_size
        if args.kv_heads:
            extra["num_key_value_heads"] = args.kv_heads
        mask = None if args.mask_token == "auto" else int(args.mask_token)
        dcfg = I.make_draft_config(target, tokenizer, train, args.layers, args.block_size, args.init,
                                   layer_ids, copy_layers, mask, **extra)
        if not args.overfit:
            cfg_path.write_text(json.dumps(dcfg.to_dict(), indent=2))
    feats = FeatureSource(target, dcfg.target_layer_ids, feat_dir, save_missing=feat_dir is not None,
                          teacher_topk=args.teacher_topk if args.distill else 0)
    scale = np.load(scale_path) if resumed and scale_path.exists() else None
    vocab = None
    if args.draft_vocab and args.draft_vocab < target.vocab_size:
        if resumed and vocab_path.exists() and not args.rebuild_vocab:
            vocab = np.load(vocab_path)
        else:
            eos = list(getattr(tokenizer, "eos_token_ids", []) or [])
            vocab = build_vocab(train, args.draft_vocab, target.vocab_size, always=eos)
    mx.random.seed(args.seed)
    if grown is not None:
        draft, done = grown, {"copied_layers": [], "skipped": [], "grown_from": args.grow_from or args.init_from}
        if vocab is not None:
            draft.set_vocab(mx.array(vocab))
    else:
        draft, scale, done = I.make_draft(
            dcfg, target, train, feats, init=args.init, copy_layers=copy_layers,
            feature_scale=not args.no_feature_scale, scale=scale, qk_norm=not args.no_qk_norm_init, vocab=vocab,
        )
    if not args.overfit:
        if scale is not None:
            np.save(scale_path, scale)
        if vocab is not None:
            np.save(vocab_path, vocab)
    if grown is not None and args.grow_from:
        log(f"grown from {args.grow_from}: {draft.config.num_hidden_layers} layers")
    elif args.init == "target" and grown is None:
        log(f"initialised from the target: layers {done['copied_layers']}, "
            f"fc passes tap {done.get('passthrough_tap')}, {len(done['skipped'])} tensors left random"
            + "".join(f"; {what} random in draft layers {done[key]} ({why})" for key, what, why in (
                ("no_attention", "attention", "their target layers have none"),
                ("no_dense_mlp", "MLP", "their target layers have a sparse MoE or other MLP"))
                      if done.get(key)))
    if vocab is not None:
        log(f"draft vocabulary: {len(vocab)} tokens, {100 * coverage(train, vocab):.2f}% of response tokens")

    tcfg = TrainConfig(
        steps=args.steps, batch_tokens=args.batch_tokens, blocks_per_seq=args.blocks_per_seq, lr=args.lr,
        warmup=args.warmup, grad_clip=args.grad_clip, gamma=args.gamma, seed=args.seed,
        weight_decay=args.weight_decay, distill=args.distill, dropout=args.dropout,
        max_seq_len=args.max_seq_len,
        checkpoint_every=args.checkpoint_every,
        snapshot_every=args.snapshot_every, eval_every=0 if args.overfit else args.eval_every,
        log_every=args.log_every,
    )
    if args.overfit:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(draft, train, held, feats, tcfg, tmp, log=log, feature_scale=scale)
            before = trainer.evaluate()
            trainer.train()
            after = trainer.evaluate()
        log(overfit_report(len(train), trainer.step, before, after))
        return 0
    trainer = Trainer(draft, train, held, feats, tcfg, run, log=log, feature_scale=scale)
    trainer.depth_eval_records = depth_eval
    if args.resume and trainer.resume():
        log(f"resumed at step {trainer.step} ({trainer.tokens} supervised tokens)")
        if vocab is not None:  # the run folder's vocabulary is the current one
            from dflash_mlx.train.vocab import index_map

            draft.set_vocab(mx.array(vocab))
            trainer.vocab_index = index_map(vocab, dcfg.vocab_size)
    elif grown is not None and args.grow_from:
        from dflash_mlx.train.trainer import CHECKPOINT

        n = trainer.adopt_moments(Path(args.grow_from) / CHECKPOINT)
        log(f"Adam moments of {n} tensors taken from {args.grow_from} (new layers start at zero)")
    n_resp = sum(len(r["response"]) for r in records)
    log(f"{len(train)} training / {len(held)} held-out records, {n_resp} response tokens; "
        f"{trainer.seqs_per_step} sequences x {tcfg.blocks_per_seq} blocks per step")
    if args.follow_data:
        known = {r["id"] for r in records}

        def refresh():
            fresh = [r for r in D.read_records(responses) if r["id"] not in known and len(r["response"]) >= 2]
            known.update(r["id"] for r in fresh)
            return split_by_hash(fresh, 0.03)[0]

        trainer.refresh, trainer.refresh_every = refresh, args.follow_data
    deadline = time.time() + 60 * args.minutes if args.minutes else None
    import signal

    def stop(signum, frame):  # SIGTERM: finish the step, checkpoint, export
        trainer.stop_requested = True

    signal.signal(signal.SIGTERM, stop)
    if args.init_from and trainer.step == 0 and tcfg.eval_every:
        ev = trainer.evaluate()  # where the exported draft starts, short and deep
        if ev:
            if depth_eval:
                ev["depth"] = trainer.evaluate(depth_eval)
            trainer.evals.append(ev)
            log(f"eval step 0 (the exported draft): loss {ev['val_loss']:.3f} acc {ev['val_acc']:.3f} "
                f"tau^ {ev['val_tau_hat']:.2f} pos 1-4 {ev['val_pos_acc'][:4]}"
                + (f" | depth: loss {ev['depth']['val_loss']:.3f} acc {ev['depth']['val_acc']:.3f} "
                   f"pos 1-4 {ev['depth']['val_pos_acc'][:4]}" if depth_eval else ""))
    if not args.export_only:
        trainer.train(deadline=deadline)
    state = trainer.state_dict()
    if args.export_only and trainer.resumed_config:
        state["config"] = trainer.resumed_config  # the card describes how it was trained, not this call's flags
    tau_curve = read_tau_curve(run / "tau_curve.jsonl")
    plot_curves(state, run / "training_curve.png", tau_curve)
    # with what --follow-data added; deep records once each, however often they repeat
    trained = list({r["id"]: r for r in list(trainer.train_records) + list(held)}.values())
    short = [r for r in trained if not r.get("target_labels")]
    info = {
        "target": args.target,
        "records": len(short),
        "response_tokens": sum(len(r["response"]) for r in short),
        "depth_records": len(depth_train),
        "depth_tokens": sum(len(r["prompt"]) + len(r["response"]) for r in depth_train),
        "depth_repeat": max(args.depth_repeat, 1),
        "init_from": args.init_from,
        "steps": trainer.step,
        "supervised_tokens": trainer.tokens,
        "train_seconds": trainer.elapsed,
        "state": state,
        "compute": args.compute,
        "tau_curve": tau_curve,
        "init": args.init,
    }
    export_draft(draft, out, dtype=getattr(mx, args.dtype), card=model_card(info),
                 curve=run / "training_curve.png", feature_scale=scale)
    log(f"exported draft to {out}")
    suites = [x for x in args.tau_suites.split(",") if x]
    limits = {s: args.tau_prompts.get(s, args.tau_prompts.get("*", 0)) for s in suites}
    if any(limits.values()):
        from dflash_mlx.models.draft.checkpoints import load_draft
        from dflash_mlx.train.evaluate import measure_tau

        shipped = load_draft(out, model)  # exactly what users get (exported dtype, vocabulary)
        info["tau"] = {}
        for suite, n in limits.items():
            if n > 0:
                info["tau"].update(measure_tau(model, tokenizer, shipped, [suite], limit=n,
                                               max_tokens=args.tau_max_tokens, log=log))
        (run / "tau_final.json").write_text(json.dumps(info["tau"], indent=2))
        (out / "README.md").write_text(model_card(info))
    return 0


def _depth_records(folder):
    from dflash_mlx.train import data as D

    folder = Path(folder)
    if not (folder / "depth-train.jsonl").exists():
        raise SystemExit(f"--depth-data {folder}: no depth-train.jsonl there; build it with "
                         "`python -m dflash_mlx.train.depth_data build ... --run-dir` first")
    train = D.read_records(folder / "depth-train.jsonl")
    held = D.read_records(folder / "depth-eval.jsonl") if (folder / "depth-eval.jsonl").exists() else []
    return train, held


def _export_layers(spec: str, model) -> int:
    from dflash_mlx.models.draft.checkpoints import load_draft

    return load_draft(spec, model, quiet=True).config.num_hidden_layers


def _tau_prompts(text: str) -> dict:
    """'4' -> {'*': 4}; 'gsm8k=20,humaneval=6' -> {'gsm8k': 20, 'humaneval': 6}."""
    import argparse

    try:
        if "=" not in text:
            return {"*": int(text)}
        return {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(",") if part.strip())}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or suite=number,... (e.g. gsm8k=20,humaneval=6), got {text!r}")


def _merge_packed(packed, responses: Path, tokenizer, log):
    """Append the packed records the run does not have yet (generation then skips them)."""
    from dflash_mlx.train import data as D

    have = {r["id"] for r in D.read_records(responses)}
    new = [r for r in D.unpack_responses(packed, tokenizer, log=log) if r["id"] not in have]
    responses.parent.mkdir(parents=True, exist_ok=True)
    with responses.open("a") as f:
        for r in new:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    log(f"merged {len(new)} records from {packed}")


def overfit_report(n_records: int, steps: int, before: dict, after: dict) -> str:
    """Per-position top-1 accuracy on the training sequences themselves, before and after."""
    lines = [f"overfit check: {n_records} sequences, {steps} steps",
             f"  loss {before['val_loss']:.3f} -> {after['val_loss']:.3f}   "
             f"top-1 {before['val_acc']:.3f} -> {after['val_acc']:.3f}   "
             f"tau^ {before['val_tau_hat']:.2f} -> {after['val_tau_hat']:.2f}",
             "  position  " + " ".join(f"{k:>5d}" for k in range(1, len(after["val_pos_acc"]) + 1)),
             "  before    " + " ".join(f"{a:5.2f}" for a in before["val_pos_acc"]),
             "  after     " + " ".join(f"{a:5.2f}" for a in after["val_pos_acc"])]
    return "\n".join(lines)


def read_tau_curve(path):
    """Engine tau measured at weight snapshots (written by an evaluation run), sorted by tokens."""
    path = Path(path)
    if not path.exists():
        return None
    pts = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(pts, key=lambda p: p["tokens"]) or None


if __name__ == "__main__":
    sys.exit(main())
