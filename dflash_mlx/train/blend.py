"""A draft between two exported drafts of one layout: weights interpolated tensor by tensor.

Fine-tuning a trained draft on new data (depth records) gains there and can lose a
little on what it was good at; a point between the two weight sets often keeps most
of the gain and none of the loss (weight-space ensembling, as in WiSE-FT). Both
drafts must share the layout, the target's layer taps, the block size and the
draft vocabulary (a draft continued with `--init-from` does); the blend is written
as an ordinary export (z-lab format), so every loader takes it.

    python -m dflash_mlx.train.blend smollm2-135m runs/depth/draft --weight 0.5 --out runs/blend50
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
import mlx.core as mx

# What may differ between the two configs (everything else must match): bookkeeping, and
# the attention's reach over the context, which no weight depends on (a draft continued
# with a window from a full-attention one blends in the window it was tuned with).
_FREE_KEYS = {"_name_or_path", "torch_dtype", "dtype", "transformers_version",
              "layer_types", "sliding_window", "use_sliding_window", "max_window_layers", "is_causal"}


def _folder(name_or_path: str) -> Path:
    from dflash_mlx.models.draft.checkpoints import draft_folder

    folder = draft_folder(str(name_or_path))
    if folder is None or not Path(folder).is_dir():
        raise FileNotFoundError(f"draft {name_or_path!r}: no exported draft folder there")
    return Path(folder)


def _weights(folder: Path) -> dict:
    from dflash_mlx.models.draft.checkpoints import LEGACY_DRAFT_VOCAB_FILE

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        if f.name != LEGACY_DRAFT_VOCAB_FILE:
            out.update(mx.load(str(f)))
    return out


def blend(base, tuned, weight: float, out_dir) -> Path:
    """Write `(1 - weight) * base + weight * tuned` to `out_dir` (the tuned draft's dtype,
    config, attention layout included, and vocabulary); `weight` 0 is the base's weights,
    1 the tuned draft."""
    from dflash_mlx.models.draft.checkpoints import DRAFT_VOCAB_FILE

    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"--weight {weight}: give a value in [0, 1] (0: the base draft, 1: the tuned one)")
    a, b = _folder(base), _folder(tuned)
    ca, cb = (json.loads((f / "config.json").read_text()) for f in (a, b))
    differ = sorted(k for k in set(ca) | set(cb) if k not in _FREE_KEYS and ca.get(k) != cb.get(k))
    if differ:
        raise ValueError(f"drafts {base!r} and {tuned!r} differ in {', '.join(differ)}: only drafts of one "
                         "layout blend (continue one from the other with --init-from)")
    va, vb = (np.load(f / DRAFT_VOCAB_FILE) if (f / DRAFT_VOCAB_FILE).exists() else None for f in (a, b))
    if (va is None) != (vb is None) or (va is not None and not np.array_equal(va, vb)):
        raise ValueError(f"drafts {base!r} and {tuned!r} have different draft vocabularies")
    wa, wb = _weights(a), _weights(b)
    if set(wa) != set(wb) or any(wa[k].shape != wb[k].shape for k in wa):
        raise ValueError(f"drafts {base!r} and {tuned!r} hold different tensors")
    mixed = {k: ((1.0 - weight) * wa[k].astype(mx.float32) + weight * wb[k].astype(mx.float32)).astype(wb[k].dtype)
             for k in wb}
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")  # nothing half-written at `out`
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), mixed, metadata={"format": "mlx"})
    shutil.copyfile(b / "config.json", tmp / "config.json")
    if vb is not None:
        shutil.copyfile(b / DRAFT_VOCAB_FILE, tmp / DRAFT_VOCAB_FILE)
    card = (b / "README.md").read_text() if (b / "README.md").exists() else ""
    (tmp / "README.md").write_text(
        f"{card.rstrip()}\n\n## Blend\n\nWeights: {1 - weight:g} x `{base}` + {weight:g} x `{tuned}`, "
        "tensor by tensor (`python -m dflash_mlx.train.blend`).\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_mlx.train.blend", description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="the draft training started from (packaged name or folder)")
    p.add_argument("tuned", help="the draft it was continued into (folder)")
    p.add_argument("--weight", type=float, required=True, help="0: the base, 1: the tuned draft")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        out = blend(args.base, args.tuned, args.weight, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"blended draft -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
