"""`dflash-mlx train --export-for speculators|specforge --out OUT`: our data and recipe
for a GPU trainer.

Writes the committed training data (the target's own greedy responses, with their
prompts rebuilt by the target's chat template) and the recipe's settings in the
trainer's formats, plus a README with the commands to run there:

- speculators 0.9.0: `data.jsonl` pre-tokenized rows (`input_ids`, `loss_mask`: 1 on
  the response), which its `prepare-data` passes through as they are; `train.yaml`
  (`speculators train --config`); `init/`, the target-initialised draft in its layout
  with our reduced vocabulary as its `d2t`/`t2d` (`draft.from_pretrained`), so its
  run starts where ours does.
- SpecForge 0.2.0: `data.jsonl` conversations (the response decoded to text),
  `draft_config.json` (z-lab's draft config, which SpecForge's DFlash reads) and
  `specforge.json` (`specforge train --config`). SpecForge drafts score the full
  vocabulary (SGLang reads no other), so no vocabulary mapping is written.

Settings that have no counterpart there are listed in the README, not guessed.
"""

import json
import sys
from pathlib import Path
from typing import List

FORMATS = ("speculators", "specforge")
# speculators packs rows into sequences of this many tokens; anchors are per packed sequence
SEQ_LEN = 8192


def recipe_records(args, tokenizer, log) -> List[dict]:
    """The training records: the committed responses (or `--data`), prompts rebuilt."""
    from dflash_mlx.train import data as D
    from dflash_mlx.train.packed import unpack_responses

    packed = Path(args.data) if args.data else D.DATA_DIR / "smollm2-135m-responses.jsonl.gz"
    if not packed.is_file():
        raise SystemExit(f"--data {packed}: no such file (a packed responses file, .jsonl.gz)")
    records = [r for r in unpack_responses(packed, tokenizer, log=log) if len(r["response"]) >= 2]
    if not records:
        raise SystemExit(f"{packed}: no record could be rebuilt (its prompt sources are missing)")
    return records


def add_args(parser):
    """The flags of this mode, added to `dflash-mlx train`'s parser (one place for the recipe's defaults)."""
    g = parser.add_argument_group("export for a GPU trainer")
    g.add_argument("--export-for", choices=FORMATS, required=True,
                   help="write data + settings for speculators or SpecForge into --out, then stop")
    g.add_argument("--hf-target", default=None,
                   help="the target's name there (hub id or folder; default: a packaged target's hub id)")
    return parser


def main(argv, parser) -> int:
    """`parser`: dflash-mlx train's own."""
    args = add_args(parser).parse_args(argv)
    from dflash_mlx import load
    from dflash_mlx.models import packaged
    from dflash_mlx.models.target.adapter import Target

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--out {out} exists and is not empty: give a new folder")
    hf_target = args.hf_target or (packaged.PACKAGED[args.target].hub_repo if packaged.is_packaged(args.target)
                                   else args.target)
    if not hf_target:
        raise SystemExit(f"--hf-target: how does {args.export_for} load {args.target!r}? (a hub id or folder)")
    model, tokenizer = load(args.target, quiet=True)
    target = Target(model, name=args.target)
    log = lambda s: print(f"[export-for] {s}", flush=True)  # noqa: E731
    records = recipe_records(args, tokenizer, log)
    draft, vocab = initial_draft(args, target, tokenizer, records)
    out.mkdir(parents=True, exist_ok=True)
    write = write_speculators if args.export_for == "speculators" else write_specforge
    files = write(out, args, records, draft, vocab, target, tokenizer, hf_target)
    n_resp = sum(len(r["response"]) for r in records)
    log(f"wrote {len(records)} records ({n_resp} response tokens) and {', '.join(files)} to {out}")
    return 0


def initial_draft(args, target, tokenizer, records):
    """The draft our recipe starts from (config, target-layer init, feature scale folded
    into fc) and its reduced vocabulary (None: full)."""
    import mlx.core as mx

    from dflash_mlx.train import init as I
    from dflash_mlx.train.features import FeatureSource
    from dflash_mlx.train.vocab import build_vocab

    copy_layers = [int(x) for x in args.copy_layers.split(",")] if args.copy_layers else None
    layer_ids = [int(x) for x in args.target_layers.split(",")] if args.target_layers else None
    if args.init == "target":
        copy_layers = copy_layers or I.target_copy_layers(target, args.layers)
        layer_ids = I.target_init_layer_ids(target.num_layers, args.layers, copy_layers, layer_ids)
    mask = None if args.mask_token == "auto" else int(args.mask_token)
    extra = {k: v for k, v in (("intermediate_size", args.intermediate_size),
                               ("num_key_value_heads", args.kv_heads)) if v}
    cfg = I.make_draft_config(target, tokenizer, records, args.layers, args.block_size, args.init,
                              layer_ids, copy_layers, mask, **extra)
    vocab = None
    if args.draft_vocab and args.draft_vocab < target.vocab_size:
        vocab = build_vocab(records, args.draft_vocab, target.vocab_size,
                            always=list(getattr(tokenizer, "eos_token_ids", []) or []))
    feats = FeatureSource(target, cfg.target_layer_ids, None, save_missing=False)
    mx.random.seed(args.seed)
    draft, scale, _ = I.make_draft(cfg, target, records[:32], feats, init=args.init, copy_layers=copy_layers,
                                   feature_scale=not args.no_feature_scale, qk_norm=not args.no_qk_norm_init,
                                   vocab=vocab)
    I.fold_feature_scale(draft, scale)  # their trainers read raw features
    return draft, vocab


def _rows(records):
    for r in records:
        yield {"id": r["id"], "input_ids": r["prompt"] + r["response"],
               "loss_mask": [0] * len(r["prompt"]) + [1] * len(r["response"])}


def _anchors(args, records) -> int:
    """Our anchor density (blocks per record) over speculators' packed sequences."""
    mean_len = sum(len(r["prompt"]) + len(r["response"]) for r in records) / len(records)
    return max(1, round(args.blocks_per_seq * SEQ_LEN / mean_len))


def write_speculators(out, args, records, draft, vocab, target, tokenizer, hf_target):
    from dflash_mlx.cli.export_draft import export_draft

    with (out / "data.jsonl").open("w") as f:
        for row in _rows(records):
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    files = ["data.jsonl"]
    # `init/` defines the draft (layers, taps, mask token, vocabulary); speculators rejects
    # other model-definition options next to `from_pretrained`
    draft_cfg = {"from_pretrained": str(out / "init")}
    export_draft(draft, out / "init", "speculators", target=target, verifier=hf_target,
                 verifier_architectures=[{"llama": "LlamaForCausalLM",
                                          "qwen3": "Qwen3ForCausalLM"}.get(target.arch, "")],
                 source="dflash-mlx train (initialisation)", target_name=hf_target)
    files.append("init/")
    config = {"train": {
        "speculator_type": "dflash",
        "seed": args.seed,
        "verifier": {"verifier_name_or_path": hf_target},
        "draft": draft_cfg,
        "data": {"data_path": str(out / "prepared"), "total_seq_len": SEQ_LEN, "max_anchors": _anchors(args, records)},
        # hard labels = the target's argmax, which on its own greedy responses is our label
        "loss": {"loss_fn": "ce"},
        "optimizer": {"optimizer": "adamw", "lr": args.lr, "weight_decay": args.weight_decay},
        "scheduler": {"scheduler_type": "cosine", "scheduler_warmup_ratio": args.warmup},
        "trainer": {"epochs": 6, "save_path": str(out / "checkpoints")},
        "dflash": {"block_size": args.block_size, "dflash_decay_gamma": args.gamma,
                   "per_position_loss_weight": "fixed-exp-decay"},
    }}
    import yaml

    (out / "train.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    files.append("train.yaml")
    (out / "README.md").write_text(SPECULATORS_README.format(out=out, hf=hf_target, grad_clip=args.grad_clip,
                                                            n=len(records)))
    return files + ["README.md"]


def write_specforge(out, args, records, draft, vocab, target, tokenizer, hf_target):
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    from dflash_mlx.train.packed import prompt_texts

    texts = prompt_texts(r["id"] for r in records)
    with (out / "data.jsonl").open("w") as f:
        for r in records:
            answer = hf.decode(r["response"], skip_special_tokens=True)
            f.write(json.dumps({"id": r["id"], "conversations": [
                {"role": "user", "content": texts[r["id"]]}, {"role": "assistant", "content": answer}]}) + "\n")
    cfg = draft.config.to_dict()
    cfg["architectures"] = ["DFlashDraftModel"]
    (out / "draft_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    chatml = "<|im_start|>assistant" in (getattr(hf, "chat_template", "") or "")
    config = {
        "run_id": "dflash-mlx-recipe",
        "output_dir": str(out / "output"),
        "model": {"target_model_path": hf_target, "draft_model_config": str(out / "draft_config.json"),
                  "target_backend": "sglang", "mask_token_id": draft.config.mask_token_id,
                  "torch_dtype": "bfloat16"},
        "data": {"train_data_path": str(out / "data.jsonl"), "chat_template": "qwen" if chatml else "llama3",
                 "max_length": 2048},
        "training": {"strategy": "dflash", "num_epochs": 6, "learning_rate": args.lr,
                     "warmup_ratio": args.warmup, "max_grad_norm": args.grad_clip,
                     "num_anchors": args.blocks_per_seq, "loss_decay_gamma": args.gamma, "seed": args.seed,
                     "role": "auto"},
        # SpecForge trains online only against an SGLang capture server it launches on other
        # GPUs (hidden states through Mooncake): one node, GPU 0 captures, GPU 1 trains
        "deployment": {"mode": "disaggregated", "disaggregated": {
            "control_dir": str(out / "control"), "backend": "mooncake",
            "managed_local": {"trainer_cuda_visible_devices": ["1"],
                              "capture_servers": [{"port": 30000, "cuda_visible_devices": ["0"]}]}}},
    }
    (out / "specforge.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "README.md").write_text(SPECFORGE_README.format(out=out, hf=hf_target, n=len(records)))
    return ["data.jsonl", "draft_config.json", "specforge.json", "README.md"]


SPECULATORS_README = """# dflash-mlx recipe, for speculators 0.9.0

{n} records: the target's own greedy responses (`data.jsonl`, pre-tokenized with the
target's chat template; `loss_mask` 1 on the response). `init/` is the draft our recipe
starts from (the target's last layers copied in, `fc` passing the feeding tap through),
in speculators' layout. `train.yaml` holds the recipe's settings.

    speculators prepare-data --model {hf} --data {out}/data.jsonl --output {out}/prepared
    # hidden states come from a vLLM server that serves {hf} with speculators' hidden-state
    # settings (see speculators' docs: launch_vllm.py); train.yaml's generation.vllm_endpoint
    speculators train --config {out}/train.yaml

The checkpoint it saves loads here as it is (`load_draft` reads speculators' layout).

Not carried over: our gradient clip ({grad_clip}; speculators has none to set), the per-dimension
feature preconditioning (folded into `init/`'s `fc`; speculators trains on raw features), dropout
and the step budget (speculators counts epochs: 6 here).
"""

SPECFORGE_README = """# dflash-mlx recipe, for SpecForge 0.2.0

{n} records as conversations (the target's own greedy responses, decoded to text);
`draft_config.json` is our draft's z-lab config (layers, taps, mask token, block size);
`specforge.json` the recipe's settings. SpecForge needs an SGLang target backend
(it pins sglang 0.5.14), two GPUs on one node as written (an SGLang capture server on
GPU 0, the trainer on GPU 1: edit `deployment`), and trains full-vocabulary drafts
(what SGLang serves).

    specforge train --config {out}/specforge.json

Not carried over: the target-layer initialisation (SpecForge starts from random draft
layers), the reduced vocabulary, the feature preconditioning, weight decay.
"""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], None))
