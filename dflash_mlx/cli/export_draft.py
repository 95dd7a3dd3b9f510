"""`dflash-mlx export-draft DRAFT OUT --format zlab-full|vllm|speculators|mlx`: a draft for other engines.

- `zlab-full`: z-lab's layout scoring the target's whole vocabulary (no
  `draft_vocab.npy`): what SGLang (`DFLASH`), z-lab's own code and speculators'
  converter read. The draft borrows the target's head, so "expanding" the reduced
  head is dropping the list of ids; proposals may then be any token.
- `vllm`: vLLM's reduced-vocabulary form: z-lab's config + `draft_vocab_size`, the
  draft's own `lm_head` (the target's rows for the draft vocabulary) and `d2t`
  (EAGLE-3's offsets). A full-vocabulary draft is written as z-lab's layout, which
  vLLM reads as it is.
- `speculators`: speculators' DFlash layout (aux ids = ours + 1; `d2t`/`t2d`/`lm_head`
  for a reduced vocabulary), with `--verifier` the name the consumer loads the
  target by (a hub id or path): its loader takes the embedding and head from there.
- `mlx`: z-lab's layout as this package stores it (the reduced vocabulary kept in
  `draft_vocab.npy`), and with `--bits 4|8` MLX-quantized weights with mlx-lm's
  `quantization` entry. Only MLX loaders read quantized weights, so `--bits` is
  refused with the other formats, and so is a draft loaded quantized.

Head rows come from the target given with `--target` (default: a packaged draft's
own target). A packaged GGUF target is quantized: pass the Hugging Face model
(`--target HuggingFaceTB/SmolLM2-135M-Instruct`, or its folder) for its exact rows.
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

FORMATS = ("zlab-full", "vllm", "speculators", "mlx")
CARD = """# DFlash draft ({fmt} layout)

Written by `dflash-mlx export-draft` from `{source}` for target `{target}`.
{what}
"""
WHAT = {
    "zlab-full": "z-lab's DFlash layout (`config.json` + `model.safetensors`), scoring the target's full "
                 "vocabulary: SGLang (`--speculative-algorithm DFLASH`), vLLM (`method: dflash`), z-lab's "
                 "`dflash` and speculators' converter read it.",
    "vllm": "vLLM's DFlash layout with a reduced draft vocabulary (`draft_vocab_size`, `lm_head.weight`, "
            "`d2t`): serve with vLLM's `--speculative-config '{{\"method\": \"dflash\", \"model\": <this folder>, "
            "\"num_speculative_tokens\": {k}}}'`.",
    "speculators": "speculators' DFlash layout (`speculators_model_type: dflash`), verifier `{verifier}`: "
                   "`DFlashDraftModel.from_pretrained(<this folder>)` in speculators, or vLLM "
                   "(`vllm serve {verifier} --speculative-config '{{\"model\": <this folder>}}'`).",
    "mlx": "z-lab's DFlash layout as dflash-mlx stores it (`config.json`, `model.safetensors`, the reduced "
           "vocabulary in `draft_vocab.npy` if any){quantized}: `dflash-mlx --draft <this folder>` or "
           "`dflash_mlx.load_draft(<this folder>, model)`.",
}


class ExportDraftError(ValueError):
    pass


def export_draft(draft, out, fmt: str, target=None, verifier: Optional[str] = None,
                 verifier_architectures=(), source: str = "", target_name: str = "",
                 bits: Optional[int] = None, group_size: int = 64) -> Path:
    """Write `draft` (as loaded, weights in their stored dtype) to `out` in format `fmt`.

    `target` (a `Target`) supplies head rows (vllm/speculators with a reduced
    vocabulary) and the layer count; `verifier` names it in speculators' config.
    `bits` (format `mlx` only) quantizes the draft's projections first."""
    from dflash_mlx.models.draft.foreign import speculators
    from dflash_mlx.models.draft.foreign import vllm
    from dflash_mlx.models.draft.foreign.common import head_rows
    from dflash_mlx.models.draft.quantize import describe

    if fmt not in FORMATS:
        raise ExportDraftError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    if fmt != "mlx" and (bits is not None or describe(draft)):
        raise ExportDraftError(f"--format {fmt} is read by engines that take float weights only: quantized "
                               "drafts (--bits, or a draft stored quantized) export with --format mlx")
    if fmt == "mlx":
        return _write_mlx(draft, Path(out), bits, group_size, source, target_name)
    if getattr(draft.config, "version", 1) != 1 and fmt != "zlab-full":
        raise ExportDraftError(f"DFlash 2 drafts have no {fmt} layout; use --format zlab-full")
    cfg = draft.config.to_dict()
    body = dict(tree_flatten(draft.parameters()))
    ids = draft.vocab_ids
    needs_head = ids is not None and fmt in ("vllm", "speculators")
    if (needs_head or fmt == "speculators") and target is None:
        raise ExportDraftError(f"--format {fmt} needs the target (--target)")
    head = head_rows(target, ids) if needs_head else None
    if fmt == "speculators":
        if not verifier:
            raise ExportDraftError("--format speculators needs --verifier: the hub id or path the consumer "
                                   "loads the target by")
        try:
            cfg, weights = speculators.from_zlab(cfg, body, ids, verifier, verifier_architectures,
                                                 num_target_layers=target.num_layers, head=head)
        except ValueError as e:
            raise ExportDraftError(str(e)) from None
    elif fmt == "vllm" and ids is not None:
        cfg, weights = vllm.from_zlab(cfg, body, ids, head)
    else:  # zlab-full, or vllm with a full vocabulary (vLLM reads z-lab's layout as it is)
        weights = body
    block = int(cfg.get("block_size") or draft.config.block_size)
    card = CARD.format(fmt=fmt, source=source or "a draft", target=target_name or "?",
                       what=WHAT[fmt].format(k=block - 1, verifier=verifier))
    return _write(Path(out), cfg, weights, card)


def _write_mlx(draft, out: Path, bits, group_size, source: str, target_name: str) -> Path:
    """Format `mlx`: the draft as `save_draft` writes it, quantized first when `bits` is given."""
    from dflash_mlx.models.draft.checkpoints import DRAFT_VOCAB_FILE, config_dict
    from dflash_mlx.models.draft.quantize import describe, quantize_draft

    if bits is not None:
        try:
            quantize_draft(draft, bits, group_size)
        except ValueError as e:
            raise ExportDraftError(str(e)) from None
    q = describe(draft)
    card = CARD.format(fmt="mlx", source=source or "a draft", target=target_name or "?",
                       what=WHAT["mlx"].format(quantized=f", {q} (MLX affine, mlx-lm's `quantization` entry)"
                                               if q else ""))
    extra = {} if draft.vocab_ids is None else {DRAFT_VOCAB_FILE: draft.vocab_ids.astype(mx.int32)}
    return _write(out, config_dict(draft), dict(tree_flatten(draft.parameters())), card, extra)


def _write(out: Path, cfg: dict, weights: dict, card: str, arrays: Optional[dict] = None) -> Path:
    """config.json + model.safetensors + README.md (+ `arrays`, .npy files by name), atomically
    (a temporary folder renamed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-export-", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "pt"})
        for name, array in (arrays or {}).items():
            mx.save(str(tmp / name), array)
        (tmp / "README.md").write_text(card)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv=None) -> int:
    from dflash_mlx.cli.common import ArgumentParser, CLIError

    p = ArgumentParser(prog="dflash-mlx export-draft",
                       description="write a DFlash draft in z-lab full-vocabulary, vLLM or speculators format, "
                       "or for MLX (optionally quantized)")
    p.add_argument("draft", help="draft: packaged name, folder or hub id")
    p.add_argument("out", help="output folder")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--target", default=None,
                   help="the draft's target (default: a packaged draft's own): head rows and checks")
    p.add_argument("--verifier", default=None,
                   help="speculators: the name the consumer loads the target by (default for a packaged "
                        "target: its hub id)")
    p.add_argument("--bits", type=int, choices=(4, 8), default=None,
                   help="--format mlx: quantize the draft's projections to 4 or 8 bits (MLX affine)")
    p.add_argument("--group-size", type=int, choices=(32, 64, 128), default=64,
                   help="--format mlx with --bits: weights per quantization group (default: 64)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    args = p.parse_args(argv)
    if args.bits is not None and args.format != "mlx":
        raise CLIError(f"--bits writes MLX-quantized weights, which the readers of --format {args.format} "
                       "(SGLang, vLLM, speculators) cannot load; use --format mlx", 2)
    from dflash_mlx.models import packaged

    out = Path(args.out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        raise CLIError(f"{out} exists and is not an empty folder (use --overwrite)", 2)
    target_name = args.target or (args.draft if packaged.is_packaged(args.draft) else None)
    verifier = args.verifier
    if verifier is None and target_name and packaged.is_packaged(target_name):
        verifier = packaged.PACKAGED[target_name].hub_repo
    target = None
    if target_name is not None:
        from dflash_mlx.cli.common import check_sources
        from dflash_mlx.models.loading import load
        from dflash_mlx.models.target.adapter import Target

        check_sources(target_name, args.draft)
        model, _ = load(target_name, quiet=True)
        target = Target(model, name=target_name)
    elif args.format not in ("zlab-full", "mlx"):
        raise CLIError(f"--format {args.format} needs --target (the draft's target model)", 2)
    draft = _load_stored(args.draft, target)
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(getattr(target, "arch", None), None)
    export_draft(draft, out, args.format, target=target, verifier=verifier,
                 verifier_architectures=[arch] if arch else [], source=args.draft,
                 target_name=target_name or "", bits=args.bits, group_size=args.group_size)
    vocab = "full vocabulary" if draft.vocab_ids is None or args.format == "zlab-full" else \
        f"draft vocabulary {draft.vocab_ids.shape[0]}"
    quantized = f", {args.bits}-bit" if args.bits else ""
    print(f"wrote {out} ({args.format}{quantized}, {vocab})")
    return 0


def _load_stored(name: str, target):
    """The draft with its weights in their stored dtype, checked against `target` when given."""
    from dflash_mlx.models.draft.config import validate_for_target
    from dflash_mlx.models.draft.checkpoints import draft_folder, load_draft_folder

    folder = draft_folder(name)
    if folder is None:
        raise ExportDraftError(f"no trained draft is shipped for {name!r}: nothing to export")
    draft = load_draft_folder(folder, target=target)
    if target is not None:
        validate_for_target(draft.config, target)
    return draft


if __name__ == "__main__":
    sys.exit(main())
