"""Quantized drafts: MLX's affine quantization of a draft's projections, in mlx-lm's format.

A checkpoint whose `config.json` carries mlx-lm's `quantization` entry (`group_size`,
`bits`, `mode`, and per-module overrides keyed by module path, a dict of those three or
a bool) is built the way `mlx_lm.utils.load_model` builds a quantized model: `nn.quantize`
with a predicate that quantizes exactly the modules whose `.scales` are stored, each
with the group size and bits its stored shapes give (`quantize_stored`). A float draft
is quantized on load with `quantize_draft` (`load_draft(bits=...)`, `--draft-bits`).
Only the affine mode at 4 or 8 bits is taken; anything else is refused in one line.

What is quantized: every `nn.Linear` of the draft whose input size the group size
divides: q/k/v/o, the MLP, `fc`, and a DFlash 2 draft's conv and selector projections.
`fc` is quantized too: it is the draft's largest matrix (target layers x hidden squared),
and on the shipped SmolLM2 draft leaving it in float32 kept no more tau (1.416 vs 1.421 at
block 16) for 1.85x the 4-bit draft's memory (benchmarks/results/20261203-quantized-drafts).
Norms, DFlash 2's base kernels and codebooks (bare tensors) stay in float. The embedding
and LM head the draft uses are the target's and are never touched here: the target's
output must stay exactly its own, and quantizing them would change the target.
"""

from collections import Counter
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from dflash_mlx.models.draft.config import DraftMismatchError

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
MODE = "affine"
SUPPORTED = "mode 'affine' with bits 4 or 8 and group_size 32, 64 or 128 (mlx-lm's affine quantization)"
_PARAMS = ("group_size", "bits", "mode")


def check_params(params: dict, where: str) -> dict:
    """`{'group_size', 'bits', 'mode'}` when supported, else DraftMismatchError naming what is."""
    bits, group_size, mode = params.get("bits"), params.get("group_size"), params.get("mode", MODE)
    ok = (set(params) <= set(_PARAMS) and mode == MODE and _whole(bits) in BITS
          and _whole(group_size) in GROUP_SIZES)
    if not ok:
        raise DraftMismatchError(f"{where}: quantization {params} is not supported; dflash-mlx reads {SUPPORTED}")
    return {"group_size": int(group_size), "bits": int(bits), "mode": MODE}


def _whole(x):
    return int(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x == int(x) else None


def stored_entry(cfg: dict, weights: Dict[str, mx.array], where: str) -> Optional[dict]:
    """The checkpoint's quantization entry (mlx-lm writes `quantization`, and the same as
    `quantization_config`), or None for a float checkpoint."""
    entry = cfg.get("quantization")
    if entry is None:
        hf = cfg.get("quantization_config")
        if isinstance(hf, dict) and "quant_method" in hf:
            raise DraftMismatchError(
                f"{where}: weights quantized with {hf['quant_method']!r} are not supported; dflash-mlx reads "
                f"mlx-lm's quantization entry, {SUPPORTED}")
        entry = hf
    if entry is None and any(k.endswith(".scales") for k in weights):
        raise DraftMismatchError(
            f"{where}: the weights are quantized (.scales tensors) but config.json has no 'quantization' "
            "entry; write it as mlx-lm does ({\"group_size\": 64, \"bits\": 4, \"mode\": \"affine\"})")
    if entry is not None and not isinstance(entry, dict):
        raise DraftMismatchError(f"{where}: config.json's 'quantization' must be an object, got {entry!r}")
    return entry


def _read_entry(entry: dict, where: str) -> Tuple[dict, Dict[str, object]]:
    """(default params, per-module overrides: a params dict or a bool)."""
    defaults = check_params({k: v for k, v in entry.items() if k in _PARAMS}, where)
    overrides = {}
    for key, value in entry.items():
        if key in _PARAMS:
            continue
        if isinstance(value, bool):
            overrides[key] = defaults if value else False
        elif isinstance(value, dict):
            overrides[key] = check_params(value, f"{where} ({key})")
        else:
            raise DraftMismatchError(f"{where}: quantization key {key!r} = {value!r} is not supported; "
                                     f"dflash-mlx reads {SUPPORTED}, and per-module overrides")
    return defaults, overrides


def quantize_stored(model: nn.Module, entry: dict, weights: Dict[str, mx.array], where: str) -> None:
    """Quantize `model`'s modules as the stored weights are (before `load_weights`)."""
    defaults, overrides = _read_entry(entry, where)
    modules = dict(model.named_modules())
    unknown = sorted(k for k in overrides if k not in modules)
    if unknown:
        raise DraftMismatchError(f"{where}: the quantization entry names {unknown[0]!r}, which is no module of "
                                 "this draft")

    def predicate(path, module):
        if path in overrides:
            return overrides[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return check_params(_stored_params(path, module, weights, where), f"{where} ({path})")

    nn.quantize(model, defaults["group_size"], defaults["bits"], mode=MODE, class_predicate=predicate)


def _stored_params(path: str, module: nn.Module, weights: Dict[str, mx.array], where: str) -> dict:
    """The group size and bits a stored module was packed with, from its shapes."""
    in_dims = module.weight.shape[-1]
    scales, packed = weights[f"{path}.scales"], weights.get(f"{path}.weight")
    if packed is None or scales.ndim != 2 or scales.shape[-1] == 0 or in_dims % scales.shape[-1]:
        raise DraftMismatchError(
            f"{where}: quantized tensor '{path}' (scales {tuple(scales.shape)}, weight "
            f"{None if packed is None else tuple(packed.shape)}) does not fit its input size {in_dims}")
    params = {"group_size": in_dims // scales.shape[-1], "bits": packed.shape[-1] * 32 // in_dims}
    if not mx.issubdtype(scales.dtype, mx.floating):  # the microscaling modes keep uint8 scales
        params["mode"] = "mxfp4/nvfp4/mxfp8"
    return params


def quantized_shapes(model: nn.Module) -> Dict[str, tuple]:
    """The stored shapes of every quantized module's tensors (packed weight, scales, biases)."""
    shapes = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            for name in ("weight", "scales", "biases"):
                if name in module:
                    shapes[f"{path}.{name}"] = tuple(module[name].shape)
    return shapes


def check_bits(bits, group_size) -> Tuple[int, int]:
    """(bits, group_size) for quantizing a draft on load; ValueError naming what is supported."""
    if _whole(bits) not in BITS or _whole(group_size) not in GROUP_SIZES:
        raise ValueError(f"draft quantization takes bits 4 or 8 and group size 32, 64 or 128 (MLX affine), "
                         f"got bits={bits!r}, group_size={group_size!r}")
    return int(bits), int(group_size)


def quantize_draft(model: nn.Module, bits: int, group_size: int = 64) -> nn.Module:
    """Quantize a float draft's projections in place (see the module docstring for which).

    A draft already quantized at these settings is returned as it is; at others,
    ValueError (requantizing stored integers would only add error)."""
    bits, group_size = check_bits(bits, group_size)
    have = {(m.bits, m.group_size, m.mode) for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    if have:
        if have == {(bits, group_size, MODE)}:
            return model
        stored = ", ".join(f"{b} bits, group size {g}" for b, g, _ in sorted(have))
        raise ValueError(f"the draft is already quantized ({stored}); load it without draft bits, or from its "
                         "float checkpoint")

    def predicate(path, module):
        return type(module) is nn.Linear and module.weight.shape[-1] % group_size == 0

    nn.quantize(model, group_size, bits, mode=MODE, class_predicate=predicate)
    if quantization_entry(model) is None:
        raise ValueError(f"no projection of this draft has an input size divisible by group size {group_size}; "
                         "try group size 32")
    mx.eval(model.parameters())
    return model


def quantization_entry(model: nn.Module) -> Optional[dict]:
    """mlx-lm's `quantization` entry for `model`: the commonest settings, and an override
    for each module quantized otherwise (modules left in float have no `.scales`, which is
    how mlx-lm's loader tells them); None when nothing is quantized."""
    settings = {path: {"group_size": m.group_size, "bits": m.bits, "mode": m.mode}
                for path, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    if not settings:
        return None
    common = Counter(tuple(s.values()) for s in settings.values()).most_common(1)[0][0]
    entry = dict(zip(_PARAMS, common))
    entry.update({path: s for path, s in sorted(settings.items()) if tuple(s.values()) != common})
    return entry


def describe(model: nn.Module) -> Optional[str]:
    """'4-bit' / '8-bit' / 'mixed 4/8-bit' for a quantized draft, None for a float one."""
    bits = sorted({m.bits for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)})
    if not bits:
        return None
    return f"{bits[0]}-bit" if len(bits) == 1 else "mixed " + "/".join(map(str, bits)) + "-bit"
