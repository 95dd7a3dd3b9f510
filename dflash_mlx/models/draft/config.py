"""A DFlash draft's configuration, in z-lab's `config.json` layout, and the checks that
tie a draft to its target.

Field names follow z-lab's checkpoints; `from_dict` also reads the keys that
Gemma-4-style drafts (`rope_parameters`) and DFlash 2 drafts (`dflash_config.conv_*`,
`selector_*`) add. Nothing here builds a model: `dflash_mlx.models.draft.dflash` does.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import mlx.core as mx

DFLASH2_ARCH = "DFlash2DraftModel"
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # in dflash_config


class DraftMismatchError(ValueError):
    """The draft was made for a different target (or its files are broken)."""


@dataclass
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: List[int]
    mask_token_id: int
    num_target_layers: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    rope_scaling: Optional[Dict[str, Any]] = None
    layer_types: Optional[List[str]] = None
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None
    final_logit_softcapping: Optional[float] = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    # DFlash 2 only (architectures ["DFlash2DraftModel"]); 0 for DFlash 1 drafts.
    version: int = 1
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise DraftMismatchError(
                f"draft config: layer_types has {len(self.layer_types)} entries but "
                f"num_hidden_layers is {self.num_hidden_layers}"
            )
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise DraftMismatchError(f"draft config: unsupported layer_types {sorted(unknown)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise DraftMismatchError(
                "draft config: sliding_attention layers need a sliding_window"
            )
        if self.version == 2:
            self._check_dflash2()

    def _check_dflash2(self):
        for key in DFLASH2_KEYS:
            value = getattr(self, key)
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise DraftMismatchError(
                    f"DFlash 2 draft config: dflash_config.{key} must be a positive integer, got "
                    f"{value!r}; the checkpoint's config.json is incomplete"
                )
        if self.hidden_size % self.conv_group_size:
            raise DraftMismatchError(
                f"DFlash 2 draft config: dflash_config.conv_group_size {self.conv_group_size} does not "
                f"divide hidden_size {self.hidden_size}; the checkpoint's config.json is broken"
            )
        if self.selector_top_k > self.vocab_size:
            raise DraftMismatchError(
                f"DFlash 2 draft config: dflash_config.selector_top_k {self.selector_top_k} exceeds "
                f"vocab_size {self.vocab_size}"
            )

    @classmethod
    def from_dict(cls, cfg: Dict[str, Any]) -> "DraftConfig":
        dflash = cfg.get("dflash_config") or {}
        # Gemma-4-style drafts keep the RoPE settings in rope_parameters.
        rope_params = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 1_000_000.0))
        try:
            target_layer_ids = list(dflash.get("target_layer_ids") or cfg["target_layer_ids"])
            mask_token_id = dflash.get("mask_token_id", cfg.get("mask_token_id"))
            if mask_token_id is None:
                raise KeyError("dflash_config.mask_token_id")
            num_layers = cfg["num_hidden_layers"]
            heads = cfg["num_attention_heads"]
            version = 2 if DFLASH2_ARCH in (cfg.get("architectures") or []) else 1
            v2 = {key: _int_or_raw(dflash.get(key, 0)) for key in DFLASH2_KEYS} if version == 2 else {}
            return cls(
                hidden_size=cfg["hidden_size"],
                num_hidden_layers=num_layers,
                num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads", heads),
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                intermediate_size=cfg["intermediate_size"],
                vocab_size=cfg["vocab_size"],
                target_layer_ids=target_layer_ids,
                mask_token_id=int(mask_token_id),
                num_target_layers=cfg.get("num_target_layers", max(target_layer_ids) + 1),
                block_size=int(dflash.get("block_size", cfg.get("block_size", 16))),
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta),
                max_position_embeddings=cfg.get("max_position_embeddings", 32768),
                rope_scaling=rope_scaling,
                layer_types=cfg.get("layer_types"),
                sliding_window=cfg.get("sliding_window"),
                is_causal=cfg.get("is_causal"),
                final_logit_softcapping=dflash.get(
                    "final_logit_softcapping", cfg.get("final_logit_softcapping")
                ),
                input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)),
                output_multiplier=float(dflash.get("output_multiplier", 1.0)),
                version=version,
                **v2,
                extra={k: v for k, v in cfg.items() if k.startswith("dflash_mlx")},
            )
        except KeyError as e:
            raise DraftMismatchError(f"draft config.json is missing the key {e}") from None

    def to_dict(self) -> Dict[str, Any]:
        """z-lab's config layout."""
        cfg = {
            "architectures": [DFLASH2_ARCH if self.version == 2 else "DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "layer_types": list(self.layer_types),
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
            },
        }
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = self.rope_scaling
        if self.sliding_window is not None:
            cfg["sliding_window"] = self.sliding_window
        if self.is_causal is not None:
            cfg["is_causal"] = self.is_causal
        if self.final_logit_softcapping is not None:
            cfg["dflash_config"]["final_logit_softcapping"] = self.final_logit_softcapping
        if self.input_embedding_scale != 1.0:
            cfg["dflash_config"]["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            cfg["dflash_config"]["output_multiplier"] = self.output_multiplier
        if self.version == 2:
            for key in DFLASH2_KEYS:
                cfg["dflash_config"][key] = getattr(self, key)
        cfg.update(self.extra)
        return cfg


def _int_or_raw(value):
    """Integers stay integers (JSON may say 4.0); anything else is kept for the config check to name."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """z-lab's default: spread the taps over the target, skipping the very first and last layers
    (on a target of 2 layers or fewer, whose spread would run below layer 0, its layers)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    step = (end - start) / (num_draft_layers - 1)
    return [min(max(int(round(start + i * step)), 0), num_target_layers - 1) for i in range(num_draft_layers)]



def validate_for_target(config: DraftConfig, target) -> None:
    """Raise a clear error when the draft was made for another target."""
    name = getattr(target, "name", "target")
    if config.hidden_size != target.hidden_size:
        raise DraftMismatchError(
            f"draft hidden_size {config.hidden_size} does not match the {name}'s hidden size "
            f"{target.hidden_size}: this draft was made for another target model"
        )
    if config.vocab_size != target.vocab_size:
        raise DraftMismatchError(
            f"draft vocab_size {config.vocab_size} does not match the {name}'s vocabulary "
            f"{target.vocab_size}: this draft was made for another target model"
        )
    bad = [i for i in config.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise DraftMismatchError(
            f"draft target_layer_ids {list(config.target_layer_ids)} include {bad}, out of range "
            f"for the {name}'s {target.num_layers} layers: this draft was made for a deeper model"
        )
    if config.num_target_layers != target.num_layers:
        raise DraftMismatchError(
            f"draft num_target_layers {config.num_target_layers} does not match the {name}'s "
            f"{target.num_layers} layers: this draft was made for another target model"
        )
    if not 0 <= config.mask_token_id < target.vocab_size:
        raise DraftMismatchError(
            f"draft mask_token_id {config.mask_token_id} is outside the {name}'s vocabulary "
            f"of {target.vocab_size}"
        )


def check_vocab_ids(token_ids: mx.array, vocab_size: int) -> None:
    """A reduced draft vocabulary must be a non-empty list of ids inside the target's vocabulary."""
    if token_ids.ndim != 1 or token_ids.size == 0:
        raise DraftMismatchError(f"the draft vocabulary has shape {tuple(token_ids.shape)}: expected a non-empty "
                                 "list of the target's token ids")
    low, high = mx.min(token_ids).item(), mx.max(token_ids).item()
    if low < 0 or high >= vocab_size:
        raise DraftMismatchError(
            f"the draft vocabulary names token id {high if high >= vocab_size else low}, outside the target's "
            f"vocabulary of {vocab_size} tokens: this draft was made for another target model")
