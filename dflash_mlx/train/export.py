"""Write a trained draft in z-lab's format, with a model card.

config.json + model.safetensors (via `dflash_mlx.models.draft.checkpoints.save_draft`, loadable by
any z-lab-format loader), plus the optional reduced vocabulary
(`draft_vocab.npy`), README.md and the training curve. `export_run` is a
`dflash-mlx train` run's last stage: the curve, the card, and the engine tau of
the exported draft, measured on exactly what users get.
"""

import json
import shutil
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash_mlx.models.draft.dflash import DFlashDraftModel
from dflash_mlx.models.draft.checkpoints import load_draft, save_draft
from dflash_mlx.train.curves import plot_curves, read_tau_curve
from dflash_mlx.train.evaluate import measure_tau
from dflash_mlx.train.init import fold_feature_scale


def export_draft(draft: DFlashDraftModel, out_dir, dtype=mx.float16, card: Optional[str] = None,
                 curve: Optional[Path] = None, metadata: Optional[dict] = None,
                 feature_scale=None) -> Path:
    """Save `draft` (weights cast to `dtype`) to `out_dir`; returns the folder.

    `feature_scale`: the per-dimension feature preconditioning used in training,
    folded into `fc` here so the files are plain z-lab format."""
    from dflash_mlx.models.draft.checkpoints import draft_class

    copy = draft_class(draft.config)(draft.config)
    copy.load_weights(list(tree_flatten(draft.parameters())))
    fold_feature_scale(copy, feature_scale)
    copy.load_weights([(k, v.astype(dtype)) for k, v in tree_flatten(copy.parameters())])
    if draft.vocab_ids is not None:
        copy.set_vocab(draft.vocab_ids.astype(mx.int32))
    mx.eval(copy.parameters())
    out_dir = Path(out_dir)
    save_draft(copy, out_dir, metadata={"format": "mlx", **(metadata or {})})
    if card is not None:
        (out_dir / "README.md").write_text(card)
    if curve is not None and Path(curve).exists():
        shutil.copyfile(curve, out_dir / "training_curve.png")
    return out_dir


def thin(rows: list, n: int) -> list:
    """At most n rows, evenly spaced, always with the first and the last (long runs stay readable)."""
    if len(rows) <= n:
        return list(rows)
    idx = sorted({round(i * (len(rows) - 1) / (n - 1)) for i in range(n)})
    return [rows[i] for i in idx]


def model_card(info: dict) -> str:
    """README.md for an exported draft.

    info: target, records, response_tokens, steps, supervised_tokens,
    train_seconds, state (trainer state: config, draft_config, evals), and
    optionally tau (suite -> {"tau", "prompts", "tokens"}), tau_curve
    (list of {"tokens", "tau"}), compute (free text), notes (free text).
    """
    st = info.get("state", {})
    cfg, dcfg = st.get("config", {}), st.get("draft_config", {})
    dfl = dcfg.get("dflash_config", {})
    lines = [
        f"# DFlash draft for {info.get('target', '?')}",
        "",
        "A block-diffusion draft in z-lab's DFlash format (`config.json` + `model.safetensors`), "
        "trained with `dflash-mlx train`. `draft_vocab.npy` (optional) holds the reduced "
        "draft vocabulary; a plain z-lab loader ignores it and scores the full vocabulary.",
        "",
        "## Architecture",
        f"- {dcfg.get('num_hidden_layers')} draft layers, hidden {dcfg.get('hidden_size')}, "
        f"{dcfg.get('num_attention_heads')} heads / {dcfg.get('num_key_value_heads')} KV heads, "
        f"MLP {dcfg.get('intermediate_size')}, block size {dcfg.get('block_size')}",
        f"- target layers tapped: {dfl.get('target_layer_ids')}, mask token id {dfl.get('mask_token_id')}",
        "",
        "## Data",
        f"- {info.get('records')} prompts answered greedily by the target itself "
        f"({info.get('response_tokens')} response tokens): GSM8K *train* split and ShareGPT first turns. "
        "No evaluation split was used.",
    ]
    if info.get("depth_records"):
        lines.append(f"- {info['depth_records']} deep records ({info['depth_tokens']} tokens, each "
                     f"{info.get('depth_repeat', 1)}x per epoch; `dflash_mlx/train/depth_data.py`), "
                     "labelled by the target's own argmax")
    layer_types = dcfg.get("layer_types") or []
    if "sliding_attention" in layer_types:
        lines.append(f"- attention over the context: {', '.join(layer_types)}, window "
                     f"{dcfg.get('sliding_window')}")
    lines += [
        "",
        "## Training",
        f"- {info.get('steps')} steps, {info.get('supervised_tokens')} supervised (mask-position) tokens, "
        f"{cfg.get('batch_tokens')} block tokens per step ({cfg.get('blocks_per_seq')} blocks per sequence)",
        f"- AdamW lr {cfg.get('lr')} (cosine, warm-up {cfg.get('warmup')}), grad clip {cfg.get('grad_clip')}, "
        f"loss weights exp(-(k-1)/{cfg.get('gamma')}), seed {cfg.get('seed')}",
        f"- compute: {info.get('compute') or ''} {info.get('train_seconds', 0) / 60:.0f} min of training",
    ]
    legs = [g for g in st.get("legs") or [] if g.get("end_step", g["start_step"]) > g["start_step"]]
    if len(legs) > 1:
        lines.append("- in legs, each resuming the one before:")
        for g in legs:
            lines.append(f"  - steps {g['start_step'] + 1}-{g['end_step']}: {g['minutes']:.0f} min, cosine to "
                         f"{g['schedule_steps']} steps (lr {g['start_lr']:.2g} -> {g['end_lr']:.2g}), data "
                         f"{g['start_records']} -> {g['end_records']} training records")
    if info.get("init_from"):
        lines.append(f"- continued from the exported draft `{info['init_from']}` (its weights, vocabulary "
                     "and layout; fresh Adam moments): the steps above are this continuation's only")
    elif info.get("init") == "target":
        lines.append("- initialised from the target (`dflash_mlx/train/init.py`): its last layers copied into "
                     "the draft layers, `fc` passing the feeding tap through, q/k norms at the target's q/k "
                     "RMS; features preconditioned per dimension in training, folded into `fc` here")
    evals = thin(st.get("evals") or [], 30)
    if evals:
        lines += ["", "## Held-out curve (estimate from the training forward)", "",
                  "| step | supervised tokens | loss | top-1 acc | tau estimate |", "|---|---|---|---|---|"]
        for e in evals:
            lines.append(f"| {e['step']} | {e['tokens']} | {e['val_loss']:.3f} | {e['val_acc']:.3f} | "
                         f"{e['val_tau_hat']:.2f} |")
    last = (st.get("evals") or [{}])[-1]
    if last.get("val_pos_acc"):
        pa = last["val_pos_acc"]
        lines += ["", f"## Held-out top-1 accuracy per block position (step {last['step']})", "",
                  "| position | " + " | ".join(str(k) for k in range(1, len(pa) + 1)) + " |",
                  "|---|" + "---|" * len(pa),
                  "| top-1 | " + " | ".join(f"{a:.3f}" for a in pa) + " |"]
    tau = info.get("tau")
    if tau:
        lines += ["", f"## Measured tau (engine, greedy, block size {dcfg.get('block_size', '?')})", "",
                  "| suite | prompts | generated tokens | tau |", "|---|---|---|---|"]
        for suite, t in tau.items():
            lines.append(f"| {suite} | {t['prompts']} | {t['tokens']} | {t['tau']:.2f} |")
    curve = info.get("tau_curve")
    if curve:
        lines += ["", "## Learning curve (engine tau vs training tokens)", "",
                  "| supervised tokens | tau |", "|---|---|"]
        for p in curve:
            lines.append(f"| {p['tokens']} | {p['tau']:.2f} |")
    if info.get("notes"):
        lines += ["", "## Notes", "", info["notes"]]
    lines += ["", "![training curve](training_curve.png)", ""]
    return "\n".join(lines)


def export_run(run, trainer, draft, records):
    """Export `trainer`'s draft into `run.out` with its card and curve, then measure its
    engine tau (--tau-prompts) and write that into the card. `run`: train/run.py's Run;
    `draft`: train/run_draft.py's Draft; `records`: train/run_data.py's Records."""
    args, log, out = run.args, run.log, run.out
    state = trainer.state_dict()
    if args.export_only and trainer.resumed_config:
        state["config"] = trainer.resumed_config  # the card describes how it was trained, not this call's flags
    tau_curve = read_tau_curve(run.dir / "tau_curve.jsonl")
    plot_curves(state, run.dir / "training_curve.png", tau_curve)
    # with what --follow-data added; deep records once each, however often they repeat
    trained = list({r["id"]: r for r in list(trainer.train_records) + list(records.held)}.values())
    short = [r for r in trained if not r.get("target_labels")]
    depth_train = records.depth_train
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
    export_draft(draft.model, out, dtype=getattr(mx, args.dtype), card=model_card(info),
                 curve=run.dir / "training_curve.png", feature_scale=draft.scale)
    log(f"exported draft to {out}")
    suites = [x for x in args.tau_suites.split(",") if x]
    limits = {s: args.tau_prompts.get(s, args.tau_prompts.get("*", 0)) for s in suites}
    if any(limits.values()):
        shipped = load_draft(out, run.model)  # exactly what users get (exported dtype, vocabulary)
        info["tau"] = {}
        for suite, n in limits.items():
            if n > 0:
                info["tau"].update(measure_tau(run.model, run.tokenizer, shipped, [suite], limit=n,
                                               max_tokens=args.tau_max_tokens, log=log))
        (run.dir / "tau_final.json").write_text(json.dumps(info["tau"], indent=2))
        (out / "README.md").write_text(model_card(info))
