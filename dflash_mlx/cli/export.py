"""`dflash-mlx export MODEL OUT`: write a loaded model as a standard mlx-lm folder.

Turns a packaged model or a GGUF file into config.json + safetensors +
tokenizer files that `mlx_lm.load` (and `dflash-mlx train`) read directly,
without the GGUF dequantization and tokenizer conversion on every load.
"""

import dataclasses
import sys
from pathlib import Path


class ExportError(Exception):
    pass


def model_config_dict(model, tokenizer=None) -> dict:
    """The config.json for `model`: its mlx-lm ModelArgs, plus eos ids."""
    args = getattr(model, "args", None)
    if args is None or not dataclasses.is_dataclass(args):
        raise ExportError("model has no mlx-lm ModelArgs (model.args); cannot write config.json")
    config = dataclasses.asdict(args)
    config = {k: v for k, v in config.items() if v is not None}
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [])
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


def export_model(model, tokenizer, out, dtype=None, overwrite=False) -> Path:
    """Write `model` and `tokenizer` to folder `out` in mlx-lm's format."""
    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    out = Path(out).expanduser()
    if getattr(model, "gguf_rope_freqs", False):
        raise ExportError(
            "this GGUF sets RoPE frequencies with a rope_freqs tensor, which config.json "
            "cannot express; load the original Hugging Face model instead"
        )
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} exists and is not empty (use --overwrite)")
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype) if isinstance(dtype, str) else dtype)
    config = model_config_dict(model, tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(config, out / "config.json")
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if not hasattr(hf, "save_pretrained"):
        raise ExportError("tokenizer cannot be saved (no save_pretrained)")
    hf.save_pretrained(out)
    return out


def main(argv=None) -> int:
    from dflash_mlx.cli.common import ArgumentParser  # a bad flag is one line, as in every subcommand

    p = ArgumentParser(
        prog="dflash-mlx export",
        description="write a model (packaged name, .gguf, folder, hub id) as a standard mlx-lm folder",
    )
    p.add_argument("model", help="packaged name, .gguf file, mlx-lm folder or hub id")
    p.add_argument("out", help="output folder")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="weight dtype to write (default: the load dtype, float32 on CPU)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty folder")
    args = p.parse_args(argv)
    out = Path(args.out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        print(f"dflash-mlx export: error: {out} exists and is not an empty folder (use --overwrite)", file=sys.stderr)
        return 1
    from dflash_mlx.models.loading import ModelLoadError, load

    try:
        model, tokenizer = load(args.model, dtype=args.dtype)
        out = export_model(model, tokenizer, args.out, overwrite=args.overwrite)
    except (ModelLoadError, ExportError) as e:
        print(f"dflash-mlx export: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ndflash-mlx export: interrupted", file=sys.stderr)
        return 130
    print(f"wrote {out} (load it with mlx_lm.load({str(out)!r}) or dflash-mlx --model {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
