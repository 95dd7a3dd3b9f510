"""A pipeline rank's taps carried on the hops the model already makes.

mlx-lm's pipeline forward (qwen3_moe, qwen3_5, qwen3_next, deepseek_v3, ...) embeds the tokens
on every rank, takes the shape of what it receives from the rank before it from those
embeddings (`recv_like(h)`), runs the layers it holds, sends their output on, and ends with
`all_gather(h)[: h.shape[0]]` (rank 0's rows: rank 0 holds the last layers) and `norm`: two
collectives a forward. The draft needs every rank's tapped layers. Rather than a collective of
their own, they ride on those two, appended along the batch axis for one forward (module swaps,
put back after; nothing patches mlx-lm):

  embedding     the B token rows, then n_taps x B tap rows and, when rank 0 has numbers to
                send, one rider row: zeros
  held layers   the first sets the carried rows aside and every layer runs on the B token
                rows (caches and masks see only them: mlx-lm builds masks from the caches
                and the sequence length, never the batch); the last appends the carried rows
                again with this rank's taps written in (one rank holds each layer, so each
                tap is written once) and, on rank 0, the rider values
  norm          norms the B token rows; the carried rows, as rank 0 sent them to every rank,
                are kept for the features

The hop and the gather then move (1 + n_taps) x B rows instead of B: the features cost bytes,
no trips. Where the draft's `fc` is handed in (`fuse`: linear, so the sum over ranks of each
rank's share of it is the whole product) the carry has 2 x B rows whatever n_taps is: one set of
rows holds the partial product, each rank adds its own taps' share, and what arrives is
fc(features), [B, S, H] (the draft's `fuse` takes it as already through fc). Bytes a hop per
token: (1 + n_taps) x H against 2 x H, so the draft hands fc in wherever n_taps > 1
(`DFlashDraftModel.fused_taps`). The rider row takes what rank 0 puts in `Rider.outbox` (its
cycle times: see `engine.distributed`) to every rank without a collective of its own.
A pipeline that hands its layers more than one hidden state (DeepSeek V4's streams, Kimi K3's
residual blocks) is refused at its first held layer, before any layer ran or any collective was
evaluated; the target then gathers its taps with an all_sum (`sharding.gather_features`).
"""

from contextlib import contextmanager
from typing import Any, Callable, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from dflash_mlx.models.target.sharding import rank_share
from dflash_mlx.models.target.stand_ins import StandIn, swaps


class CarryRefused(Exception):
    """The model's pipeline does not hand its layers one hidden state [rows, S, H]."""


class Carry:
    """One forward's carried rows: B token rows, `n_taps` x B tap rows (or B rows of fc's partial
    product, with `fuse`), `ride` rider values."""

    def __init__(self, batch: int, features: List[Optional[mx.array]], ride: List[float], rank: int,
                 fuse: Optional[Callable[[mx.array], mx.array]] = None):
        self.batch, self.features, self.ride, self.rank = batch, features, ride, rank
        self.fuse = fuse if features else None
        self.feature_rows = (1 if self.fuse is not None else len(features)) * batch
        self.rows = batch + self.feature_rows + (1 if ride else 0)
        self.aside: Optional[mx.array] = None  # the carried rows while this rank's layers run
        self.arrived: Optional[mx.array] = None  # the carried rows rank 0 sent every rank

    def pad(self, embedded: mx.array) -> mx.array:
        _, s, h = embedded.shape
        return mx.concatenate([embedded, mx.zeros((self.rows - self.batch, s, h), embedded.dtype)], axis=0)

    def set_aside(self, x) -> mx.array:
        if not isinstance(x, mx.array) or x.ndim != 3 or x.shape[0] != self.rows:
            raise CarryRefused
        self.aside = x[self.batch :]
        return x[: self.batch]

    def append(self, out: mx.array) -> mx.array:
        """`out` [B, S, H] with the carried rows after it, this rank's taps (or their share of fc)
        and rider written in."""
        b = self.batch
        if self.fuse is None:
            parts = [f if f is not None else self.aside[i * b : (i + 1) * b] for i, f in enumerate(self.features)]
        else:
            parts = [self.aside[:b]]
            if any(f is not None for f in self.features):  # a rank holding no tap passes the sum on
                parts = [parts[0] + rank_share(self.features, out, self.fuse)]
        if self.ride:
            if self.rank == 0:  # the last stage: its row is the one every rank gets
                _, s, h = out.shape
                values = mx.array(self.ride + [0.0] * (s * h - len(self.ride)), dtype=out.dtype)
                parts.append(values.reshape(1, s, h))
            else:
                parts.append(self.aside[self.feature_rows :])
        return mx.concatenate([out] + parts, axis=0)

    def take(self, x: mx.array) -> mx.array:
        if x.shape[0] != self.rows:
            raise RuntimeError(f"the pipeline's gathered state has {x.shape[0]} rows, not the {self.rows} carried")
        self.arrived = x[self.batch :]
        return x[: self.batch]

    def tap_features(self) -> Optional[mx.array]:
        """The draft's features as rank 0 received them: [B, S, n*H] (every tap filled), or
        [B, S, H] already through fc (with `fuse`)."""
        b, n = self.batch, len(self.features)
        if not n:
            return None
        if self.fuse is not None:
            return self.arrived[:b]
        return mx.concatenate([self.arrived[i * b : (i + 1) * b] for i in range(n)], axis=-1)

    def rider_values(self) -> Optional[mx.array]:
        """Rank 0's rider values [len(ride)], or None when none rode."""
        if not self.ride:
            return None
        return self.arrived[-1].reshape(-1)[: len(self.ride)]


def _plain(value) -> bool:
    """An argument a layer may take beside its hidden state when the pipeline carries: a mask,
    a cache, a number or nothing (not a second state that would need its own rows)."""
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (mx.array, _BaseCache, int, float, bool, str))


class _Embedding(StandIn):
    def __init__(self, module, carry: Carry):
        self._wrapped, self._carry = module, carry

    def __call__(self, *args, **kwargs):
        return self._carry.pad(self._wrapped(*args, **kwargs))


class _HeldLayer(StandIn):
    """One of this rank's layers: the first sets the carried rows aside, the last appends them."""

    def __init__(self, layer, carry: Carry, first: bool, last: bool):
        self._wrapped, self._carry, self._first, self._last = layer, carry, first, last

    def __call__(self, x, *args, **kwargs):
        if self._first:
            if not _plain(list(args) + list(kwargs.values())):
                raise CarryRefused
            x = self._carry.set_aside(x)
        out = self._wrapped(x, *args, **kwargs)
        if not self._last:
            return out
        if isinstance(out, tuple):
            return (self._carry.append(out[0]),) + out[1:]
        return self._carry.append(out)


class _Norm(StandIn):
    def __init__(self, module, carry: Carry):
        self._wrapped, self._carry = module, carry

    def __call__(self, x, *args, **kwargs):
        return self._wrapped(self._carry.take(x), *args, **kwargs)


def can_carry(text_model, embedding_name: Optional[str]) -> bool:
    """Whether the text model has the parts a carry swaps: its embedding and its final `norm`."""
    return embedding_name is not None and "norm" in text_model


@contextmanager
def carried(text_model, embedding_name: str, layers: List[Any], carry: Carry):
    """The swaps of one carried pipeline forward (after `taps.taps`: these wrap its stand-ins)."""
    held = [i for i, layer in enumerate(layers) if layer is not None]
    with swaps() as put:
        put(text_model, embedding_name, _Embedding(text_model[embedding_name], carry))
        put(text_model, "norm", _Norm(text_model["norm"], carry))
        for i in held:
            put(layers, i, _HeldLayer(layers[i], carry, first=i == held[0], last=i == held[-1]))
        yield carry
