"""Verify-time module swaps: what a `Target.forward` puts in place of the model's own modules.

Nothing here patches mlx-lm classes. During one forward the entries of the
model's own `layers` list (and modules inside them) are swapped for thin
stand-ins, and put back in a `finally`; the model's own forward (masks, sliding
windows, shared KV, embedding scales) runs unchanged around them:

  tapped layers       hand their output to the draft's features (`_LayerTap`)
  Gated DeltaNet      runs taped, so a rollback replays it (`TapedGatedDeltaNet`)
  other recurrence    its layer is recorded, so a rollback re-runs it (`ReplayTap`)
  quantized linears   go through a small-M kernel at verify widths (`_SmallMQuantizedLinear`)
  bias-free linears   go through CUDA's gemv_rows at verify widths, where it is on (`_SmallMLinear`)
  rotary embeddings   take a token tree's positions (`TreeRoPE`)
  an inner LM head    passes the final hidden states through (`inner_head`)
  every decoder layer queues the graph so far while the host builds the rest (`submit_layers`)
"""

from contextlib import contextmanager
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, CacheList

from dflash_mlx.kernels import gemv, qmm
from dflash_mlx.models.target.rollback import ReplayTap, TapedGatedDeltaNet, VerifyRecord
from dflash_mlx.models.target.stand_ins import StandIn, swaps
from dflash_mlx.models.target.tree_attention import TreeRoPE


class _LayerTap(StandIn):
    """Stands in for one decoder layer during a forward and hands its output to `after` (None:
    nobody); with `submit`, queues the graph that made it (`submit_layers`)."""

    def __init__(self, layer, after, submit: bool = False):
        self._wrapped = layer
        self._after = after
        self._submit = submit

    def __call__(self, *args, **kwargs):
        out = self._wrapped(*args, **kwargs)
        if self._after is not None:
            self._after(out)
        if self._submit:
            first = out[0] if isinstance(out, tuple) else out
            if isinstance(first, mx.array):
                mx.async_eval(first)
        return out


# Building a forward's graph is host work (~0.1 ms a layer of mlx-lm's models on MLX's CPU backend,
# where `mx.async_eval` also hands the device its nodes one by one). A cycle's verify, or a step the
# host reads before it queues the next, is built after the host read the cycle before: queued whole,
# the device would wait for the whole build. Queued every `SUBMIT_EVERY` layers (0: whole), the
# first layers run while the host builds the rest. MLX fuses kernels only under `mx.compile`, so
# where a graph is cut changes no value. Oracle probe on a 24-layer hidden-64 target whose compute
# is nil (CPU, float32, 2026-12-06, `benchmarks/results/20261206-engine-overhead-graph-pieces-24-layers`):
# a width-16 cycle 13.0 ms against 18.1 queued whole, width 1 9.6 against 12.7. On a GPU each queue
# commits a command buffer: the GPU check (`benchmarks/gpu`) times a layer a piece against the graph
# whole (parts c and d) and every 4 layers (c).
SUBMIT_EVERY = 1


def submit_layers(target) -> frozenset:
    """The layers after which a forward queues its graph so far: every `SUBMIT_EVERY`-th, not the last
    (the final norm and head follow at once). None on a split target (its ranks evaluate their sends
    and receives together) or one whose layers are never called whole (`tap_inputs`)."""
    n = len(target.layers)
    if target.sharding is not None or target.tap_inputs or not SUBMIT_EVERY:
        return frozenset()
    return frozenset(range(SUBMIT_EVERY - 1, n - 1, SUBMIT_EVERY))


class _InputTap(StandIn):
    """Stands in for a layer's input norm during a forward and hands what it is given to `after`
    (each call: a model that runs its layers twice, as IQuest's loop coder does, gives the last)."""

    def __init__(self, norm, after):
        self._wrapped = norm
        self._after = after

    def __call__(self, x, *args, **kwargs):
        self._after(x)
        return self._wrapped(x, *args, **kwargs)


def layer_hidden(out, rows: Tuple[int, int]) -> mx.array:
    """The hidden state a decoder layer's output gives the draft, [B, S, H] (`rows`: B, S): the
    output, the first of a tuple (layers that also return a cache or a mix), or the first of
    stacked residual streams, [n, B, S, H] (Gemma 3n's AltUp: the stream its layers predict from
    and correct) or [B, S, n, H] (DeepSeek V4.1's hyper-connections). Any other shape is passed
    on, and `probe` refuses the model naming it."""
    out = out[0] if isinstance(out, tuple) else out
    if out.ndim == 4 and tuple(out.shape[1:3]) == tuple(rows):
        return out[0]
    if out.ndim == 4 and tuple(out.shape[:2]) == tuple(rows):
        return out[:, :, 0]
    return out


def modules_of(module, kinds) -> List[Tuple[Any, Any, Any]]:
    """(parent, key, child) for every module of the classes `kinds` under `module`, in the
    order the model holds them (parent: Module or list; not searched inside a found one)."""
    found = []

    def walk(parent, items):
        for key, child in items:
            if isinstance(child, kinds):
                found.append((parent, key, child))
            elif isinstance(child, nn.Module):
                walk(child, child.items())
            elif isinstance(child, list):
                walk(child, enumerate(child))

    walk(module, module.items())
    return found


def quantized_linears(module) -> List[Tuple[Any, Any, nn.QuantizedLinear]]:
    """(parent, key, layer) for every affine QuantizedLinear under `module` (parent: Module or list)."""
    return [x for x in modules_of(module, nn.QuantizedLinear) if getattr(x[2], "mode", "affine") == "affine"]


def dense_linears(module) -> List[Tuple[Any, Any, nn.Linear]]:
    """(parent, key, layer) for every bias-free nn.Linear itself (no subclass) under `module`."""
    return [x for x in modules_of(module, nn.Linear) if type(x[2]) is nn.Linear and "bias" not in x[2]]


class _SmallMLinear(StandIn):
    """Stands in for one bias-free nn.Linear during a verify forward: `gemv.linear`."""

    def __init__(self, layer):
        self._wrapped = layer

    def __call__(self, x):
        return gemv.linear(self._wrapped, x)


class _SmallMQuantizedLinear(StandIn):
    """Stands in for one QuantizedLinear during a verify forward: `qmm.quantized_linear`."""

    def __init__(self, layer):
        self._wrapped = layer

    def __call__(self, x):
        return qmm.quantized_linear(self._wrapped, x)


def use_small_m(target, tokens: mx.array, record: bool) -> frozenset:
    """Which of the target's projections a forward of `tokens` [B, S] runs through a small-M kernel
    ("quantized", "dense"; empty: none): those a kernel on this backend takes at B*S rows, where the
    forward's rows stand for one-token steps (a verify, `record`; a batched step, S = 1). A prompt's
    chunk does not, and runs MLX's own products as mlx-lm's prefill does."""
    if not (record or tokens.shape[1] == 1):
        return frozenset()
    width = tokens.size
    kinds = set()
    if target._quantized and qmm.custom_width(width):
        kinds.add("quantized")
    if target._dense and gemv.custom_width(width):
        kinds.add("dense")
    return frozenset(kinds)


@contextmanager
def taps(target, layer_ids: Sequence[int], features: List, record: Optional[VerifyRecord], small_m: frozenset,
         cache: List[Any], tree=None, rows: Tuple[int, int] = (1, 1)):
    """The swaps of one `target.forward` of `rows` (B, S) tokens: layers `layer_ids` write their
    outputs into `features`; with `record`, the recurrent layers record what a rollback needs; with
    `small_m`, those kinds of projections go through their kernel; with `tree`, the rotary
    embeddings take the tree's positions. Everything is put back on exit."""
    layers = target.layers
    slot: Dict[int, List[int]] = {}
    for i, lid in enumerate(layer_ids):  # an id may repeat (small targets)
        if lid < len(layers) and layers[lid] is not None:  # a pipeline rank taps the layers it holds
            slot.setdefault(lid, []).append(i)

    def keep_output(idx):
        def after(out):
            for i in slot.get(idx, ()):
                features[i] = layer_hidden(out, rows)

        return after

    def make_sink(idx):
        def sink(tape):
            record.gdn[idx] = tape

        return sink

    def keep_replay(entry):
        record.replay[id(entry.cache)] = entry

    with swaps() as put:
        if record is not None:
            for idx in target._gdn_layers:
                layer = layers[idx]
                # the tape is kept by cache index (a pipeline rank's caches start at its first layer)
                put(layer, "linear_attn",
                    TapedGatedDeltaNet(layer["linear_attn"], make_sink(idx - target.layer_offset)))
            replayed = [c for c, kind in zip(cache, target._replay_kinds) if kind == "replay"]
            watched = {id(c): c for c in replayed}
            # recurrent state beside attention in one CacheList (Falcon-H1): the module the
            # layer hands that state to is recorded too, so a rollback re-runs that module
            # alone and the attention beside it is trimmed (per row in a batch); so is every
            # recurrent state when the layers' own calls cannot be replayed (`replay_mixers`)
            inner = {id(s): s for c in replayed if isinstance(c, CacheList) or target.replay_mixers
                     for s in (c.caches if isinstance(c, CacheList) else [c]) if isinstance(s, ArraysCache)}
            if watched:
                # which layer gets which cache is the model's business: every layer is
                # watched, and one handed a watched cache records its call
                for idx in range(len(layers)):
                    layer = layers[idx]
                    if layer is None:  # a layer another pipeline rank holds
                        continue
                    if inner:
                        for name, child in list(layer.children().items()):
                            if isinstance(child, nn.Module):
                                put(layer, name, ReplayTap(child, inner, keep_replay))
                    put(layers, idx, ReplayTap(layer, watched, keep_replay))
                # (LongCat's n-gram embedding keeps the context's last tokens in a cache of its own)
                name = target._embedding_name
                put(target.text_model, name, ReplayTap(target.text_model[name], watched, keep_replay))
        if "quantized" in small_m:
            for parent, key, q in target._quantized:
                put(parent, key, _SmallMQuantizedLinear(q))
        if "dense" in small_m:
            for parent, key, layer in target._dense:
                put(parent, key, _SmallMLinear(layer))
        if tree is not None:
            for parent, key in target.rope_slots:
                put(parent, key, TreeRoPE(parent[key], tree))
        submit = submit_layers(target)
        for idx in submit - set(slot):
            put(layers, idx, _LayerTap(layers[idx], None, submit=True))
        for idx in slot:
            if not target.tap_inputs:
                put(layers, idx, _LayerTap(layers[idx], keep_output(idx), submit=idx in submit))
                continue
            # layers the model never calls whole: what the next one's input norm (the last: the final norm) takes
            parent, key = (layers[idx + 1], "input_layernorm") if idx + 1 < len(layers) else (target.text_model, "norm")
            put(parent, key, _InputTap(parent[key], keep_output(idx)))
        if target.inner_head is not None:  # a text model that applies its LM head itself
            put(target.text_model, target.inner_head.name, target.inner_head.stand_in())
        yield
