"""DFlash 2 drafts (z-lab's `DFlash2DraftModel` checkpoints, loaded unchanged).

Same context/KV injection and one-step block denoising as DFlash. Two additions:

- Each draft layer wraps its attention and its MLP in a grouped dynamic causal
  convolution over the block: the sublayer's input is convolved before it runs
  and its output after, with taps = a learned per-channel base kernel plus a
  per-position, per-group correction predicted from the (normalized) sublayer
  input. The conv runs over the block only (zeros before its first token), so
  it carries no state between cycles and the draft still needs no rollback.
- A candidate selector picks each position's proposal among the draft's top-k
  tokens, left to right: score = draft logit + a rank-r bilinear term linking
  the previously chosen token (predecessor codebook), the position's hidden
  state and the candidate (successor codebook). Its choice is the proposal
  (`select_tokens`), deterministic at every temperature, so the acceptance
  rule treats it as one-hot and speculative sampling stays exact.

Checkpoint names (z-lab's layout): per layer `attention_conv.{base_kernel
[2, K, H], kernel_projection.weight [2*K*G, H]}` and the same for `mlp_conv`
(G = hidden_size / conv_group_size; index 0 of the leading 2 is the input
conv, 1 the output conv); `candidate_selector.{predecessor_codebook,
successor_codebook} [V, r]` (bare tensors) and
`candidate_selector.hidden_projection.weight [r, H]`.
"""

from typing import Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from dflash_mlx.models.draft.context_cache import ContextCache
from dflash_mlx.models.draft.dflash import DFlashDraftModel, DraftLayer
from dflash_mlx.models.draft.config import DraftConfig


def grouped_causal_conv(x: mx.array, base: mx.array, dynamic: mx.array, group_size: int) -> mx.array:
    """y[t, c] = sum_o (base[o, c] + dynamic[t, o, c // group_size]) * x[t - o, c]  (x = 0 before t = 0).

    x: [B, L, H]; base: [K, H]; dynamic: [B, L, K, G] with G = H // group_size.
    """
    B, L, H = x.shape
    K = base.shape[0]
    taps = base.astype(x.dtype)[None, None] + mx.repeat(dynamic, group_size, axis=-1)  # [B, L, K, H]
    padded = mx.pad(x, [(0, 0), (K - 1, 0), (0, 0)])
    lagged = mx.stack([padded[:, K - 1 - o : K - 1 - o + L] for o in range(K)], axis=2)  # x[t - o]
    return (taps * lagged).sum(axis=2)


class GroupedDynamicConv(nn.Module):
    """Wraps one sublayer: conv its input, run it, conv its output; taps predicted from the input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        # Pass-through start: offset 0 of both base kernels is 1, the dynamic part adds to it.
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size)).at[:, 0].add(1.0)
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def __call__(self, x: mx.array, sublayer: Callable[[mx.array], mx.array]) -> mx.array:
        B, L, _ = x.shape
        dynamic = self.kernel_projection(x).reshape(B, L, 2, self.kernel_size, self.groups)
        y = sublayer(grouped_causal_conv(x, self.base_kernel[0], dynamic[:, :, 0], self.group_size))
        return grouped_causal_conv(y, self.base_kernel[1], dynamic[:, :, 1], self.group_size)


class DFlash2Layer(DraftLayer):
    def __init__(self, config: DraftConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        K, gs = config.conv_kernel_size, config.conv_group_size
        self.attention_conv = GroupedDynamicConv(config.hidden_size, K, gs)
        self.mlp_conv = GroupedDynamicConv(config.hidden_size, K, gs)

    def __call__(self, x, rope, cache):
        h = x + self.attention_conv(self.input_layernorm(x), lambda u: self.self_attn(u, rope, cache))
        return h + self.mlp_conv(self.post_attention_layernorm(h), self.mlp)


class CandidateSelector(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.top_k = config.selector_top_k
        self.predecessor_codebook = mx.random.normal((config.vocab_size, config.selector_rank))
        self.successor_codebook = mx.random.normal((config.vocab_size, config.selector_rank))
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)

    def __call__(self, hidden: mx.array, logits: mx.array, anchor: mx.array, to_target_ids) -> mx.array:
        """hidden [B, n, H], logits [B, n, V_draft], anchor [B] (target ids) -> chosen [B, n] (draft ids).

        Codebooks are indexed by target token ids; `to_target_ids` maps
        draft-vocabulary ids (a reduced draft vocabulary) to them.
        """
        n = logits.shape[1]
        k = min(self.top_k, logits.shape[-1])
        candidates = mx.argpartition(logits, -k, axis=-1)[..., -k:]  # [B, n, k], in no particular order
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        cand_ids = to_target_ids(candidates)
        # The hidden-state factor does not depend on the path: fold it into the successors once.
        successors = self.successor_codebook[cand_ids] * self.hidden_projection(hidden)[:, :, None]
        # Every edge score at once: from the anchor to position 0's candidates, and from each
        # candidate of position i-1 to each of position i. The left-to-right choice then only
        # reads rows of these tables.
        first = (successors[:, 0] @ self.predecessor_codebook[anchor][:, :, None])[..., 0]  # [B, k]
        rest = self.predecessor_codebook[cand_ids[:, :-1]] @ successors[:, 1:].swapaxes(-1, -2)  # [B, n-1, k, k]
        pick = mx.argmax(unary[:, 0] + first.astype(unary.dtype), axis=-1)  # [B]: index into position 0's candidates
        picks = [pick]
        for i in range(1, n):
            row = mx.take_along_axis(rest[:, i - 1], pick[:, None, None], axis=1)[:, 0]  # [B, k]
            pick = mx.argmax(unary[:, i] + row.astype(unary.dtype), axis=-1)
            picks.append(pick)
        return mx.take_along_axis(candidates, mx.stack(picks, axis=1)[..., None], axis=-1)[..., 0].astype(mx.int32)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash 2 drafter: `propose_logits` as DFlash, then `select_tokens` gives the proposal."""

    layer_class = DFlash2Layer
    version = 2

    def __init__(self, config: DraftConfig):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)
        # What the selector needs besides the logits, from the last propose_logits call
        # (plain attribute: not a parameter).
        object.__setattr__(self, "_selector_inputs", None)

    def propose_logits(
        self, last_token: mx.array, features: Optional[mx.array], cache: List[ContextCache], block_size: int
    ) -> mx.array:
        hidden = self.propose_hidden(last_token, features, cache, block_size)
        object.__setattr__(self, "_selector_inputs", (hidden, last_token))
        return self.logits(hidden)

    def select_tokens(self, draft_logits: mx.array) -> mx.array:
        """The selector's proposal [B, n] int32 (draft-vocabulary ids, like an argmax of
        `draft_logits`) for the logits the last `propose_logits` call returned."""
        if self._selector_inputs is None:
            raise RuntimeError("select_tokens needs the hidden states of a propose_logits call; call it first")
        hidden, last_token = self._selector_inputs
        if hidden.shape[:2] != draft_logits.shape[:2]:
            raise ValueError(
                f"select_tokens got logits for {draft_logits.shape[1]} positions but the last "
                f"propose_logits call made {hidden.shape[1]}; pass the logits it returned"
            )
        return self.candidate_selector(hidden, draft_logits, last_token, self.to_target_ids)


def dflash2_shapes(config: DraftConfig) -> Dict[str, tuple]:
    """Shapes of the tensors a DFlash 2 checkpoint has on top of DFlash's."""
    H, K = config.hidden_size, config.conv_kernel_size
    G = H // config.conv_group_size
    shapes = {}
    for i in range(config.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            p = f"layers.{i}.{conv}."
            shapes[p + "base_kernel"] = (2, K, H)
            shapes[p + "kernel_projection.weight"] = (2 * K * G, H)
    V, r = config.vocab_size, config.selector_rank
    shapes["candidate_selector.predecessor_codebook"] = (V, r)
    shapes["candidate_selector.successor_codebook"] = (V, r)
    shapes["candidate_selector.hidden_projection.weight"] = (r, H)
    return shapes


def dflash2_hints(config: DraftConfig) -> Dict[str, str]:
    """For each DFlash 2 tensor, the config keys its shape comes from (named in load errors)."""
    K, gs = config.conv_kernel_size, config.conv_group_size
    G = config.hidden_size // gs
    hints = {}
    for name in dflash2_shapes(config):
        if name.endswith("base_kernel"):
            hints[name] = f"dflash_config.conv_kernel_size is {K}"
        elif name.endswith("kernel_projection.weight"):
            hints[name] = (
                f"dflash_config.conv_kernel_size {K} and conv_group_size {gs} give 2*{K}*{G} rows; "
                "a different row count means the config's conv_group_size or conv_kernel_size is wrong"
            )
        elif name.endswith("codebook"):
            hints[name] = (
                f"every DFlash 2 checkpoint has the candidate selector's codebooks [vocab_size, "
                f"dflash_config.selector_rank {config.selector_rank}]; the download is incomplete or "
                "the folder is not a DFlash 2 draft"
            )
        else:
            hints[name] = f"dflash_config.selector_rank is {config.selector_rank}"
    return hints


def dflash2_defaults(hidden_size: int) -> Dict[str, int]:
    """Small DFlash 2 settings for fresh (random) drafts."""
    group = next(g for g in (16, 8, 4, 2, 1) if hidden_size % g == 0)
    return dict(conv_kernel_size=4, conv_group_size=group, selector_rank=16, selector_top_k=8)


def randomize_dflash2(model: DFlash2DraftModel, scale: float = 0.3):
    """Random conv taps around the pass-through start and random codebooks (mx.random's state)."""
    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = conv.base_kernel + scale * mx.random.normal(conv.base_kernel.shape)
    selector = model.candidate_selector
    selector.predecessor_codebook = mx.random.normal(selector.predecessor_codebook.shape)
    selector.successor_codebook = mx.random.normal(selector.successor_codebook.shape)
