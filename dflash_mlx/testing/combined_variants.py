"""Config variants with their options switched on together, as real configs have them (a chunked,
MoE-interleaved, q/k-normed llama4): per architecture, one variant of every option kind
`testing.variants` gives it, merged into one config, once per RoPE scaling type the model reads.
`testing.variant_check` checks them as it checks single variants.
"""

import copy
from typing import Dict, List

from dflash_mlx.testing import arch_check, variants

# kinds merged into one config, in the order they are given up when mlx-lm rejects the whole:
# the last first. Kinds of several fields (qk norms, sinks, soft-caps) merge every field. One KV
# head and other layer counts stay single options: a tensor split needs heads to split, a
# pipeline layers to split.
COMBINED_ORDER = ("window", "chunk", "qk_norm", "softcap", "sinks", "partial_rotary", "nope", "rope_traditional",
                  "moe_layers", "kv_sharing", "attn_temperature", "sparse_topk", "conv6")
_MERGE_ALL = ("qk_norm", "softcap", "sinks")


def combined(key: str) -> List[variants.Variant]:
    """The options of `key` switched on together, as real configs have them (a chunked, MoE-
    interleaved, q/k-normed llama4): one variant per RoPE scaling type the model reads (its
    kind "combined:<type>"), or one "combined" where it reads none, on top of one variant of
    every other kind. Fallbacks give up kinds from the end of `COMBINED_ORDER` until mlx-lm
    builds the config."""
    parts: Dict[str, List[Dict[str, object]]] = {}
    ropes: List[variants.Variant] = []
    for v in variants.variants(key):
        kind = v.kind.split(":")[0]
        if kind == "rope":
            ropes.append(v)
        elif kind in COMBINED_ORDER and (kind in _MERGE_ALL or kind not in parts):
            parts.setdefault(kind, []).append(v.overrides)
    kinds = [k for k in COMBINED_ORDER if k in parts]
    if len(kinds) + bool(ropes) < 2:
        return []  # one option alone: `variants` has it

    def merged(kept, rope_over):
        over: Dict[str, object] = {}
        for kind in kept:
            for part in parts[kind]:
                over.update(copy.deepcopy(part))
        over.update(copy.deepcopy(rope_over))
        return over

    out = []
    for rope in ropes or [None]:
        rope_overs = [rope.overrides] + rope.candidates if rope else [{}]
        configs = [merged(kinds[:n], r) for n in range(len(kinds), -1, -1) for r in rope_overs]
        configs = [c for c in configs if c]
        name = "combined" + (":" + rope.kind.split(":", 1)[1] if rope else "")
        out.append(variants.Variant(key, name, configs[0], configs[1:]))
    return out


def all_combined(keys=None) -> List[variants.Variant]:
    return [v for key in (keys or arch_check.ARCHITECTURES) for v in combined(key)]
