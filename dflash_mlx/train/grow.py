"""A trained draft grown to more layers (`dflash-mlx train --grow-from`): the new layers start
as copies that add nothing, so training continues from the trained draft's loss."""

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash_mlx.models.draft.config import DraftConfig
from dflash_mlx.models.draft.dflash import DFlashDraftModel


def grow_draft(draft: DFlashDraftModel, num_layers: int) -> DFlashDraftModel:
    """A deeper copy of a trained draft that computes exactly what it does.

    Layers past the draft's own are copies of its last ones (their attention already
    reads the fused context) with `o_proj` and `down_proj` zeroed: each new layer then
    adds nothing to the residual stream until training moves those two matrices, so
    the grown draft starts at the trained draft's loss instead of relearning it.
    Returns a new model, bound to the same target, with the same reduced vocabulary.
    """
    cfg = draft.config
    n_old = cfg.num_hidden_layers
    if num_layers < n_old:
        raise ValueError(f"cannot grow a {n_old}-layer draft to {num_layers} layers; give --layers >= {n_old}")
    if cfg.version != 1:
        raise ValueError("growing is implemented for DFlash 1 drafts only")
    d = cfg.to_dict()
    d["num_hidden_layers"] = num_layers
    d["layer_types"] = list(cfg.layer_types) + [cfg.layer_types[-1]] * (num_layers - n_old)
    grown = DFlashDraftModel(DraftConfig.from_dict(d))
    if draft.target is not None:
        grown.bind(draft.target)
    params = dict(tree_flatten(draft.parameters()))
    new = {k: v for k, v in params.items() if not k.startswith("layers.")}
    extra = num_layers - n_old
    # new layer j copies the last `extra` layers in order (all of them, cycled, when extra > n_old)
    sources = list(range(n_old)) + [n_old - extra + j if extra <= n_old else j % n_old for j in range(extra)]
    for i, src in enumerate(sources):
        for k, v in params.items():
            if k.startswith(f"layers.{src}."):
                name = f"layers.{i}." + k[len(f"layers.{src}."):]
                zero = i >= n_old and (name.endswith("self_attn.o_proj.weight")
                                       or name.endswith("mlp.down_proj.weight"))
                new[name] = mx.zeros_like(v) if zero else v
    grown.load_weights(list(new.items()))
    if draft.vocab_ids is not None:
        grown.set_vocab(draft.vocab_ids)
    mx.eval(grown.parameters())
    return grown
