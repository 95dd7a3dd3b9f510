"""A target split over several processes (`mlx.launch`): how it is split, as mlx-lm split it.

mlx-lm splits a model two ways (`mlx_lm.utils.sharded_load`):

  tensor parallel     `Model.shard(group)`: every rank holds every layer, each a slice of the
                      heads and experts; a layer's output is summed over the ranks, so every
                      rank sees the whole hidden state (the draft's features need nothing);
                      some models split the LM head by vocabulary (`head_group`: gathered)
  pipeline parallel   `model.model.pipeline(group)`: rank r holds a run of the layers (rank 0
                      the last), the others are None; the hidden state hops rank to rank and
                      is gathered at the end, so every rank computes the same logits. A rank
                      taps only the layers it holds; the taps ride on the model's own hop and
                      gather (`pipeline_carry`), or, where its pipeline cannot carry them, an
                      all_sum adds what each rank tapped (`gather_features`)

`sharding_of` reads which from the model itself, so a model sharded by mlx-lm's own loader
works as one sharded by `dflash_mlx.models.sharded`.

One stream for a split's collectives (`split_stream`, `settle`): MLX runs each stream's work on
a thread of its own, and a split's collectives in flight on two streams at once go through the
same connections between the ranks, each reading bytes of the other's messages: both ranks then
compute with garbage. mlx-lm's `generate_step` (the split model's own decoding) returns with its
next step's forward still running on `generation_stream`, so a forward of the same model started
from the default stream right after it met it (features and logits off on both ranks, measured
on every split on 2 ranks). A split target's forwards and gathered heads run on
`generation_stream`, as mlx-lm's decoding and the engine's cycles do; a collective of our own on
the CPU's stream (rank 0's numbers, as mlx-lm's server shares its requests) first waits for it.
"""

from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass(eq=False)
class Rider:
    """Numbers rank 0 sends every rank on a forward's own collectives (a pipeline's hops,
    `pipeline_carry`; a tensor split's layer sum, `tensor_ride`):
    `outbox`, the values waiting to go (rank 0's; zeros on the others, the same count on every
    rank); `inbox`, what each carried forward brought, rank 0's values [n], in order;
    `waiting`, who learns each value once it arrived (`engine.distributed`), in the same order."""

    outbox: List[float] = field(default_factory=list)
    inbox: List[mx.array] = field(default_factory=list)
    waiting: Deque[Callable[[float], None]] = field(default_factory=deque)


@dataclass(eq=False)
class Sharding:
    """kind: "tensor" | "pipeline"; group: the collective group; layer_offset: the global id of
    the rank's first layer (its cache 0); num_layers: the whole model's layer count; rider:
    what rank 0 sends on the forward's own collectives."""

    kind: str
    group: object
    layer_offset: int = 0
    num_layers: Optional[int] = None
    rider: Rider = field(default_factory=Rider)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()


def split_stream(split: bool):
    """For the call, with `split`: a split target's work on mlx-lm's `generation_stream` (its
    collectives after those queued there before, never beside them); without, nothing changes
    (a `nullcontext`: every forward asks, split or not)."""
    if not split:
        return nullcontext()
    from mlx_lm.generate import generation_stream

    return mx.stream(generation_stream)


def settle() -> None:
    """Wait for what is queued on mlx-lm's `generation_stream` (a split forward's collectives),
    before a collective on another stream."""
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)


def on_every_rank(sharding: Optional["Sharding"], flags: Sequence[bool]) -> List[bool]:
    """Each flag as it holds on every rank of a split (one small all_sum on the CPU's stream),
    or as given for a target whole in one process. What a rank finds from the layers it holds
    (its caches' kinds, a probe forward) differs between a pipeline's ranks; a choice made from
    it must be the same on every rank, or their collectives stop matching."""
    if sharding is None:
        return [bool(f) for f in flags]
    settle()
    local = mx.array([int(bool(f)) for f in flags], dtype=mx.int32)
    total = mx.distributed.all_sum(local, group=sharding.group, stream=mx.cpu).tolist()
    return [t == sharding.size for t in total]


def agreed_reason(sharding: Optional["Sharding"], reason: Optional[str]) -> Optional[str]:
    """A refusal found on one rank of a split holds on every rank: None only where no rank found
    one; else this rank's own line, or the line of the first rank that found one, named (rank 0
    speaks for the split, and may hold none of the layers that cause it). One small all_sum
    (each rank's line length), and one more of that rank's bytes where some rank found one."""
    if sharding is None:
        return reason
    settle()
    data = b"" if reason is None else reason.encode()
    lengths = [0] * sharding.size
    lengths[sharding.rank] = len(data) + (reason is not None)  # 0: none found here
    lengths = mx.distributed.all_sum(mx.array(lengths, dtype=mx.int32), group=sharding.group, stream=mx.cpu).tolist()
    first = next((r for r, n in enumerate(lengths) if n > 0), None)
    if first is None:
        return None
    size = lengths[first] - 1
    text = bytes_from(sharding.group, first, data, size).decode("utf-8", "replace") if size else ""
    return reason if reason is not None else f"{text} (found by process {first} of the split)"


def bytes_from(group, source: int, data: bytes, size: int) -> bytes:
    """Rank `source`'s `size` bytes `data` on every rank of `group` (`data` elsewhere is ignored):
    one all_sum on the CPU's stream, the other ranks adding zeros. The caller has settled."""
    sent = np.frombuffer(data, np.uint8) if group.rank() == source else np.zeros(size, np.uint8)
    return np.array(mx.distributed.all_sum(mx.array(sent), group=group, stream=mx.cpu)).astype(np.uint8).tobytes()


def smallest_on_any_rank(sharding: Optional["Sharding"], value: Optional[int]) -> Optional[int]:
    """The smallest of the ranks' positive `value`s (None where no rank has one): a limit one
    rank's layers set holds for every rank."""
    if sharding is None:
        return value
    settle()
    local = mx.array([int(value or 0)], dtype=mx.int32)
    values = [v for v in mx.distributed.all_gather(local, group=sharding.group, stream=mx.cpu).tolist() if v > 0]
    return min(values) if values else None


def own_layers_caches(cache: list, text_model, sharding: Optional["Sharding"]) -> list:
    """`cache` (mlx-lm's for the model), less the entries of the layers other pipeline ranks hold.

    mlx-lm's multimodal wrappers (Kimi-VL, Mistral 3, the Qwen-VLs) make a pipeline rank a cache for
    every entry of the layer list up to its last, the other ranks' (None) too. The text model pairs
    its own layers with the list's first caches and makes its hop wait on the last, which then
    never fills: on a middle rank of three `mx.depends(None, h)` raises, and the other ranks wait
    for its message for ever. The rank's own layers' caches, as the text models make them, put
    the last of them last."""
    if sharding is None or sharding.kind != "pipeline":
        return cache
    own = getattr(text_model, "pipeline_layers", None)
    if own is not None and len(cache) == sharding.layer_offset + len(own):
        return cache[sharding.layer_offset:]
    return cache


def _tensor_group(model) -> Optional[object]:
    """The group of the first module `Model.shard` left a group on, or None."""
    for _, module in model.named_modules():
        for name in ("group", "sharding_group"):
            g = getattr(module, name, None)
            if isinstance(g, mx.distributed.Group) and g.size() > 1:
                return g
    return None


def sharding_of(model, text_model, args) -> Optional[Sharding]:
    """How `model` is split over processes, or None for a model whole in this process."""
    if getattr(text_model, "pipeline_size", 1) > 1:
        total = getattr(args, "num_hidden_layers", None) or getattr(text_model, "num_hidden_layers", None)
        return Sharding("pipeline", mx.distributed.init(), int(text_model.start_idx), total)
    group = _tensor_group(model)
    return Sharding("tensor", group) if group is not None else None


def head_group(lm_head) -> Optional[object]:
    """The group an LM head split by vocabulary rows is split over (mlx-lm's
    `shard_linear(..., "all-to-sharded")`), or None for a whole head."""
    split = (nn.layers.distributed.AllToShardedLinear, nn.layers.distributed.QuantizedAllToShardedLinear)
    return lm_head.group if isinstance(lm_head, split) else None


def gather_vocab(out: mx.array, group) -> mx.array:
    """The whole vocabulary's logits from each rank's slice (rank order along the last axis)."""
    n, size = group.size(), out.shape[-1]
    parts = mx.distributed.all_gather(out.reshape(-1, size), group=group)
    return parts.reshape(n, -1, size).transpose(1, 0, 2).reshape(*out.shape[:-1], n * size)


def rank_share(features: List[Optional[mx.array]], like: mx.array,
               fuse: Optional[Callable[[mx.array], mx.array]] = None) -> mx.array:
    """This pipeline rank's part of the draft's features: its taps, zeros for the taps of layers
    other ranks hold, [B, S, n*H]; with `fuse` (the draft's linear fc) that through fc, [B, S, H].
    Summed over the ranks it is the whole (one rank holds each layer), exactly without `fuse`."""
    local = mx.concatenate([f if f is not None else mx.zeros_like(like) for f in features], axis=-1)
    return fuse(local).astype(like.dtype) if fuse is not None else local


def gather_features(features: List[Optional[mx.array]], h: mx.array, sharding: Sharding,
                    fuse: Optional[Callable[[mx.array], mx.array]] = None) -> mx.array:
    """The draft's features on every pipeline rank: the all_sum of each rank's share
    (`rank_share`; with `fuse`, n times fewer bytes). The sum waits on `h` (whose gather ends the
    forward) so every rank runs its collectives in the same order."""
    return mx.distributed.all_sum(mx.depends(rank_share(features, h, fuse), h), group=sharding.group)
