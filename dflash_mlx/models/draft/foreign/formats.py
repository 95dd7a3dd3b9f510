"""Which layout a draft checkpoint is in, and its z-lab form (the hook `load_draft` calls)."""

from typing import Dict, Optional, Tuple

import mlx.core as mx

from dflash_mlx.models.draft.foreign import speculators
from dflash_mlx.models.draft.foreign import vllm


def zlab_layout(cfg: dict, weights: Dict[str, mx.array], target=None, source: str = "draft"
                ) -> Tuple[dict, Dict[str, mx.array], Optional[mx.array]]:
    """(config dict, weights, reduced vocabulary from the checkpoint or None) in z-lab's layout.

    speculators' and vLLM's reduced-vocabulary layouts are converted; a z-lab checkpoint
    comes back as it is."""
    if speculators.is_speculators(cfg):
        return speculators.to_zlab(cfg, weights, target, source=f"speculators draft {source}")
    if vllm.is_vllm_reduced(cfg, weights):
        return vllm.to_zlab(cfg, weights, target, source=f"vLLM-format draft {source}")
    return cfg, weights, None
