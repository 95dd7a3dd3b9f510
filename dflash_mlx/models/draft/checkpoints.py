"""DFlash draft checkpoints: z-lab's folder layout (config.json + *.safetensors, and our
optional reduced vocabulary), read from a folder, a packaged name or the hub; written
atomically; random drafts for tests and for targets with no trained draft yet.

The model class follows the config (`draft_class`): DFlash or DFlash 2.
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Dict, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from dflash_mlx.models import packaged
from dflash_mlx.models.draft.dflash import DFlashDraftModel
from dflash_mlx.models.draft.dflash2 import (DFlash2DraftModel, dflash2_defaults, dflash2_hints, dflash2_shapes,
                               randomize_dflash2)
from dflash_mlx.models.draft.config import (DraftConfig, DraftMismatchError, default_target_layer_ids,
                                     validate_for_target)
from dflash_mlx.models.draft.foreign.formats import zlab_layout
from dflash_mlx.models.draft.quantize import (check_bits, quantization_entry, quantize_draft, quantize_stored,
                                              quantized_shapes, stored_entry)
from dflash_mlx.models.layout import relayout_for_cpu
from dflash_mlx.models.loading import ModelLoadError, hub_snapshot, resolve_source
from dflash_mlx.models.target.adapter import Target

# Optional extra stored next to a checkpoint: the reduced draft vocabulary; we use it
# to score only these token ids. A .npy file, not .safetensors: z-lab's MLX loader reads
# every *.safetensors in the folder as weights, so the folder stays loadable there.
DRAFT_VOCAB_FILE = "draft_vocab.npy"
LEGACY_DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # read from drafts written before


def expected_shapes(config: DraftConfig) -> Dict[str, tuple]:
    H, d, I = config.hidden_size, config.head_dim, config.intermediate_size
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    shapes = {
        "fc.weight": (H, len(config.target_layer_ids) * H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
    }
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (nh * d, H),
            p + "self_attn.k_proj.weight": (nkv * d, H),
            p + "self_attn.v_proj.weight": (nkv * d, H),
            p + "self_attn.o_proj.weight": (H, nh * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        })
    if config.version == 2:
        shapes.update(dflash2_shapes(config))
    return shapes


def draft_class(config: DraftConfig):
    """The model class a config describes (DFlash or DFlash 2)."""
    if config.version == 2:
        return DFlash2DraftModel
    return DFlashDraftModel


def _read_safetensors(path: Path) -> Dict[str, mx.array]:
    try:
        return mx.load(str(path))
    except Exception as e:  # mlx raises RuntimeError/ValueError with terse text
        raise DraftMismatchError(
            f"could not read draft weights {path}: {e}. The file is corrupt or not "
            "safetensors; download the draft again."
        ) from None


def load_draft_folder(path: Path, dtype: Optional[mx.Dtype] = None, target=None) -> DFlashDraftModel:
    """`target` (a `Target`, optional) lets checkpoints in other engines' layouts be checked against it."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in draft folder {path}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise DraftMismatchError(f"draft config {cfg_file} is not valid JSON: {e}") from None
    files = sorted(f for f in path.glob("*.safetensors") if f.name != LEGACY_DRAFT_VOCAB_FILE)
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in draft folder {path}")
    weights = {}
    for f in files:
        weights.update(_read_safetensors(f))
    quantization = stored_entry(cfg, weights, f"draft {path}")
    # other engines' layouts (speculators, vLLM's reduced vocabulary) as z-lab's
    cfg, weights, foreign_ids = zlab_layout(cfg, weights, target, source=str(path))
    config = DraftConfig.from_dict(cfg)
    model = draft_class(config)(config)
    if quantization is not None:  # as mlx-lm loads a quantized model: the stored modules, before the weights
        quantize_stored(model, quantization, weights, f"draft {path}")
    check_weights(weights, config, quantized_shapes(model))
    if dtype is not None:  # packed integers stay as stored
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()))
    ids = _read_draft_vocab(path)
    if foreign_ids is not None:
        if ids is not None and ids.tolist() != foreign_ids.tolist():
            raise DraftMismatchError(f"{path}: {DRAFT_VOCAB_FILE} and the checkpoint's d2t name different vocabularies")
        ids = foreign_ids
    if ids is not None:
        model.set_vocab(ids)
    mx.eval(model.parameters())
    model.eval()
    return model


def _read_draft_vocab(path: Path) -> Optional[mx.array]:
    """The reduced draft vocabulary stored beside the weights, or None."""
    vocab_file = path / DRAFT_VOCAB_FILE
    if vocab_file.is_file():
        try:
            ids = mx.load(str(vocab_file))
        except (RuntimeError, ValueError) as e:
            raise DraftMismatchError(f"draft vocabulary {vocab_file} cannot be read ({e}): "
                                     "re-export the draft") from None
    elif (path / LEGACY_DRAFT_VOCAB_FILE).is_file():
        ids = _read_safetensors(path / LEGACY_DRAFT_VOCAB_FILE).get("token_ids")
        if ids is None:
            raise DraftMismatchError(f"{path / LEGACY_DRAFT_VOCAB_FILE} has no 'token_ids' tensor")
    else:
        return None
    if ids.ndim != 1:
        raise DraftMismatchError(f"draft vocabulary in {path} has shape {ids.shape}, expected a list of token ids")
    return ids.astype(mx.int32)


def check_weights(weights: Dict[str, mx.array], config: DraftConfig, quantized: Optional[Dict[str, tuple]] = None):
    """`quantized`: the stored shapes of quantized modules' tensors (`quantize.quantized_shapes`)."""
    expected = {**expected_shapes(config), **(quantized or {})}
    hints = {}
    if config.version == 2:
        hints = dflash2_hints(config)
    for name, shape in expected.items():
        if name not in weights:
            raise DraftMismatchError(
                f"draft weights are missing the tensor '{name}' (expected shape {shape})"
                + (f"; {hints[name]}" if name in hints else "")
            )
        if tuple(weights[name].shape) != shape:
            raise DraftMismatchError(
                f"draft tensor '{name}' has shape {tuple(weights[name].shape)}, "
                f"expected {shape} from config.json" + (f" ({hints[name]})" if name in hints else "")
            )
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise DraftMismatchError(f"draft weights have unexpected tensors: {extra[:5]}")


def config_dict(model: DFlashDraftModel) -> dict:
    """A draft's config.json: z-lab's layout, and mlx-lm's quantization entry when quantized."""
    cfg = model.config.to_dict()
    quantization = quantization_entry(model)
    if quantization is not None:  # as mlx-lm writes it (both keys)
        cfg["quantization"] = cfg["quantization_config"] = quantization
    return cfg


def save_draft(model: DFlashDraftModel, path, metadata: Optional[Dict[str, str]] = None):
    """Write z-lab's layout atomically (a temporary folder renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-draft-", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config_dict(model), indent=2) + "\n")
        flat = dict(nn.utils.tree_flatten(model.parameters()))
        mx.save_safetensors(str(tmp / "model.safetensors"), flat, metadata=metadata or {})
        if model.vocab_ids is not None:
            mx.save(str(tmp / DRAFT_VOCAB_FILE), model.vocab_ids.astype(mx.int32))
        if path.exists():
            old = path.with_name(path.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def random_draft_config(
    target,
    num_layers: int = 1,
    block_size: int = 16,
    mask_token_id: Optional[int] = None,
    intermediate_size: Optional[int] = None,
    num_attention_heads: Optional[int] = None,
    num_key_value_heads: Optional[int] = None,
    head_dim: Optional[int] = None,
    target_layer_ids: Optional[Sequence[int]] = None,
    **overrides,
) -> DraftConfig:
    """A draft config shaped for `target` (fresh training or tests)."""
    H = target.hidden_size
    heads = num_attention_heads or max(1, H // 64)
    return DraftConfig(
        hidden_size=H,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=num_key_value_heads or heads,
        head_dim=head_dim or H // heads,
        intermediate_size=intermediate_size or 2 * H,
        vocab_size=target.vocab_size,
        target_layer_ids=list(target_layer_ids or default_target_layer_ids(target.num_layers, num_layers)),
        mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
        num_target_layers=target.num_layers,
        block_size=block_size,
        rms_norm_eps=target.rms_norm_eps,
        **overrides,
    )


def random_draft(target, seed: int = 0, dtype=mx.float32, version: int = 1, **config_overrides) -> DFlashDraftModel:
    """An untrained draft shaped for `target` (tests, and the fallback before a trained one ships).

    `version=2` makes a DFlash 2 draft (small defaults for the conv and the
    selector, overridable like any config field) with random conv taps and
    codebooks, so that every part of it affects the proposals.
    """
    if not isinstance(target, Target):
        target = Target(target)
    if version == 2:
        config_overrides = {**dflash2_defaults(target.hidden_size), **config_overrides}
    mx.random.seed(seed)
    config = random_draft_config(target, version=version, **config_overrides)
    model = draft_class(config)(config)
    if version == 2:
        randomize_dflash2(model)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.eval()
    return model.bind(target)


def draft_folder(name_or_path: str) -> Optional[Path]:
    """Folder for a local path, a packaged draft name, or a hub id (downloaded); None: packaged but not shipped."""
    try:
        kind, path = resolve_source(name_or_path, "draft")
        if kind == "hub":
            return hub_snapshot(name_or_path, ["*.json", "*.safetensors", "*.md"], "draft")
    except ModelLoadError as e:
        raise FileNotFoundError(str(e)) from None
    if kind == "packaged":
        return packaged.packaged_draft_dir(name_or_path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"draft path {path} is a file; give the folder holding config.json and model.safetensors"
        )
    return path


def load_draft(name_or_path, model=None, dtype: Optional[mx.Dtype] = None, quiet: bool = False,
               bits: Optional[int] = None, group_size: int = 64) -> DFlashDraftModel:
    """Load a draft (folder, packaged name or hub id), check it fits `model`, bind it.

    The draft takes the target's dtype unless `dtype` is given. A checkpoint quantized
    by MLX (`quantization` in its config) loads quantized; `bits` (4 or 8) quantizes a
    float draft's projections on load (`dflash_mlx.models.draft.quantize`).
    """
    if bits is not None:
        check_bits(bits, group_size)  # before anything loads
    target = None
    if model is not None:
        target = model if isinstance(model, Target) else Target(model, name=str(getattr(model, "name", "")) or None)
        if dtype is None:
            dtype = target.embed_tokens.weight.dtype
            if dtype not in (mx.float32, mx.float16, mx.bfloat16):  # quantized embedding
                dtype = target.embed_tokens.scales.dtype
    folder = draft_folder(str(name_or_path))
    if folder is None:
        if target is None:
            raise ValueError(f"packaged draft '{name_or_path}' is not shipped yet; pass the target model")
        if not quiet:
            print(
                f"[dflash-mlx] no trained draft is shipped for '{name_or_path}' yet: using an untrained "
                "draft (output is still exactly the target's, only slower)",
                file=sys.stderr,
            )
        draft = random_draft(target, seed=0, dtype=dtype or mx.float32, num_layers=1)
        return draft if bits is None else quantize_draft(draft, bits, group_size)
    draft = load_draft_folder(folder, dtype=dtype, target=target)
    if bits is not None:
        quantize_draft(draft, bits, group_size)
    relayout_for_cpu(draft)
    if target is not None:
        validate_for_target(draft.config, target)
        draft.bind(target)
    return draft
