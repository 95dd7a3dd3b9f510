"""speculators' DFlash checkpoints (`speculators_model_type: "dflash"`), read and written.

Their layout, as speculators 0.9.0 writes it (`DFlashSpeculatorConfig`, its
converter `speculators/convert/dflash/converter.py`) and vLLM reads it
(`vllm/transformers_utils/configs/speculators/algos.py`, `update_dflash`):

- `transformer_layer_config`: the draft's own Qwen3 config (a transformers
  `to_diff_dict`, so keys at their default may be missing);
- `aux_hidden_state_layer_ids`: the verifier hidden states the draft reads, counted
  like `hidden_states` of transformers (0 = the embedding output, k = the output of
  decoder layer k-1): z-lab's `target_layer_ids` + 1. The verifier's last layer is
  never an aux layer (their trainer takes it separately, as the loss's target);
- `draft_vocab_size`, and for a reduced vocabulary `d2t` (EAGLE-3's offsets: target
  id = draft index + d2t[index]), `t2d` (a mask over the verifier's vocabulary) and
  the draft's `lm_head` (the verifier's head rows, frozen in their training);
- `mask_token_id`, `block_size`, `sample_from_anchor`, `sliding_window_non_causal`;
- weights: the body under z-lab's names. `embed_tokens`, `verifier_lm_head`,
  `verifier_norm` (and a full-vocabulary `lm_head`) are the verifier's and left out
  on save; older checkpoints may carry them.
"""

import json
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx

from dflash_mlx.models.draft.foreign.common import (
    ForeignDraftError,
    check_verifier_tensor,
    head_rows,
    reduced_vocab_ids,
    sample_rows,
)

MODEL_TYPE = "dflash"
SPECULATORS_VERSION = "0.9.0"  # the version whose layout this mirrors (and writes)
# speculators' own defaults (DFlashSpeculatorConfig) for keys a config may leave out
DEFAULT_BLOCK_SIZE = 8
# verifier tensors a checkpoint may carry; the draft borrows the target's instead
VERIFIER_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")
# z-lab config keys that are not the draft transformer's (speculators' converter drops the same)
NON_TRANSFORMER_KEYS = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers")


def is_speculators(cfg: dict) -> bool:
    return "speculators_model_type" in cfg


def _full_layer_config(tl: dict, source: str) -> dict:
    """The draft's transformer config with transformers' defaults filled in, as speculators
    reads it (`AutoConfig.for_model(model_type, **tl)`)."""
    model_type = tl.pop("model_type", "qwen3")
    if model_type != "qwen3":
        raise ForeignDraftError(
            f"{source}: transformer_layer_config.model_type is {model_type!r}; DFlash drafts are qwen3 layers"
        )
    try:
        from transformers import AutoConfig

        return AutoConfig.for_model(model_type, **tl).to_dict()
    except ImportError:
        return dict(tl)


def _ints(value) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in value))


def to_zlab(cfg: dict, weights: Dict[str, mx.array], target=None, source: str = "speculators draft"
            ) -> Tuple[dict, Dict[str, mx.array], Optional[mx.array]]:
    """(z-lab config dict, body weights, reduced vocabulary or None) of a speculators checkpoint.

    `target` (a `dflash_mlx.models.target.adapter.Target`, optional) is checked against: layer ids in
    range, the verifier tensors stored with the draft being its own."""
    kind = cfg.get("speculators_model_type")
    if kind != MODEL_TYPE:
        raise ForeignDraftError(
            f"{source}: speculators_model_type is {kind!r}; only DFlash drafts ({MODEL_TYPE!r}) load here"
        )
    for key, why in (("transformer_layer_config", "the draft layers' shapes"),
                     ("aux_hidden_state_layer_ids", "the verifier layers the draft reads"),
                     ("mask_token_id", "the token of the masked block positions")):
        if cfg.get(key) is None:
            raise ForeignDraftError(f"{source}: config.json has no '{key}' ({why}); it is not a complete "
                                    "speculators DFlash checkpoint")
    if cfg.get("sample_from_anchor"):
        raise ForeignDraftError(f"{source}: sample_from_anchor is true (the anchor slot predicts too); "
                                "DFlash drafts here predict the masked positions only")
    aux = cfg["aux_hidden_state_layer_ids"]
    if not _ints(aux):
        raise ForeignDraftError(f"{source}: aux_hidden_state_layer_ids must be a list of layer numbers, got {aux!r}")
    verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    made_for = f" (made for {verifier!r})" if verifier else ""
    if min(aux) < 1:
        raise ForeignDraftError(
            f"{source}: aux_hidden_state_layer_ids {aux} include {min(aux)}: 0 is the embedding output, and "
            "DFlash drafts read decoder layer outputs (speculators counts them from 1)"
        )
    if target is not None and max(aux) >= target.num_layers:
        bad = [i for i in aux if i >= target.num_layers]
        raise ForeignDraftError(
            f"{source}: aux_hidden_state_layer_ids {aux} include {bad}, out of range for the target's "
            f"{target.num_layers} layers (1..{target.num_layers - 1}: the last layer is never an aux layer)"
            f"{made_for}: this draft was made for a deeper model"
        )
    tl = _full_layer_config(dict(cfg["transformer_layer_config"]), source)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(tl.get(key), int):
            raise ForeignDraftError(f"{source}: transformer_layer_config has no '{key}'")
    if target is not None:
        for key, ours in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
            if tl[key] != ours:
                raise ForeignDraftError(
                    f"{source}: transformer_layer_config.{key} is {tl[key]} but the target's is {ours}"
                    f"{made_for}: this draft was made for another target model"
                )
    vocab = tl["vocab_size"]
    weights = dict(weights)
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
    draft_vocab = cfg.get("draft_vocab_size", vocab)
    ids = reduced_vocab_ids(draft_vocab, vocab, d2t, source)  # their rule: equal sizes, no mapping
    if ids is not None:
        if t2d is not None:
            mask = t2d.astype(mx.bool_)
            if mask.shape != (vocab,) or int(mask.sum()) != draft_vocab or not bool(mask[ids].all()):
                raise ForeignDraftError(f"{source}: 't2d' does not mark the same tokens as 'd2t'")
    _check_verifier_tensors(weights, tl, ids, target, source, verifier)
    for name in VERIFIER_TENSORS:
        weights.pop(name, None)
    sliding = "sliding_attention" in (tl.get("layer_types") or [])
    out = {k: v for k, v in tl.items() if k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings", "rope_theta",
        "rope_scaling", "rope_parameters", "layer_types") and v is not None}
    out.update(architectures=["DFlashDraftModel"], model_type="qwen3",
               block_size=int(cfg.get("block_size") or DEFAULT_BLOCK_SIZE),
               dflash_config={"target_layer_ids": [i - 1 for i in aux], "mask_token_id": int(cfg["mask_token_id"])})
    if sliding:
        out["sliding_window"] = tl.get("sliding_window")
        if cfg.get("sliding_window_non_causal"):
            out["is_causal"] = False
    if target is not None:
        out["num_target_layers"] = target.num_layers
    return out, weights, ids


def _check_verifier_tensors(weights, tl, ids, target, source, verifier):
    H, V = tl["hidden_size"], tl["vocab_size"]
    n_head = V if ids is None else ids.shape[0]
    shapes = {"embed_tokens.weight": (V, H), "lm_head.weight": (n_head, H),
              "verifier_lm_head.weight": (n_head, H), "verifier_norm.weight": (H,)}
    for name, shape in shapes.items():
        if name in weights and tuple(weights[name].shape) != shape:
            raise ForeignDraftError(f"{source}: '{name}' has shape {tuple(weights[name].shape)}, expected {shape}")
    if target is None:
        return
    rows = sample_rows(n_head)
    token_ids = rows if ids is None else ids[rows]
    for name in ("lm_head.weight", "verifier_lm_head.weight"):
        if name in weights:
            check_verifier_tensor(name, weights[name][rows], head_rows(target, token_ids), "LM head", source, verifier)
    if "embed_tokens.weight" in weights:
        sample = sample_rows(V)
        check_verifier_tensor("embed_tokens.weight", weights["embed_tokens.weight"][sample],
                              target.embed_tokens(sample), "embedding", source, verifier)


# ----------------------------------------------------------------------------- writing


def from_zlab(zlab_cfg: dict, body: Dict[str, mx.array], vocab_ids: Optional[mx.array], verifier: str,
              verifier_architectures=(), num_target_layers: Optional[int] = None,
              head: Optional[mx.array] = None) -> Tuple[dict, Dict[str, mx.array]]:
    """(config.json dict, weights) in speculators' layout for a z-lab-format draft.

    `vocab_ids` (the reduced draft vocabulary, or None for the full one) becomes
    `draft_vocab_size` + `d2t` + `t2d` + `lm_head` (`head`: the verifier's rows for
    those ids, [n, H], required with `vocab_ids`). Fails, as speculators' converter
    does, on a draft that reads the verifier's last layer (`num_target_layers`)."""
    dfl = zlab_cfg.get("dflash_config") or {}
    layer_ids = list(dfl.get("target_layer_ids") or zlab_cfg.get("target_layer_ids") or [])
    n_layers = num_target_layers or zlab_cfg.get("num_target_layers")
    if n_layers is not None and n_layers - 1 in layer_ids:
        raise ForeignDraftError(
            f"the draft reads the target's last layer ({n_layers - 1}), which speculators' layout cannot hold "
            "(its trainer takes that layer as the loss's target, never as an input)"
        )
    block_size = zlab_cfg.get("block_size") or dfl.get("block_size")
    tl = {k: v for k, v in zlab_cfg.items() if k not in NON_TRANSFORMER_KEYS}
    vocab = tl["vocab_size"]
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": MODEL_TYPE,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": tl,
        "draft_vocab_size": vocab if vocab_ids is None else int(vocab_ids.shape[0]),
        "block_size": int(block_size),
        "aux_hidden_state_layer_ids": [i + 1 for i in layer_ids],
        "mask_token_id": dfl.get("mask_token_id", zlab_cfg.get("mask_token_id")),
        "sample_from_anchor": False,
        "sliding_window_non_causal": zlab_cfg.get("is_causal") is False,
        "target_hidden_size": None,
        "speculators_config": {
            "algorithm": MODEL_TYPE,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(block_size) - 1,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }
    weights = dict(body)
    if vocab_ids is not None:
        if head is None:
            raise ValueError("a reduced-vocabulary export needs the verifier's head rows")
        ids = vocab_ids.astype(mx.int64)
        weights["d2t"] = ids - mx.arange(ids.shape[0], dtype=mx.int64)
        t2d = mx.zeros((vocab,), dtype=mx.bool_)
        t2d[ids] = True
        weights["t2d"] = t2d
        weights["lm_head.weight"] = head.astype(next(iter(body.values())).dtype)
    return cfg, weights


def read_config(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
