"""A quantized KV cache, as mlx-lm's `generate_step(kv_bits=...)` keeps one.

mlx-lm quantizes a generation's attention caches in place (`KVCache.to_quantized`) after the
first forward that leaves them holding `quantized_kv_start` tokens or more: every row of a
forward before that one attends to full-precision keys and values, every row after it to
quantized ones (its own included). Each token's entries are quantized on their own (groups run
along the head dimension), so what a row sees depends only on whether its forward ran before
or after the conversion, not on how the rows were cut into forwards.

The engine keeps that line where plain decoding draws it. Its prompt runs in mlx-lm's chunks
(`engine.cycle.prefill_bounds`), so the conversion falls after the same chunk. A verify that
starts before `start` while the caches are full precision holds at most the rows up to it
(`room`): the rows at `start` and past it run after the conversion, as plain decoding's steps
do. The caches are converted after each prefill forward and after each cycle's rollback, where
their offset is what was committed (`convert_due`), and no cycle is queued on a guess whose
forward would start past the line before the conversion (`due`): a guess thrown away would
leave caches quantized that plain decoding holds in full.

Quantizing also turns rounding into steps. A verify row's keys and values differ from a one-row
step's in their last bits wherever the backend sums a k-row product in another order (MLX's CPU
backend through OpenBLAS: from 4 rows on; a GPU: from 2); in full precision that moves a logit by
~1e-5, but a key on the edge between two quantization levels then lands on the other level, a
whole step away (SmolLM2 with an 8-bit cache: logits ~5e-2 apart after a 16-row verify), and
greedy answers part within a few dozen tokens. So while a cache is, or will be, quantized, a
verify holds at most the rows whose forward and LM head give, bit for bit, what as many one-row
steps give on this backend (`row_invariant_width`, probed once per model: 3 on this CPU, and
likely 1 on a GPU, where deterministic mode, whose verify rows are one-row forwards, keeps every
width exact).
"""

from dataclasses import dataclass, replace
from typing import Any, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from dflash_mlx.identity import IdentityMap
from dflash_mlx.models.target.rollback import UnsupportedTargetError

# mlx-lm's `generate_step(quantized_kv_start=...)` default
DEFAULT_START = 5000
BITS = (2, 3, 4, 5, 6, 8)  # mlx's affine quantization
GROUP_SIZES = (32, 64, 128)

_CHECKED = IdentityMap()


@dataclass(frozen=True)
class KVQuantization:
    """mlx-lm's `kv_bits`, `kv_group_size` and `quantized_kv_start`."""

    bits: int
    group_size: int = 64
    start: int = DEFAULT_START

    def __post_init__(self):
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise ValueError(f"kv_bits takes one of {', '.join(map(str, BITS))} (None: off), got {self.bits!r}")
        if isinstance(self.group_size, bool) or self.group_size not in GROUP_SIZES:
            raise ValueError(f"kv_group_size takes one of {', '.join(map(str, GROUP_SIZES))}, "
                             f"got {self.group_size!r}")
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise ValueError(f"quantized_kv_start must be a whole number >= 0, got {self.start!r}")


def make_kv_quantization(kv_bits: Optional[int], kv_group_size: int = 64,
                         quantized_kv_start: int = DEFAULT_START) -> Optional[KVQuantization]:
    """The setting for mlx-lm's three arguments (its names); None where `kv_bits` is None (off)."""
    return None if kv_bits is None else KVQuantization(kv_bits, kv_group_size, quantized_kv_start)


def _checked(target) -> dict:
    found = _CHECKED.get((target.model,))
    if found is None:
        found = {}
        _CHECKED.put((target.model,), found)
    return found


def refusal(target, spec: KVQuantization) -> Optional[str]:
    """Why `target`'s caches cannot be quantized as mlx-lm quantizes them, or None. Checked
    once per model and setting: a one-token forward, then each convertible cache converted."""
    found, key = _checked(target), ("refusal", spec.bits, spec.group_size)
    if key not in found:
        found[key] = _check(target, spec)
    return found[key]


def row_invariant_width(target, bits: int, group_size: int, most: int = 16) -> int:
    """The most verify rows (<= `most`) whose forward and LM head give, bit for bit, what as many one-row
    steps give, on caches quantized to `bits` in groups of `group_size` after a short prompt: probed once
    per model and setting, k = 2, 3, ... up to the first k that differs (what a backend's kernels do
    with a product's rows depends on their count, not their values)."""
    found, key = _checked(target), ("rows", bits, group_size)
    if key not in found:
        found[key] = _probe_rows(target, KVQuantization(bits, group_size, 0), most)
    return found[key]


def _probe_rows(target, spec: KVQuantization, most: int) -> int:
    vocab = target.vocab_size
    prompt = mx.array([[(7 * i + 3) % vocab for i in range(8)]])
    width = 1
    for k in range(2, most + 1):
        rows = mx.array([[(11 * i + 5) % vocab for i in range(k)]])
        wide_cache, step_cache = target.make_cache(), target.make_cache()
        for cache in (wide_cache, step_cache):
            target.forward(prompt, cache)
            convert_due(cache, spec)
        wide = target.logits(target.forward(rows, wide_cache)[0])
        steps = mx.concatenate([target.logits(target.forward(rows[:, i : i + 1], step_cache)[0]) for i in range(k)],
                               axis=1)
        if not mx.array_equal(wide, steps).item():
            break
        width = k
    return width


def check(target, spec: KVQuantization):
    """`refusal` as an `UnsupportedTargetError`, in one line."""
    reason = refusal(target, spec)
    if reason is not None:
        raise UnsupportedTargetError(f"kv_bits: {target.name}: {reason}")


def _check(target, spec: KVQuantization) -> Optional[str]:
    if target.sharding is not None:
        return "a quantized KV cache is not supported on a target split over processes"
    if "rerun" in target.rollback_kinds():
        return "its layers share cache state that a rollback restores whole (a quantized KV cache is not supported)"
    cache = target.make_cache()
    others = sorted({type(c).__name__ for c in cache if hasattr(c, "to_quantized") and type(c) is not KVCache})
    if others:
        return f"its {', '.join(others)} caches cannot be quantized (mlx-lm's kv_bits raises there too)"
    if not any(type(c) is KVCache for c in cache):
        return ("none of its caches is one mlx-lm quantizes (a plain KVCache; mlx-lm's kv_bits leaves these as "
                "they are): run it without kv_bits")
    try:
        target.forward(mx.array([[0]]), cache)
        convert_due(cache, replace(spec, start=0))
        mx.eval([c.state[:2] for c in cache if isinstance(c, QuantizedKVCache)])
    except Exception as e:  # e.g. a head dimension the group size does not divide
        return f"its KV cache cannot be quantized to {spec.bits} bits in groups of {spec.group_size} ({_line(e)})"
    try:  # a model whose attention reads its cache's arrays itself takes no quantized ones
        mx.eval(target.forward(mx.array([[1, 2]]), cache)[0])
    except Exception as e:
        return f"its attention does not take a quantized KV cache ({type(e).__name__}: {_line(e)})"
    return None


def _line(error: Exception) -> str:
    return " ".join(str(error).split())[:160]


def convertible(cache: List[Any]) -> bool:
    """Whether some cache is still full precision (mlx-lm would convert it)."""
    return any(type(c) is KVCache for c in cache)


def holds_quantized(cache: Optional[List[Any]]) -> bool:
    """Whether some cache was quantized (by this call or an earlier one on the same prompt cache)."""
    return any(isinstance(c, QuantizedKVCache) for c in cache or ())


def _converts(c, spec: KVQuantization) -> bool:
    """Whether mlx-lm would quantize cache `c` now (`maybe_quantize_kv_cache`)."""
    return type(c) is KVCache and c.offset >= spec.start


def due(cache: List[Any], spec: Optional[KVQuantization]) -> bool:
    """Whether a forward on `cache` as it stands would run where plain decoding's caches are quantized
    but these are not yet."""
    return spec is not None and any(_converts(c, spec) for c in cache)


def convert_due(cache: List[Any], spec: Optional[KVQuantization]):
    """Quantize, in place in `cache`, the caches holding `spec.start` tokens or more (mlx-lm's
    `maybe_quantize_kv_cache`), after a forward whose tokens are all committed."""
    if spec is None:
        return
    for i, c in enumerate(cache):
        if _converts(c, spec):
            cache[i] = c.to_quantized(group_size=spec.group_size, bits=spec.bits)


def room(target, cache: List[Any], spec: Optional[KVQuantization], position: int) -> Optional[int]:
    """The most rows a verify from `position` may hold: none of them on full-precision caches where plain
    decoding's are quantized, and, while the caches are or will be quantized, no more than round as one-row
    steps do (`row_invariant_width`; not in deterministic mode, whose rows are one-row forwards); None: no
    limit."""
    limits = [row_limit(target, cache, spec)]
    if spec is not None and position < spec.start and convertible(cache):
        limits.append(spec.start - position)
    return min((n for n in limits if n is not None), default=None)


def row_limit(target, cache: List[Any], spec: Optional[KVQuantization]) -> Optional[int]:
    """While `cache` is or will be quantized (`spec`, or an earlier call's conversion), outside deterministic
    mode: the most verify rows that round as one-row steps do (`row_invariant_width`, probed at the first
    call for the setting); else None."""
    quantized = next((c for c in cache if isinstance(c, QuantizedKVCache)), None)
    if (spec is None and quantized is None) or target.deterministic:
        return None
    bits, group = (spec.bits, spec.group_size) if spec is not None else (quantized.bits, quantized.group_size)
    return row_invariant_width(target, bits, group)
