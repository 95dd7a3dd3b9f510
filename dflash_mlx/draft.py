"""The DFlash draft: a few decoder layers that denoise a whole block in one forward.

Checkpoints use z-lab's published layout (config.json + model.safetensors) and load
unchanged. The draft owns no embedding and no LM head: it borrows the target's.
Target features (outputs of `target_layer_ids`) are fused by `fc` + `hidden_norm`
and injected into every layer's KV cache through that layer's own k/v projections.
The cache holds context K/V only; block K/V are recomputed each step and never
stored, so the draft never needs a rollback. DFlash 2 drafts (same injection, a
grouped dynamic conv around each sublayer and a candidate selector) live in
`dflash_mlx.draft2`; loading and saving pick the class from the config.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from dflash_mlx.layout import relayout_for_cpu

# Optional extra stored next to a checkpoint: the reduced draft vocabulary; we use it
# to score only these token ids. A .npy file, not .safetensors: z-lab's MLX loader reads
# every *.safetensors in the folder as weights, so the folder stays loadable there.
DRAFT_VOCAB_FILE = "draft_vocab.npy"
LEGACY_DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # read from drafts written before

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
    """z-lab's default: spread the taps over the target, skipping the very first and last layers."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    step = (end - start) / (num_draft_layers - 1)
    return [int(round(start + i * step)) for i in range(num_draft_layers)]


class ContextCache:
    """Context-only K/V of one draft layer, with absolute positions.

    Full-attention layers keep everything (mlx-lm's KVCache, grown in steps);
    sliding layers keep the last `window - 1` entries, the most any block query
    can see, plus `TRIM_SLACK` more (masked out) so that a prompt cache can trim
    a few tokens (an edited answer's tail) without rebuilding the window.
    """

    TRIM_SLACK = 32

    def __init__(self, window: Optional[int] = None):
        self.window = window
        self._full = KVCache() if window is None else None
        self.keys = None
        self.values = None
        self.offset = 0  # absolute number of context tokens seen

    def append(self, keys: mx.array, values: mx.array):
        """keys, values: [B, n_kv, S, d] at positions offset..offset+S-1."""
        self.offset += keys.shape[2]
        if self._full is not None:
            return self._full.update_and_fetch(keys, values)
        if self.keys is not None:
            keys = mx.concatenate([self.keys, keys], axis=2)
            values = mx.concatenate([self.values, values], axis=2)
        keep = self.window - 1 + self.TRIM_SLACK
        self.keys, self.values = keys[..., -keep:, :], values[..., -keep:, :]
        return self.keys, self.values

    def trimmable(self, n: int) -> bool:
        """Whether dropping the newest n entries leaves all a later block can see: always on
        full layers; on sliding ones only while the older entries it needs are still held."""
        if self._full is not None:
            return True
        held = 0 if self.keys is None else self.keys.shape[2]
        return n <= held and held - n >= min(self.window - 1, self.offset - n)

    def trim(self, n: int) -> int:
        """Drop the newest n context entries (`trimmable(n)` must hold)."""
        if not self.trimmable(n):
            raise RuntimeError("this sliding-window draft cache no longer holds what a trim would "
                               "leave visible; rebuild it from the target's features")
        self.offset -= n
        if self._full is not None:
            return self._full.trim(n)
        if n:
            self.keys, self.values = self.keys[..., :-n, :], self.values[..., :-n, :]
        return n

    def fetch(self):
        if self._full is not None:
            if self._full.keys is None:
                return None, None
            return self._full.keys[..., : self._full.offset, :], self._full.values[..., : self._full.offset, :]
        return self.keys, self.values


class DraftAttention(nn.Module):
    def __init__(self, config: DraftConfig, layer_idx: int):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.window = config.sliding_window if sliding else None
        # z-lab's drafts are causal inside the block on sliding layers unless the
        # config says otherwise; full layers see the whole block.
        self.is_causal = sliding if config.is_causal is None else config.is_causal
        dim, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(dim, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, dim, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)

    def project_kv(self, h: mx.array, rope, offset: int):
        """h: [B, S, H] -> k, v: [B, n_kv, S, d], RoPE'd at positions offset..offset+S-1."""
        B, S, _ = h.shape
        k = self.k_norm(self.k_proj(h).reshape(B, S, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(h).reshape(B, S, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return rope(k, offset=offset), v

    def inject(self, h_ctx: mx.array, rope, cache: ContextCache):
        """KV injection: the fused target features become this layer's context K/V."""
        if h_ctx.shape[1] == 0:
            return
        k, v = self.project_kv(h_ctx, rope, cache.offset)
        cache.append(k, v)

    def __call__(self, x: mx.array, rope, cache: ContextCache, mask_fn=None) -> mx.array:
        B, L, _ = x.shape
        start = cache.offset  # block positions continue after the context
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = rope(q, offset=start)
        k_blk, v_blk = self.project_kv(x, rope, start)
        k_ctx, v_ctx = cache.fetch()
        n_ctx = 0 if k_ctx is None else k_ctx.shape[2]
        if n_ctx:
            keys = mx.concatenate([k_ctx, k_blk], axis=2)
            values = mx.concatenate([v_ctx, v_blk], axis=2)
        else:
            keys, values = k_blk, v_blk
        mask = self._mask(L, n_ctx, start)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _mask(self, L: int, n_ctx: int, start: int):
        if self.window is None and not self.is_causal:
            return None
        q_pos = start + mx.arange(L)[:, None]
        k_pos = mx.concatenate([start - n_ctx + mx.arange(n_ctx), start + mx.arange(L)])[None]
        is_ctx = mx.arange(n_ctx + L)[None] < n_ctx
        ctx_ok = is_ctx
        if self.window is not None:
            ctx_ok = ctx_ok & (q_pos - k_pos < self.window)
        blk_ok = ~is_ctx
        if self.is_causal:
            blk_ok = blk_ok & (k_pos <= q_pos)
        return ctx_ok | blk_ok


class DraftLayer(nn.Module):
    def __init__(self, config: DraftConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DraftAttention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)  # mlx-lm's SwiGLU, z-lab's names
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, rope, cache):
        h = x + self.self_attn(self.input_layernorm(x), rope, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    """Block-diffusion drafter. Bind it to a target (`bind`) before use."""

    layer_class = DraftLayer
    version = 1

    def __init__(self, config: DraftConfig):
        super().__init__()
        if config.version != self.version:
            # A DFlash 2 config in a DFlash model would silently drop the conv and the selector.
            raise DraftMismatchError(
                f"{type(self).__name__} builds DFlash {self.version} drafts but the config is "
                f"DFlash {config.version}; build it with dflash_mlx.draft.draft_class(config)(config)"
            )
        self.config = config
        n_feat = len(config.target_layer_ids) * config.hidden_size
        self.fc = nn.Linear(n_feat, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [self.layer_class(config, i) for i in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Plain attributes (not module children): the target's weights are borrowed,
        # never saved with the draft nor trained.
        object.__setattr__(self, "_rope", initialize_rope(
            config.head_dim,
            config.rope_theta,
            False,
            config.rope_scaling,
            config.max_position_embeddings,
        ))
        object.__setattr__(self, "target", None)
        object.__setattr__(self, "vocab_ids", None)  # reduced draft vocabulary, or None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def bind(self, target) -> "DFlashDraftModel":
        """target: a `dflash_mlx.target.Target` (supplies embed/lm_head)."""
        object.__setattr__(self, "target", target)
        return self

    def set_vocab(self, token_ids: Optional[mx.array]):
        object.__setattr__(self, "vocab_ids", token_ids)

    def make_cache(self) -> List[ContextCache]:
        from dflash_mlx import kernels

        if kernels.use_metal("kv_inject"):
            # Preallocated K/V of all layers: the kernel's output lands with one write per tensor.
            return kernels.make_stacked_cache(self)
        return [ContextCache(layer.self_attn.window) for layer in self.layers]

    def fuse(self, features: mx.array) -> mx.array:
        """features: [B, S, n_tl*H] concatenated target layer outputs -> [B, S, H]."""
        return self.hidden_norm(self.fc(features))

    def inject(self, features: Optional[mx.array], cache: List[ContextCache]):
        if features is None:
            return
        from dflash_mlx import kernels

        if kernels.use_metal("kv_inject"):  # off unless verified on Apple GPUs (see metal/README.md)
            return kernels.draft_inject(self, features, cache)
        self.inject_reference(features, cache)

    def inject_reference(self, features: mx.array, cache: List[ContextCache]):
        h_ctx = self.fuse(features)
        for layer, c in zip(self.layers, cache):
            layer.self_attn.inject(h_ctx, self._rope, c)

    def hidden(self, block_ids: mx.array, cache: List[ContextCache]) -> mx.array:
        """block_ids: [B, L] -> normalized hidden states [B, L, H]."""
        h = self.target.embed(block_ids)
        if self.config.input_embedding_scale != 1.0:
            h = h * self.config.input_embedding_scale
        for layer, c in zip(self.layers, cache):
            h = layer(h, self._rope, c)
        return self.norm(h)

    def logits(self, h: mx.array, vocab_ids: Optional[mx.array] = None) -> mx.array:
        """Draft logits over `vocab_ids`, else the draft vocabulary (all target tokens, or `self.vocab_ids`)."""
        out = self.target.head(h, self.vocab_ids if vocab_ids is None else vocab_ids)
        if self.config.output_multiplier != 1.0:
            out = out * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            out = mx.tanh(out / cap) * cap
        return out

    def propose_hidden(
        self, last_token: mx.array, features: Optional[mx.array], cache: List[ContextCache], block_size: int
    ) -> mx.array:
        """Inject `features`, denoise `[last, MASK x (block_size-1)]`: hidden [B, block_size-1, H] of the mask positions."""
        self.inject(features, cache)
        B = last_token.shape[0]
        mask_ids = mx.full((B, block_size - 1), self.config.mask_token_id, dtype=last_token.dtype)
        block = mx.concatenate([last_token[:, None], mask_ids], axis=1)
        return self.hidden(block, cache)[:, 1:]

    def propose_logits(
        self, last_token: mx.array, features: Optional[mx.array], cache: List[ContextCache], block_size: int
    ) -> mx.array:
        """One denoising step.

        last_token: [B] last committed token; features: [B, S_new, n_tl*H] for the
        tokens committed since the previous call (injected into the cache).
        Returns logits [B, block_size-1, V_draft] for the mask positions.
        """
        return self.logits(self.propose_hidden(last_token, features, cache, block_size))

    def to_target_ids(self, draft_ids: mx.array) -> mx.array:
        return draft_ids if self.vocab_ids is None else self.vocab_ids[draft_ids]


# ---------------------------------------------------------------------------
# checkpoints


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
        from dflash_mlx.draft2 import dflash2_shapes

        shapes.update(dflash2_shapes(config))
    return shapes


def draft_class(config: DraftConfig):
    """The model class a config describes (DFlash or DFlash 2)."""
    if config.version == 2:
        from dflash_mlx.draft2 import DFlash2DraftModel

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


def load_draft_folder(path: Path, dtype: Optional[mx.Dtype] = None) -> DFlashDraftModel:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in draft folder {path}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise DraftMismatchError(f"draft config {cfg_file} is not valid JSON: {e}") from None
    config = DraftConfig.from_dict(cfg)
    files = sorted(f for f in path.glob("*.safetensors") if f.name != LEGACY_DRAFT_VOCAB_FILE)
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in draft folder {path}")
    weights = {}
    for f in files:
        weights.update(_read_safetensors(f))
    check_weights(weights, config)
    model = draft_class(config)(config)
    if dtype is not None:
        weights = {k: v.astype(dtype) for k, v in weights.items()}
    model.load_weights(list(weights.items()))
    ids = _read_draft_vocab(path)
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
            raise DraftMismatchError(f"draft vocabulary {vocab_file} cannot be read ({e}): re-export the draft") from None
    elif (path / LEGACY_DRAFT_VOCAB_FILE).is_file():
        ids = _read_safetensors(path / LEGACY_DRAFT_VOCAB_FILE).get("token_ids")
        if ids is None:
            raise DraftMismatchError(f"{path / LEGACY_DRAFT_VOCAB_FILE} has no 'token_ids' tensor")
    else:
        return None
    if ids.ndim != 1:
        raise DraftMismatchError(f"draft vocabulary in {path} has shape {ids.shape}, expected a list of token ids")
    return ids.astype(mx.int32)


def check_weights(weights: Dict[str, mx.array], config: DraftConfig):
    expected = expected_shapes(config)
    hints = {}
    if config.version == 2:
        from dflash_mlx.draft2 import dflash2_hints

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


def save_draft(model: DFlashDraftModel, path, metadata: Optional[Dict[str, str]] = None):
    """Write z-lab's layout atomically (a temporary folder renamed into place)."""
    import shutil
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-draft-", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
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
    from dflash_mlx.target import Target

    if not isinstance(target, Target):
        target = Target(target)
    if version == 2:
        from dflash_mlx.draft2 import dflash2_defaults

        config_overrides = {**dflash2_defaults(target.hidden_size), **config_overrides}
    mx.random.seed(seed)
    config = random_draft_config(target, version=version, **config_overrides)
    model = draft_class(config)(config)
    if version == 2:
        from dflash_mlx.draft2 import randomize_dflash2

        randomize_dflash2(model)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.eval()
    return model.bind(target)


def _resolve_draft_dir(name_or_path: str) -> Optional[Path]:
    """Folder for a local path, a packaged draft name, or a hub id (downloaded); None: packaged but not shipped."""
    from dflash_mlx import packaged
    from dflash_mlx.loading import ModelLoadError, hub_snapshot, resolve_source

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


def load_draft(name_or_path, model=None, dtype: Optional[mx.Dtype] = None, quiet: bool = False) -> DFlashDraftModel:
    """Load a draft (folder, packaged name or hub id), check it fits `model`, bind it.

    The draft takes the target's dtype unless `dtype` is given.
    """
    from dflash_mlx.target import Target

    target = None
    if model is not None:
        target = model if isinstance(model, Target) else Target(model, name=str(getattr(model, "name", "")) or None)
        if dtype is None:
            dtype = target.text_model.embed_tokens.weight.dtype
            if dtype not in (mx.float32, mx.float16, mx.bfloat16):  # quantized embedding
                dtype = target.text_model.embed_tokens.scales.dtype
    folder = _resolve_draft_dir(str(name_or_path))
    if folder is None:
        if target is None:
            raise ValueError(f"packaged draft '{name_or_path}' is not shipped yet; pass the target model")
        if not quiet:
            import sys

            print(
                f"[dflash-mlx] no trained draft is shipped for '{name_or_path}' yet: using an untrained "
                "draft (output is still exactly the target's, only slower)",
                file=sys.stderr,
            )
        return random_draft(target, seed=0, dtype=dtype or mx.float32, num_layers=1)
    draft = load_draft_folder(folder, dtype=dtype)
    relayout_for_cpu(draft)
    if target is not None:
        validate_for_target(draft.config, target)
        draft.bind(target)
    return draft
