"""Start a draft from its target instead of from noise.

A DFlash draft is a few decoder layers reading the target's features. The
target's own last layers already turn "layer L-n-1 output" into next-token
hidden states, so copying them, and fusing the features so that the context
starts as exactly what layer L-n reads, gives the draft a sane function at step
0: on SmolLM2 the first loss drops from ~15 nats (random layers) to ~7.6 and a
handful of sequences becomes fittable (see `overfit_check` in run.py).

Pieces, each used where the shapes allow (`draft_config_from_target` makes them
allow it by default):
- draft layer i <- target layer `copy_layers[i]`: projections, MLP, norms;
- q/k norms: copied when the target has them, else set to the target's typical
  per-head q/k RMS so that `q_norm(q) ~ q` (the draft always normalizes q/k);
- `fc` passes the tap that feeds the first copied layer through, `hidden_norm`
  is that layer's input norm: the first draft layer's context K/V then equal the
  target's own K/V there;
- `norm` <- the target's final norm (the borrowed LM head sees its usual scale);
- layers of other kinds (MoE, hybrid targets): whatever has no counterpart of the
  same kind and shape stays random and is named in the returned dict: a sparse MoE
  block leaves the draft's dense MLP random (`no_dense_mlp`), a layer without
  attention (Gated DeltaNet, Mamba) its attention (`no_attention`). Where the last
  layers have no attention but enough earlier ones do, the draft copies the last
  layers that have it (`target_copy_layers`);
- feature preconditioning: the tapped features are very unevenly scaled (one
  SmolLM2 dimension has mean |x| 432 against a typical 26), which makes Adam's
  effective step per `fc` column proportional to that column's input scale.
  Training multiplies features by a fixed per-dimension `feature_scale`
  (1 / RMS); export folds it into `fc` (`fold_feature_scale`), so the shipped
  draft is plain z-lab format and computes the same function.
"""

from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from dflash_mlx.models.draft.dflash import DFlashDraftModel
from dflash_mlx.models.draft.config import DraftConfig, default_target_layer_ids


def _target_attention_layout(target):
    """(heads, kv_heads, head_dim, intermediate) of the target's decoder layers (an MoE
    target without a dense width: 4x its expert width, else 4x hidden; a target without
    attention heads, e.g. pure Mamba or RWKV: `random_draft_config`'s hidden/64 heads)."""
    a = target.args
    H = target.hidden_size
    heads = getattr(a, "num_attention_heads", None)
    if not isinstance(heads, int) or heads <= 0:
        heads = max(1, H // 64)
    kv = getattr(a, "num_key_value_heads", None) or heads
    head_dim = getattr(a, "head_dim", None) or H // heads
    inter = getattr(a, "intermediate_size", None)
    if not isinstance(inter, int) or inter <= 0:
        moe = getattr(a, "moe_intermediate_size", None)
        inter = 4 * moe if isinstance(moe, int) and moe > 0 else 4 * H
    return heads, kv, head_dim, inter


def default_copy_layers(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """The target's last layers: they map late features to next-token states."""
    return list(range(num_target_layers - num_draft_layers, num_target_layers))


def _child(module, name: str):
    """`module.name` when it is a submodule, else None (mlx Modules raise AttributeError)."""
    try:
        v = getattr(module, name)
    except AttributeError:
        return None
    return v if isinstance(v, nn.Module) else None


def _dense_mlp(layer) -> bool:
    """Whether a target decoder layer has a llama-style dense MLP (not a sparse MoE block)."""
    mlp = _child(layer, "mlp")
    return mlp is not None and all(isinstance(_child(mlp, n), (nn.Linear, nn.QuantizedLinear))
                                   for n in ("gate_proj", "up_proj", "down_proj"))


def has_attention(layer) -> bool:
    """Whether a target decoder layer has a softmax attention (`self_attn`) to copy."""
    return _child(layer, "self_attn") is not None


def target_copy_layers(target, num_draft_layers: int) -> List[int]:
    """The target layers a target-initialised draft copies: the last ones
    (`default_copy_layers`), or, when some of those have no attention (hybrid targets:
    Gated DeltaNet, Mamba layers) and at least `num_draft_layers` layers have one, the
    last layers that have attention (fewer attention layers than draft layers: all of
    them, and the last other layers after them). Dense and MoE targets: always the last ones."""
    layers = target.layers
    default = default_copy_layers(len(layers), num_draft_layers)
    if all(has_attention(layers[i]) for i in default if i >= 0):
        return default
    attn = [i for i, layer in enumerate(layers) if has_attention(layer)]
    if not attn:
        return default
    if len(attn) >= num_draft_layers:
        return attn[-num_draft_layers:]
    rest = [i for i in range(len(layers)) if i > attn[0] and i not in attn][len(attn) - num_draft_layers:]
    return sorted(attn + rest) if len(attn) + len(rest) == num_draft_layers else default


def target_init_layer_ids(num_target_layers: int, num_draft_layers: int, copy_layers=None,
                          target_layer_ids=None) -> List[int]:
    """Taps of a target-initialised draft: the given ones (default: 4 spread taps), with
    the last replaced by the layer feeding the first copied layer when it is missing
    (fc passes that tap through at step 0)."""
    copy_layers = list(copy_layers or default_copy_layers(num_target_layers, num_draft_layers))
    taps = list(target_layer_ids or default_target_layer_ids(num_target_layers, max(num_draft_layers, 4)))
    feed = copy_layers[0] - 1
    if feed >= 0 and feed not in taps:
        taps = taps[:-1] + [feed]
    return sorted(set(taps))  # small targets make the default spread repeat layers


def draft_config_from_target(
    target,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: Optional[Sequence[int]] = None,
    copy_layers: Optional[Sequence[int]] = None,
    **overrides,
) -> DraftConfig:
    """A draft config with the target's head layout, MLP width and RoPE, so its layers
    can be copied. The tap feeding the first copied layer is always included."""
    heads, kv, head_dim, inter = _target_attention_layout(target)
    copy_layers = list(copy_layers or target_copy_layers(target, num_layers))
    taps = target_init_layer_ids(target.num_layers, num_layers, copy_layers, target_layer_ids)
    a = target.args
    cfg = dict(
        hidden_size=target.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=target.vocab_size,
        target_layer_ids=taps,
        mask_token_id=mask_token_id,
        num_target_layers=target.num_layers,
        block_size=block_size,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=float(getattr(a, "rope_theta", 10000.0)),
        rope_scaling=getattr(a, "rope_scaling", None),
        max_position_embeddings=getattr(a, "max_position_embeddings", None) or 32768,
    )
    cfg.update(overrides)
    return DraftConfig(**cfg)


def choose_mask_token(tokenizer, records: Sequence[dict], vocab_size: int) -> int:
    """A token the target never reads as text: an unused special token when there is
    one (SmolLM2: `<empty_output>`), else the highest id absent from the data."""
    used = set()
    for r in records:
        used.update(r["prompt"])
        used.update(r["response"])
    tok = getattr(tokenizer, "_tokenizer", tokenizer)
    reserved = set(getattr(tokenizer, "eos_token_ids", None) or [])
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        v = getattr(tok, name, None)
        if isinstance(v, int):
            reserved.add(v)
    added = getattr(tok, "added_tokens_decoder", None) or {}
    special = sorted((i for i, t in added.items() if getattr(t, "special", False)), reverse=True)
    for i in special:
        if i < vocab_size and i not in reserved and i not in used:
            return int(i)
    for i in range(vocab_size - 1, -1, -1):
        if i not in used and i not in reserved:
            return i
    raise ValueError("every token id occurs in the training data: no free mask token")


def measure_feature_scale(features: Sequence[np.ndarray], eps: float = 1e-3) -> np.ndarray:
    """Per-dimension 1/RMS of tapped features [S, n_tl*H], skipping position 0
    (the first token carries massive activations in most LLMs)."""
    sq = np.zeros(features[0].shape[1], dtype=np.float64)
    n = 0
    for f in features:
        f = np.asarray(f[1:], dtype=np.float32)
        sq += (f.astype(np.float64) ** 2).sum(0)
        n += f.shape[0]
    rms = np.sqrt(sq / max(n, 1))
    return (1.0 / np.maximum(rms, eps)).astype(np.float32)


def _dense(layer) -> Optional[mx.array]:
    """The float weight of a Linear or QuantizedLinear."""
    if isinstance(layer, nn.QuantizedLinear):
        return mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
    w = getattr(layer, "weight", None)
    return None if w is None else w


def _typical_head_rms(target, layer_idx: int, sample: mx.array) -> Optional[Dict[str, float]]:
    """Median per-head RMS of the target's q and k at `layer_idx` on `sample` [1, S];
    None when that layer has no input norm and q/k projections to measure them with."""
    tl = target.layers[layer_idx]
    attn, norm = _child(tl, "self_attn"), _child(tl, "input_layernorm")
    projs = [_child(attn, n) if attn is not None else None for n in ("q_proj", "k_proj")]
    if norm is None or any(not isinstance(p, (nn.Linear, nn.QuantizedLinear)) for p in projs):
        return None
    feed = [layer_idx - 1] if layer_idx > 0 else []
    if feed:
        _, x, _ = target.forward(sample, None, feed)
    else:
        x = target.embed(sample)
    x = norm(x)
    out = {}
    for name, proj in zip(("q_proj", "k_proj"), projs):
        w = _dense(proj)
        y = x @ w.T
        d = _target_attention_layout(target)[2]
        y = y.reshape(*y.shape[:-1], -1, d)
        rms = mx.sqrt(mx.mean(y[:, 1:] * y[:, 1:], axis=-1))
        out[name] = float(np.median(np.array(rms)))
    return out


def init_from_target(
    draft: DFlashDraftModel,
    target,
    copy_layers: Optional[Sequence[int]] = None,
    scale: Optional[np.ndarray] = None,
    sample: Optional[Sequence[int]] = None,
    qk_norm: bool = True,
    passthrough: bool = True,
) -> Dict[str, object]:
    """Copy target weights into `draft` where shapes match (see the module docstring).

    `scale`: the per-dimension feature scale training will use (fc is set in that
    space); `sample`: token ids to measure q/k RMS on. Returns what was done:
    `copied_layers` (the target layers used), `skipped` (draft tensors left random),
    `no_attention` / `no_dense_mlp` (draft layers whose attention / MLP stayed random
    because their target layer has none: hybrid and MoE targets), `qk_rms` (or
    `qk_norm_unmeasured`: draft layers whose q/k norms stayed at 1), `passthrough_tap`.
    """
    cfg = draft.config
    copy_layers = list(copy_layers or target_copy_layers(target, cfg.num_hidden_layers))
    done: Dict[str, object] = {"copied_layers": [], "skipped": []}
    sample_ids = mx.array([list(sample or range(1, 65))])
    for i, (dl, li) in enumerate(zip(draft.layers, copy_layers)):
        tl = target.layers[li]
        attn = _child(tl, "self_attn")
        if attn is None:
            done.setdefault("no_attention", []).append(i)
        if not _dense_mlp(tl):
            done.setdefault("no_dense_mlp", []).append(i)
        for path, param in tree_flatten(dl.parameters()):
            mod_path, leaf = path.rsplit(".", 1)
            src = tl
            try:
                for part in mod_path.split("."):
                    src = getattr(src, part)
            except AttributeError:
                done["skipped"].append(f"layers.{i}.{path}")
                continue
            if leaf == "weight" and isinstance(src, (nn.Linear, nn.QuantizedLinear)):
                w = _dense(src)
            elif leaf == "weight" and type(src) is nn.RMSNorm:
                w = src.weight  # other norm kinds (Gemma's 1+w) mean something else
            else:
                w = None
            if w is None or tuple(w.shape) != tuple(param.shape):
                done["skipped"].append(f"layers.{i}.{path}")
                continue
            _set(dl, path, w.astype(mx.float32))
        has_qk_norm = attn is not None and type(_child(attn, "q_norm")) is nn.RMSNorm
        if qk_norm and not has_qk_norm and attn is not None:
            rms = _typical_head_rms(target, li, sample_ids)  # None: nothing to measure it with
            if rms is not None:
                dl.self_attn.q_norm.weight = mx.full(dl.self_attn.q_norm.weight.shape, rms["q_proj"])
                dl.self_attn.k_norm.weight = mx.full(dl.self_attn.k_norm.weight.shape, rms["k_proj"])
                done.setdefault("qk_rms", []).append(rms)
            else:
                done.setdefault("qk_norm_unmeasured", []).append(i)  # left at 1
        done["copied_layers"].append(li)
    feed = copy_layers[0] - 1
    taps = list(cfg.target_layer_ids)
    H = cfg.hidden_size
    if passthrough and feed in taps:
        j = taps.index(feed)
        w = np.zeros((H, len(taps) * H), dtype=np.float32)
        block = np.ones(H, dtype=np.float32) if scale is None else 1.0 / scale[j * H : (j + 1) * H]
        w[:, j * H : (j + 1) * H] = np.diag(block)
        draft.fc.weight = mx.array(w)
        norm = _child(target.layers[copy_layers[0]], "input_layernorm")
        if type(norm) is nn.RMSNorm and norm.weight.shape == draft.hidden_norm.weight.shape:
            draft.hidden_norm.weight = mx.array(norm.weight).astype(mx.float32)
        done["passthrough_tap"] = feed
    init_final_norm(draft, target)
    mx.eval(draft.parameters())
    return done


def _set(module, path: str, value: mx.array):
    *parents, leaf = path.split(".")
    for p in parents:
        module = module[int(p)] if p.isdigit() else getattr(module, p)
    setattr(module, leaf, value)


def fold_feature_scale(draft: DFlashDraftModel, scale: Optional[np.ndarray]):
    """fc(scale * x) == fc'(x) with fc' = fc * scale: the exported draft reads raw features."""
    if scale is None:
        return
    draft.fc.weight = draft.fc.weight * mx.array(scale)[None, :]
    mx.eval(draft.fc.weight)


def init_final_norm(draft: DFlashDraftModel, target):
    """Only the final norm from the target (the `--init random` recipe): the borrowed
    LM head then sees hidden states at its usual scale."""
    final = getattr(target.text_model, "norm", None)
    if type(final) is nn.RMSNorm and final.weight.shape == draft.norm.weight.shape:
        draft.norm.weight = mx.array(final.weight).astype(mx.float32)
        mx.eval(draft.norm.weight)


def make_draft_config(target, tokenizer, records, num_layers: int, block_size: int, init: str = "target",
                      target_layer_ids=None, copy_layers=None, mask_token_id: Optional[int] = None,
                      **overrides) -> DraftConfig:
    """The config of a fresh draft for `target` ("target": its layout, to copy layers;
    "random": `random_draft_config`'s smaller default layout)."""
    from dflash_mlx.models.draft.checkpoints import random_draft_config

    mask = choose_mask_token(tokenizer, records, target.vocab_size) if mask_token_id is None else mask_token_id
    if init == "target":
        return draft_config_from_target(target, num_layers, block_size, mask, target_layer_ids=target_layer_ids,
                                        copy_layers=copy_layers, **overrides)
    return random_draft_config(target, num_layers=num_layers, block_size=block_size, mask_token_id=mask,
                               target_layer_ids=target_layer_ids, **overrides)


def make_draft(config: DraftConfig, target, records, features, init: str = "target", copy_layers=None,
               feature_scale: bool = True, scale: Optional[np.ndarray] = None, qk_norm: bool = True,
               vocab: Optional[np.ndarray] = None):
    """A draft ready to train: built, bound, initialised. `features(record)` gives a
    record's tapped features (to measure the feature scale on up to 32 records).
    Returns (draft, feature scale or None, what init_from_target did)."""
    if feature_scale and scale is None:
        scale = measure_feature_scale([features(r) for r in records[:32]])
    elif not feature_scale:
        scale = None
    draft = DFlashDraftModel(config)
    draft.bind(target)
    done: Dict[str, object] = {"copied_layers": [], "skipped": []}
    if init == "target":
        rec = records[0]
        done = init_from_target(draft, target, copy_layers, scale=scale,
                                sample=(rec["prompt"] + rec["response"])[:256], qk_norm=qk_norm)
    else:
        init_final_norm(draft, target)
    if vocab is not None:
        draft.set_vocab(mx.array(vocab))
    mx.eval(draft.parameters())
    return draft, scale, done
