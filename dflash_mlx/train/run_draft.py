"""The draft stage of a `dflash-mlx train` run: where the draft starts, its config,
feature scale and vocabulary.

A draft starts from one of four places: a resumed run folder (its draft_config.json,
feature_scale.npy and draft_vocab.npy are kept: a resumed run keeps its architecture
and vocabulary), another run's checkpoint grown to more layers (`--grow-from`), an
exported draft (`--init-from`), or a new draft initialised from the target
(train/init.py). What is fixed before data generation (the taps, which features the
generation caches) is `starting_point`; the rest, which needs the records, is
`build_draft`. The overfit check leaves the run folder's draft files alone.
"""

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from dflash_mlx.models.draft.checkpoints import load_draft
from dflash_mlx.models.draft.config import DraftConfig, DraftMismatchError, default_target_layer_ids
from dflash_mlx.models.draft.dflash import DFlashDraftModel
from dflash_mlx.train import init as I
from dflash_mlx.train.checkpoint import CHECKPOINT, load_run_draft
from dflash_mlx.train.features import FeatureSource
from dflash_mlx.train.grow import grow_draft
from dflash_mlx.train.init import measure_feature_scale
from dflash_mlx.train.options import attention_overrides
from dflash_mlx.train.vocab import build_vocab, coverage


@dataclass
class Start:
    """Where the draft starts, as far as it is known before any data is generated."""

    grown: Optional[DFlashDraftModel]  # --grow-from: the other run's draft, grown
    layer_ids: List[int]  # the target layers tapped
    copy_layers: Optional[List[int]]  # the target layers copied into the draft (--init target)
    attention: dict  # attention_overrides ({} with --init-from: the export's layer count decides)


@dataclass
class Draft:
    model: DFlashDraftModel
    config: DraftConfig
    features: FeatureSource
    scale: Optional[np.ndarray]  # per-dimension feature preconditioning
    vocab: Optional[np.ndarray]  # the reduced draft vocabulary (None: the full one)
    grown: bool  # started from another run's checkpoint (--grow-from) or an export (--init-from)


def starting_point(run) -> Start:
    """Checks the flags that say where the draft starts (before anything runs), and
    fixes the taps; a grown draft is loaded now, so a bad --grow-from fails early."""
    args, target = run.args, run.target
    copy_layers = [int(x) for x in args.copy_layers.split(",")] if args.copy_layers else None
    grown = None
    if args.grow_from and args.overfit:
        raise SystemExit("--overfit checks the recipe from its initialisation; leave out --grow-from")
    if args.grow_from and args.init_from:
        raise SystemExit("--grow-from and --init-from both name where the draft starts: give one")
    # bad flags fail before anything runs (an exported draft's layer count is checked when it loads)
    attn = attention_overrides(args, args.layers) if not args.init_from else {}
    if args.grow_from and not run.draft_config.exists():  # checked before any generation
        grown = _grown_draft(Path(args.grow_from), target, args.layers)
        layer_ids = list(grown.config.target_layer_ids)
    else:
        layer_ids = _layer_ids(args.target_layers, target.num_layers, args.layers)
        if args.init == "target":
            # the last layers, or on hybrid targets the last ones with attention
            copy_layers = copy_layers or I.target_copy_layers(target, args.layers)
            layer_ids = I.target_init_layer_ids(target.num_layers, args.layers, copy_layers, layer_ids)
    return Start(grown, layer_ids, copy_layers, attn)


def build_draft(run, start: Start, train: List[dict]) -> Draft:
    """The draft to train on `train`, its config, feature scale and vocabulary written
    into the run folder (not with --overfit)."""
    args, target, tokenizer, log = run.args, run.target, run.tokenizer, run.log
    grown = start.grown
    folder = run.dir
    if args.init_from and not (run.draft_config.exists() and not args.overfit):
        if args.overfit:
            folder = Path(tempfile.mkdtemp(prefix="overfit-init-"))
        grown = _draft_from_export(args.init_from, target, run.model, attention_overrides(
            args, _export_layers(args.init_from, run.model)), train, run.feature_dir, folder)
        log(f"starting from exported draft {args.init_from}: {grown.config.num_hidden_layers} layers, "
            f"layer types {grown.config.layer_types}, window {grown.config.sliding_window}, "
            f"is_causal {grown.config.is_causal}; no Adam moments (exported drafts have none)")
    cfg_path, scale_path, vocab_path = (folder / "draft_config.json", folder / "feature_scale.npy",
                                        folder / "draft_vocab.npy")
    resumed = cfg_path.exists() and not args.overfit  # a resumed run keeps its architecture and vocabulary
    if args.init_from and args.overfit:
        resumed = True
    if grown is not None and not args.overfit and not args.init_from:
        cfg_path.write_text(json.dumps(grown.config.to_dict(), indent=2))
        for name in ("feature_scale.npy", "draft_vocab.npy"):
            if (Path(args.grow_from) / name).exists():
                shutil.copyfile(Path(args.grow_from) / name, run.dir / name)
        resumed = True  # from here on it is a run folder like any other
    if resumed:
        dcfg = _resumed_config(args, cfg_path, start.attention)
    else:
        dcfg = _new_config(run, start, train, cfg_path)
    feat_dir = run.feature_dir
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
            dcfg, target, train, feats, init=args.init, copy_layers=start.copy_layers,
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
    return Draft(draft, dcfg, feats, scale, vocab, grown is not None)


def _resumed_config(args, cfg_path: Path, attn: dict) -> DraftConfig:
    dcfg = DraftConfig.from_dict(json.loads(cfg_path.read_text()))
    if attn and not args.init_from:
        # a new leg may change the attention (same weights): the run folder records it
        n = dcfg.num_hidden_layers
        dcfg = DraftConfig.from_dict({k: v for k, v in dcfg.to_dict().items() if k != "sliding_window"}
                                     | {k: v for k, v in attention_overrides(args, n).items() if v is not None})
        if not args.overfit:
            cfg_path.write_text(json.dumps(dcfg.to_dict(), indent=2))
    return dcfg


def _new_config(run, start: Start, train: List[dict], cfg_path: Path) -> DraftConfig:
    args = run.args
    extra = dict(start.attention)
    if extra.get("sliding_window") is None:
        extra.pop("sliding_window", None)
    if args.intermediate_size:
        extra["intermediate_size"] = args.intermediate_size
    if args.kv_heads:
        extra["num_key_value_heads"] = args.kv_heads
    mask = None if args.mask_token == "auto" else int(args.mask_token)
    dcfg = I.make_draft_config(run.target, run.tokenizer, train, args.layers, args.block_size, args.init,
                               start.layer_ids, start.copy_layers, mask, **extra)
    if not args.overfit:
        cfg_path.write_text(json.dumps(dcfg.to_dict(), indent=2))
    return dcfg


def _layer_ids(arg, num_layers: int, n_draft: int):
    if arg:
        return [int(x) for x in arg.split(",")]
    return default_target_layer_ids(num_layers, max(n_draft, 4))


def _grown_draft(src: Path, target, layers: int):
    """The checkpoint of run folder `src`, grown to `layers` layers."""
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


def _draft_from_export(spec: str, target, model, overrides: dict, records, feature_dir, run: Path):
    """An exported draft as the start of a run: weights in training space (its feature
    scale, measured again on the run's records, taken back out of `fc`), its vocabulary
    and the attention `overrides`. Writes draft_config.json, feature_scale.npy and
    draft_vocab.npy into the run folder."""
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


def _export_layers(spec: str, model) -> int:
    return load_draft(spec, model, quiet=True).config.num_hidden_layers
