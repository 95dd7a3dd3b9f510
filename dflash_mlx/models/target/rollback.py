"""Rolling a target's caches back after a partial accept: one function per cache kind.

- attention caches (KV, rotating windows, latent attention, lists of them): `rollback_cache`;
- Qwen3.5/3.6 Gated DeltaNet: taped during verify (`TapedGatedDeltaNet`), rewound from the tape
  without running the layer again (`replay_gdn`);
- any other recurrent state (Mamba, Qwen3-Next's DeltaNet, short convs, RWKV, a `CacheList`
  holding one): the layer's verify call is recorded (`ReplayTap`), its state restored and the
  layer run again on the kept positions (`replay_layer`). State beside attention in one
  `CacheList` (Falcon-H1) is also recorded by the module the layer hands it to: that module
  alone runs again, and the attention beside it is trimmed (`recorded_apart`).

`rollback_kind` says which applies to a cache; `target.Target` swaps the taps in for a verify
forward and calls these after it.
"""

import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, BatchRotatingKVCache, CacheList, RotatingKVCache, _BaseCache

from dflash_mlx.kernels import gdn
from dflash_mlx.models.target.rerun import can_rerun
from dflash_mlx.models.target.stand_ins import StandIn


class UnsupportedTargetError(ValueError):
    pass


@dataclass
class GDNTape:
    """What one Gated DeltaNet layer keeps from a verify forward so that a partial
    accept rebuilds its cache from the accepted steps alone (no second forward)."""

    conv_input: mx.array  # [B, K-1+S, C]: the conv state before verify, then the S new conv inputs
    state: mx.array  # [B, Hv, Dv, Dk] recurrent state before verify
    q: mx.array  # [B, S, Hk, Dk] the recurrence's inputs: normalized queries and keys,
    k: mx.array
    v: mx.array  # [B, S, Hv, Dv] values,
    g: mx.array  # [B, S, Hv] (or [B, S, Hv, Dk]) per-step decay,
    beta: mx.array  # [B, S, Hv] write strength
    deltas: Optional[mx.array]  # [B, S, Hv, Dv] float32 per-step updates (v_t - S k_t) * beta_t, if computed


@dataclass
class LayerReplay:
    """A decoder layer's verify call, kept so a partial accept can rebuild a cache that
    cannot be trimmed: the layer, the arguments it got and the states it started from."""

    layer: Any
    args: tuple
    kwargs: dict
    cache: Any  # the cache the layer got (an ArraysCache, or a CacheList holding one)
    start: List[Any]  # per (sub-)cache before verify: ArraysCache contents, a window's state, None: trims


@dataclass
class VerifyRecord:
    """What a verify forward keeps so recurrent layers can be rewound: gdn[cache index] = GDNTape
    (Qwen3.5 Gated DeltaNet), replay[id(cache)] = LayerReplay (any other), rerun (`rerun.Rerun`)."""

    gdn: Dict[int, GDNTape] = field(default_factory=dict)
    replay: Dict[int, LayerReplay] = field(default_factory=dict)
    rerun: Any = None


def sub_caches(c) -> list:
    return list(c.caches) if isinstance(c, CacheList) else [c]


def recorded_apart(c, record: Optional["VerifyRecord"]) -> bool:
    """Whether a `CacheList`'s recurrent parts were recorded by the modules they were handed
    to: then each is replayed alone and its attention parts trimmed, instead of the layer
    running again whole."""
    if record is None or not isinstance(c, CacheList):
        return False
    recurrent = [s for s in c.caches if isinstance(s, ArraysCache)]
    return bool(recurrent) and all(id(s) in record.replay for s in recurrent)


def rollback_kind(c) -> Optional[str]:
    """How a cache is rolled back after a partial accept: "trim" (attention KV, rotating
    windows, lists of them), "replay" (holds recurrent state: restore it, re-run the layer
    on the kept tokens), "rerun" (`rerun.can_rerun`: restore it, re-run the text model), or None."""
    if isinstance(c, CacheList):
        kinds = [rollback_kind(s) for s in c.caches]
        if None in kinds:
            return None
        return "replay" if "replay" in kinds else "trim"
    if isinstance(c, ArraysCache):
        return "replay"
    if isinstance(c, RotatingKVCache) or (callable(getattr(c, "trim", None)) and hasattr(c, "offset")):
        return "trim"
    return "rerun" if can_rerun(c) else None


def _cache_argument(args, kwargs):
    c = kwargs.get("cache")
    if isinstance(c, _BaseCache):
        return c
    return next((a for a in args if isinstance(a, _BaseCache)), None)


class ReplayTap(StandIn):
    """Stands in for one decoder layer during verify: when the layer gets one of the
    caches in `watched` (recurrent state that cannot be trimmed), its call is recorded."""

    def __init__(self, layer, watched: Dict[int, Any], sink):
        self._wrapped = layer
        self._watched = watched
        self._sink = sink

    def __call__(self, *args, **kwargs):
        c = _cache_argument(args, kwargs)
        if c is not None and id(c) in self._watched:
            start = [_before_verify(s) for s in sub_caches(c)]
            self._sink(LayerReplay(self._wrapped, args, kwargs, c, start))
        return self._wrapped(*args, **kwargs)


class TapedGatedDeltaNet(StandIn):
    """Stands in for a Qwen3.5 `GatedDeltaNet` token mixer during verify.

    The same computation as mlx-lm's module for an unpadded batch, except that
    the recurrence is `gdn.gdn_verify` (which also returns the per-step
    deltas where that is free), and the tape is handed to `sink`.
    """

    def __init__(self, mixer, sink):
        self._wrapped = mixer
        self._sink = sink

    def __call__(self, inputs: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        from mlx_lm.models.gated_delta import compute_g, normalize_qk  # only hybrid targets need it

        m = self._wrapped
        if mask is not None or cache is None or getattr(cache, "lengths", None) is not None:
            raise UnsupportedTargetError("verify with a taped Gated DeltaNet needs an unpadded batch and a cache")
        B, S, _ = inputs.shape
        qkv = m.in_proj_qkv(inputs)
        z = m.in_proj_z(inputs).reshape(B, S, m.num_v_heads, m.head_v_dim)
        beta = mx.sigmoid(m.in_proj_b(inputs))
        g = compute_g(m.A_log, m.in_proj_a(inputs), m.dt_bias)
        conv_state = cache[0]
        if conv_state is None:
            conv_state = mx.zeros((B, m.conv_kernel_size - 1, m.conv_dim), dtype=inputs.dtype)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        cache[0] = mx.contiguous(conv_input[:, -(m.conv_kernel_size - 1):, :])
        conv_out = nn.silu(m.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [m.key_dim, 2 * m.key_dim], -1),
                [m.num_k_heads, m.num_k_heads, m.num_v_heads],
                [m.head_k_dim, m.head_k_dim, m.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=m.head_k_dim**-0.5, eps=1e-6)
        state = cache[1]
        if state is None:
            state = mx.zeros((B, m.num_v_heads, m.head_v_dim, m.head_k_dim), dtype=mx.float32)
        out, cache[1], deltas = gdn.gdn_verify(q, k, v, g, beta, state)
        cache.advance(S)
        self._sink(GDNTape(conv_input, state, q, k, v, g, beta, deltas))
        out = m.out_proj(m.norm(out, z).reshape(B, S, -1))
        if getattr(m, "sharding_group", None) is not None:  # tensor parallel: each rank's heads, summed
            out = mx.distributed.all_sum(out, group=m.sharding_group)
        return out


def gdn_class():
    from mlx_lm.models.qwen3_5 import GatedDeltaNet  # TapedGatedDeltaNet is a port of exactly this module

    return GatedDeltaNet


def rollback_cache(c, n: int):
    """Drop the last `n` entries of an attention cache (or of each cache in a CacheList)."""
    if isinstance(c, CacheList):
        for sub in c.caches:
            rollback_cache(sub, n)
    elif isinstance(c, RotatingKVCache):
        rollback_rotating(c, n)
    else:
        c.trim(n)


def rollback_batch_rows(c, rejected: Sequence[int]):
    """Drop the last `rejected[b]` entries of row b of a batch of attention caches
    (`BatchKVCache`, or `BatchRotatingKVCache` after a verify of two or more tokens).

    Rows share one write index, so what all rows rejected is trimmed, and a row that
    rejected more moves its entries right by the difference: the dropped ones wrap
    into its left padding, which grows by as much (and is masked, as mlx-lm masks a
    left-padded prompt). Nothing stays visible that a row rejected, and no row attends
    to a hole."""
    common = min(rejected)
    if common:
        c.trim(common)
        if isinstance(c, BatchRotatingKVCache):
            # trim only moves the write index; a later one-token write would rotate the
            # trimmed tail into the window, so it goes (as `rollback_rotating` does)
            c.keys = c.keys[..., : c._idx, :]
            c.values = c.values[..., : c._idx, :]
    extra = [r - common for r in rejected]
    if not any(extra):
        return
    end = c._idx
    keys, values = c.keys[..., :end, :], c.values[..., :end, :]
    for b, shift in enumerate(extra):
        if shift:
            c.keys[b : b + 1, :, shift:end, :] = keys[b : b + 1, :, : end - shift, :]
            c.values[b : b + 1, :, shift:end, :] = values[b : b + 1, :, : end - shift, :]
    shifts = mx.array(extra)
    # A window's row that has dropped entries off its front has a negative left padding
    # (all it holds is valid); its wrapped entries start at index 0 all the same.
    c.left_padding = mx.maximum(c.left_padding, 0) + shifts
    c.offset = c.offset - shifts


def in_temporal_order(c):
    """Before a verify of two or more tokens: mlx-lm's batch window writes one token in
    place (its ring may wrap) but computes a longer input's mask for a buffer in temporal
    order, so one is put in that order first (a no-op when it is)."""
    if isinstance(c, BatchRotatingKVCache) and c.rotated:
        c._temporal_order()


def rollback_rotating(c: RotatingKVCache, n: int):
    if c._idx != c.keys.shape[2]:
        raise RuntimeError(
            "RotatingKVCache rollback expects the buffer left by a multi-token update; "
            "verify feeds at least two tokens whenever there is something to reject"
        )
    c.keys = c.keys[..., : c._idx - n, :]
    c.values = c.values[..., : c._idx - n, :]
    c.offset -= n
    c._idx -= n


def replay_gdn(c: ArraysCache, tape: GDNTape, keep: int):
    """Set a Gated DeltaNet cache to what feeding only the first `keep` verify tokens gives.

    Conv state: the last K-1 conv inputs up to the kept ones. Recurrent state:
    the pre-verify state advanced by the first `keep` taped steps (no layer runs).
    """
    n_conv = tape.conv_input.shape[1] - tape.k.shape[1]  # K - 1
    c[0] = mx.contiguous(tape.conv_input[:, keep : keep + n_conv])
    c[1] = gdn.gdn_rewind(tape.state, tape.q, tape.k, tape.v, tape.g, tape.beta, tape.deltas, keep)


def replay_gdn_rows(c: ArraysCache, tape: GDNTape, keep: Sequence[int]):
    """`replay_gdn` for a batch whose row b keeps its first `keep[b]` verify tokens."""
    n_conv = tape.conv_input.shape[1] - tape.k.shape[1]  # K - 1
    steps = tape.k.shape[1]
    if all(k == steps for k in keep):
        return  # every row kept everything: the cache is what the verify left
    c[0] = mx.concatenate([tape.conv_input[b : b + 1, k : k + n_conv] for b, k in enumerate(keep)], axis=0)
    c[1] = mx.concatenate([
        c[1][b : b + 1] if k == steps else gdn.gdn_rewind(
            tape.state[b : b + 1], tape.q[b : b + 1], tape.k[b : b + 1], tape.v[b : b + 1], tape.g[b : b + 1],
            tape.beta[b : b + 1], None if tape.deltas is None else tape.deltas[b : b + 1], k)
        for b, k in enumerate(keep)], axis=0)


def replay_layer_rows(entry: LayerReplay, num_tokens: int, keep: Sequence[int]):
    """`replay_layer` for a batch whose row b keeps its first `keep[b]` verify tokens (its
    cache an `ArraysCache` of B rows): rows that kept the same number re-run together from
    their pre-verify states, on their own rows of the recorded inputs; rows that kept
    everything keep what the verify left."""
    c = entry.cache
    rows = len(keep)
    if all(k == num_tokens for k in keep):
        return
    after = list(c.cache)
    start = entry.start[0]
    names = _parameter_names(entry.layer)
    per_row: List[Optional[List[Any]]] = [None] * rows
    for k in sorted(set(keep)):
        if k == num_tokens:
            continue
        idx = [b for b in range(rows) if keep[b] == k]
        sel = mx.array(idx)
        group = ArraysCache(len(start))
        group.cache = [s[sel] if s is not None else None for s in start]
        if k > 0:
            def cut(value, name):
                if value is c:
                    return group
                if isinstance(value, mx.array) and value.ndim >= 1 and value.shape[0] == rows and rows > 1:
                    value = value[sel]
                return _kept_input(value, name, num_tokens, k)

            args = [cut(a, names[i] if i < len(names) else "") for i, a in enumerate(entry.args)]
            kwargs = {n: cut(v, n) for n, v in entry.kwargs.items()}
            entry.layer(*args, **kwargs)
        for j, b in enumerate(idx):
            per_row[b] = [s[j : j + 1] if s is not None else None for s in group.cache]
    c.cache = [
        None if a is None else mx.concatenate(
            [a[b : b + 1] if per_row[b] is None else per_row[b][e] for b in range(rows)], axis=0)
        for e, a in enumerate(after)
    ]


_SIGNATURES: Dict[type, List[str]] = {}


def _parameter_names(layer) -> List[str]:
    cls = type(layer)
    if cls not in _SIGNATURES:
        params = inspect.signature(cls.__call__).parameters
        _SIGNATURES[cls] = [n for n in params if n != "self"]
    return _SIGNATURES[cls]


def _kept_input(value, name: str, num_tokens: int, keep: int):
    """One argument of a recorded layer call cut to the first `keep` of `num_tokens` positions.

    Masks (parameters named *mask*): an attention mask [..., S, K] keeps the kept queries and
    the keys before the rejected ones (the cache's new keys come last); a per-step mask
    [B, S] keeps the kept steps. Other arrays with the sequence on axis 1 (hidden states,
    per-layer inputs, positions) keep the kept positions; everything else is passed as is."""
    if not isinstance(value, mx.array) or value.ndim < 2:
        return value
    S, drop = num_tokens, num_tokens - keep
    if "mask" in name:
        if value.shape[-2] == S:
            return value[..., :keep, : value.shape[-1] - drop]
        if value.shape[-1] == S:
            return value[..., :keep]
        return value
    if value.shape[1] == S:
        return value[:, :keep]
    return value


def _before_verify(sub):
    """What `replay_layer` restores a part of a recorded layer's cache to. A sliding window
    (Baichuan-M1's, beside its conv state) keeps its own state: trimmed by the whole verify it
    would hold fewer entries than its window past it, which mlx-lm's one-token update
    cannot take when the layer runs again on one kept token."""
    if isinstance(sub, ArraysCache):
        return list(sub.cache)
    return sub.state if isinstance(sub, RotatingKVCache) else None


def replay_layer(entry: LayerReplay, num_tokens: int, keep: int):
    """Set a layer's cache to what feeding only the first `keep` of the `num_tokens` verify
    tokens gives: every part goes back to its pre-verify state (recurrent arrays and windows
    restored, other attention entries trimmed) and the layer runs again on the kept positions'
    inputs, which a causal model computed exactly as a forward of the kept tokens alone would."""
    for sub, start in zip(sub_caches(entry.cache), entry.start):
        if isinstance(sub, ArraysCache):
            sub.cache = list(start)
        elif start is not None:
            sub.state = start
        else:
            rollback_cache(sub, num_tokens)
    names = _parameter_names(entry.layer)
    args = [_kept_input(a, names[i] if i < len(names) else "", num_tokens, keep) for i, a in enumerate(entry.args)]
    kwargs = {k: _kept_input(v, k, num_tokens, keep) for k, v in entry.kwargs.items()}
    entry.layer(*args, **kwargs)
