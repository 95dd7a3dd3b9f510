"""vLLM's reduced-vocabulary DFlash form: z-lab's config + `draft_vocab_size`, and in
the weights the draft's own `lm_head` ([draft_vocab_size, H]) and `d2t`.

The rules mirrored, from vLLM's `DFlashQwen3ForCausalLM` (`qwen3_dflash.py`):
`draft_vocab_size` missing means the full vocabulary; the LM head has
`draft_vocab_size` rows; `d2t` is loaded as `draft_id_to_target_id` and a
proposal's target id is its draft index + `d2t[index]` (EAGLE-3's offsets); `t2d` is
skipped; body tensors keep z-lab's names (vLLM prefixes them with `model.`).
A reduced head without `d2t` is a silent misreading there (ids left at 0 offsets);
here it is an error.
"""

from typing import Dict, Optional, Tuple

import mlx.core as mx

from dflash_mlx.models.draft.foreign.common import (
    ForeignDraftError, check_verifier_tensor, head_rows, reduced_vocab_ids, sample_rows,
)


def is_vllm_reduced(cfg: dict, weights: Dict[str, mx.array]) -> bool:
    return "draft_vocab_size" in cfg or "d2t" in weights or "lm_head.weight" in weights


def to_zlab(cfg: dict, weights: Dict[str, mx.array], target=None, source: str = "vLLM draft"
            ) -> Tuple[dict, Dict[str, mx.array], Optional[mx.array]]:
    """(z-lab config dict, body weights, reduced vocabulary or None)."""
    cfg, weights = dict(cfg), dict(weights)
    vocab = cfg.get("vocab_size")
    draft_vocab = cfg.pop("draft_vocab_size", None) or vocab
    d2t, head = weights.pop("d2t", None), weights.pop("lm_head.weight", None)
    weights.pop("t2d", None)
    embed = weights.pop("embed_tokens.weight", None)
    H = cfg.get("hidden_size")
    ids = reduced_vocab_ids(draft_vocab, vocab, d2t, source)
    if ids is not None and head is None:
        raise ForeignDraftError(f"{source}: draft_vocab_size is {draft_vocab} but the weights have no "
                                "'lm_head.weight' (the draft's own reduced head)")
    if head is not None and tuple(head.shape) != (draft_vocab, H):
        raise ForeignDraftError(f"{source}: 'lm_head.weight' has shape {tuple(head.shape)}, "
                                f"expected ({draft_vocab}, {H})")
    if target is not None and head is not None:
        rows = sample_rows(draft_vocab)
        token_ids = rows if ids is None else ids[rows]
        # The draft's head must be the target's rows: the engine scores with the target's head.
        check_verifier_tensor("lm_head.weight", head[rows], head_rows(target, token_ids), "LM head", source)
    if target is not None and embed is not None:
        sample = sample_rows(embed.shape[0])
        check_verifier_tensor("embed_tokens.weight", embed[sample], target.embed_tokens(sample),
                              "embedding", source)
    return cfg, weights, ids


def from_zlab(zlab_cfg: dict, body: Dict[str, mx.array], vocab_ids: mx.array, head: mx.array
              ) -> Tuple[dict, Dict[str, mx.array]]:
    """(config.json dict, weights) in vLLM's reduced form; `head`: the target's rows for
    `vocab_ids`, [n, H]."""
    ids = vocab_ids.astype(mx.int64)
    cfg = dict(zlab_cfg, draft_vocab_size=int(ids.shape[0]))
    dtype = next(iter(body.values())).dtype
    weights = dict(body, **{"lm_head.weight": head.astype(dtype),
                            "d2t": ids - mx.arange(ids.shape[0], dtype=mx.int64)})
    return cfg, weights
