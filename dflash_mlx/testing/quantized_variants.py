"""The `quantized` variant kind: a tiny config as mlx-lm quantizes it (`mlx_lm.convert -q`), as the
4- and 8-bit checkpoints users run. The variant is a config's `quantization` entry (which the
model's args ignore and mlx-lm's loader reads); `variants.build` then quantizes the built model."""

import contextlib
import io
from typing import Dict, List, Tuple

BITS = (4, 8)
GROUP_SIZE = 32  # the tiny configs' widths are multiples of 32 at best
FEED_FORWARD_WIDTHS = ("intermediate_size", "ffn_hidden_size", "expert_dim")


def specs(values: Dict[str, object]) -> List[Tuple[str, dict, list]]:
    """(kind, overrides, fallbacks) of the quantized variants of a model whose config has `values`.

    Where mlx-lm cannot quantize the tiny config (expert widths of 16; its MoE predicates put
    routers and down projections in groups of 64), the fallback widens the feed-forward widths,
    and the hidden size where the heads' width is set apart, to multiples of 64."""
    widths = {name: -(-value // 64) * 64 for name, value in values.items()
              if name.endswith(FEED_FORWARD_WIDTHS) and isinstance(value, int) and not isinstance(value, bool)
              and value % 64}
    hidden = values.get("hidden_size")
    if isinstance(hidden, int) and hidden % 64 and values.get("head_dim"):
        widths["hidden_size"] = -(-hidden // 64) * 64
    out = []
    for bits in BITS:
        quantization = {"quantization": {"group_size": GROUP_SIZE, "bits": bits}}
        out.append((f"quantized:{bits}bit", quantization, [dict(quantization, **widths)] if widths else []))
    return out


def quantize(model, cfg: dict):
    """`model`, quantized as mlx-lm quantizes it where `cfg` (or its `text_config`) has a
    `quantization` entry."""
    import mlx.core as mx
    from mlx_lm.utils import quantize_model

    quantization = cfg.get("quantization") or cfg.get("text_config", {}).get("quantization")
    if quantization:
        with contextlib.redirect_stdout(io.StringIO()):  # its bits-per-weight line
            quantize_model(model, cfg, quantization["group_size"], quantization["bits"])
        mx.eval(model.parameters())
    return model
