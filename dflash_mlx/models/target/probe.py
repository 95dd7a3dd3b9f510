"""The forward a target runs once when it is built, so that a model DFlash cannot run exactly
is refused with one line before anything decodes, not found out in the middle of a verify.

`Target` already refuses a model whose decoder layers or token embedding it cannot find, a
cache kind with no rollback, and a model whose output is not its LM head on hidden states.
What only running it shows (`check_forward`: two tokens, every decoder layer tapped, the
recurrent layers recorded as a verify records them) is refused here:

  - a text model that does not run on token ids and caches alone (it needs arguments its
    `Model` makes, or inputs a text-only forward cannot give);
  - decoder layers the model never calls whole (it runs their parts: no tap sees their output),
    unless each has an `input_layernorm` and the text model a final `norm`: then `tap_inputs` is
    set, and a layer's output is read where the next one's input norm takes it (IQuest's loop
    coder); or layers whose output is not one hidden state per token;
  - recurrent state a partial accept cannot re-run: not handed to a decoder layer, or handed
    along with an argument that a replay cannot cut to the kept tokens, when the module the
    layer hands the state to cannot be re-run alone either. (Where it can, e.g. Kimi K3,
    whose layers pass each other a running list of block residuals, `target.replay_mixers`
    is set: a rollback re-runs that module, `taps` records it, checked here on one rollback.)
  - caches rolled back by running the text model again (`rerun`, DeepSeek V4.1) whose kept
    fields do not put them back (a model that writes into its caches' arrays), on one rollback.

A model whose sliding-window masks reach past its caches' window (mlx-lm's PLaMo 3 asks a mask
of `window_size + 1` of a `RotatingKVCache` of `window_size`) is not refused, but capped
(`target.context_note`, `mask_wider_than_cache`): past that window a query in a forward of
several tokens sees one key more than a one-token step does, so mlx-lm's own greedy decode
depends on how its prompt is chunked, and no verify of several tokens can equal its steps.
Up to the window both see every key.

Checked once per model. A model split over processes is probed on every rank together: each
forward is a collective, so every rank runs each one, and what a rank finds from the layers it
holds is agreed before the next step (`sharding.on_every_rank`): one rank's layers that need
their mixers replayed turn that on everywhere, one rank's refusal refuses everywhere.
"""

from typing import Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import CacheList, RotatingKVCache, _BaseCache

from dflash_mlx.identity import IdentityMap
from dflash_mlx.models.target import rerun
from dflash_mlx.models.target.rollback import UnsupportedTargetError, VerifyRecord, recorded_apart, sub_caches
from dflash_mlx.models.target.sharding import agreed_reason, on_every_rank, smallest_on_any_rank, split_stream
from dflash_mlx.models.target.stand_ins import StandIn
from dflash_mlx.models.target.taps import taps

_CHECKED = IdentityMap()


def error_line(error: Exception) -> str:
    """An exception as a one-line refusal or report shows it: its type and its message's first line."""
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def check_forward(target) -> None:
    """Raises `UnsupportedTargetError` naming why, when `target` cannot run exactly; sets
    `target.replay_mixers` where a rollback must re-run the modules the layers hand their
    recurrent state to (their own calls take something a replay cannot cut)."""
    known = _CHECKED.get((target.model,))
    if known is None:
        known = _probe(target)
        _CHECKED.put((target.model,), known)
    reason, target.replay_mixers, target.tap_inputs, window = known
    if reason is not None:
        raise UnsupportedTargetError(f"{target.arch}: {reason}")
    if window is not None and (not target.max_context or window < target.max_context):
        target.max_context = window
        target.context_note = (
            f"{target.arch}: its sliding-window masks reach past its caches' window of {window} tokens, so past "
            f"{window} tokens mlx-lm's own greedy decode depends on how many tokens each forward takes; DFlash "
            f"takes prompts of up to {window} tokens and decodes past it one token a cycle, as mlx-lm does")


def _probe(target):
    """(reason, replay_mixers, tap_inputs, window) of `target`. A split's ranks run it together: the
    same forwards in the same order, each step's outcome agreed before the next (in one process the
    agreements are this process's own answers)."""
    sharding = target.sharding
    with split_stream(sharding is not None):
        reason, mixers = _reason(target)
        mixers = not on_every_rank(sharding, [not mixers])[0]
        if mixers:  # the layers' calls cannot be replayed: their mixers' may
            target.replay_mixers = True
            reason, _ = _reason(target)
        # layers the model never calls whole (IQuest's loop coder runs their parts, twice): read at
        # the next layer's input norm, where every rank can
        inputs = reason is not None and "never called whole" in reason and _inputs_tappable(target)
        if on_every_rank(sharding, [inputs])[0]:
            target.tap_inputs = True
            reason, _ = _reason(target)
        reason = agreed_reason(sharding, reason)
        if reason is None and mixers:
            reason = agreed_reason(sharding, _mixers_replay(target))
        if reason is None and rerun.takes(target.rollback_kinds()):
            reason = agreed_reason(sharding, _rerun_keeps_state(target))
        window = smallest_on_any_rank(sharding, mask_wider_than_cache(target)) if reason is None else None
    return reason, target.replay_mixers, target.tap_inputs, window


def _inputs_tappable(target) -> bool:
    """Whether each layer's output can be read as what the next layer's `input_layernorm` (the
    text model's final `norm`, after the last) is handed: `taps` then reads it there."""
    held = [layer for layer in target.layers if layer is not None]
    return len(held) == len(target.layers) and all("input_layernorm" in layer for layer in held) and (
        "norm" in target.text_model)


class _MaskWindows(StandIn):
    """A sliding-window cache that notes the windows wider than its own the model's masks ask of it."""

    def __init__(self, cache, wider: list):
        self._wrapped = cache
        self._wider = wider

    def make_mask(self, *args, **kwargs):
        window = kwargs.get("window_size")
        if isinstance(window, int) and window > self._wrapped.max_size:
            self._wider.append(self._wrapped.max_size)
        return self._wrapped.make_mask(*args, **kwargs)


def mask_wider_than_cache(target) -> Optional[int]:
    """The smallest window of a `RotatingKVCache` the model asks a wider mask of (two tokens,
    fresh caches), else None."""
    wider, cache = [], target.make_cache()
    if not any(type(c) is RotatingKVCache for c in cache) and target.sharding is None:
        return None  # (a split's ranks run the forward together, whatever layers they hold)
    cache = [_MaskWindows(c, wider) if type(c) is RotatingKVCache else c for c in cache]
    try:
        mx.eval(target.text_model(mx.array([[1 % target.vocab_size, 2 % target.vocab_size]]), cache=cache))
    except Exception:  # a model that takes no stand-in for its cache: nothing learnt (it ran in `_reason`)
        return None
    return min(wider) if wider else None


def _cuttable(value) -> bool:
    """An argument `rollback.replay_layer` can hand a layer again, cut to the kept tokens."""
    if isinstance(value, (tuple, list)):
        return all(_cuttable(v) for v in value)
    return value is None or isinstance(value, (mx.array, _BaseCache, int, float, bool, str))


def _forward(target, tokens, cache, features=None, record=None):
    ids = list(range(len(features))) if features is not None else []
    with taps(target, ids, features, record, frozenset(), cache, rows=(1, len(tokens))):
        h = target.run_text_model(mx.array([tokens]), cache)
    mx.eval(h, [f for f in features or [] if f is not None])
    return h


def own_model_fails(error: Exception) -> str:
    """The one line a model is refused with when mlx-lm's own Model raises `error` on two tokens."""
    return f"mlx-lm's own model fails on a prompt of two tokens ({error_line(error)})"


def _own_failure(target) -> Optional[str]:
    """`own_model_fails` where mlx-lm's own Model raises on two tokens, else None."""
    try:
        mx.eval(target.model(mx.array([[1 % target.vocab_size, 2 % target.vocab_size]])))
    except Exception as e:
        return own_model_fails(e)
    return None


def _reason(target) -> Tuple[Optional[str], bool]:
    """(why `target` cannot run exactly or None, whether its recurrent layers' calls take an
    argument a replay cannot cut while `replay_mixers` is off: their mixers may be replayed)."""
    layers = target.layers
    features = [None] * len(layers)
    record = VerifyRecord() if target.recurrent else None
    cache = target.make_cache()
    try:
        _forward(target, [1 % target.vocab_size, 2 % target.vocab_size], cache, features, record)
    except Exception as e:  # the model's own code, handed what a text-only verify gives it
        own = _own_failure(target) if target.sharding is None else None
        if own is not None:  # (a bfloat16 MoE on MLX's CPU backend, whose GatherMM takes float32 only)
            return own, False
        return (f"its text model does not run on token ids and caches alone ({error_line(e)}); DFlash runs "
                "it without the arguments its Model makes for it"), False
    held = [i for i, layer in enumerate(layers) if layer is not None]  # (a pipeline rank's own)
    missing = [i for i in held if features[i] is None]
    if missing:
        return (f"decoder layer {missing[0] + target.layer_offset} of {target.num_layers} is never called whole "
                "(the model runs the layers' parts itself), so DFlash cannot tap the layers' outputs"), False
    odd = next((i for i in held if features[i].shape != (1, 2, target.hidden_size)), None)
    if odd is not None:
        return (f"decoder layer {odd + target.layer_offset}'s output has shape {tuple(features[odd].shape)}, not "
                f"one hidden state per token (1, 2, {target.hidden_size}), so it cannot feed a draft"), False
    if record is None:
        return None, False
    for i, (c, kind) in enumerate(zip(cache, target.rollback_kinds())):
        if kind != "replay":
            continue
        name = "/".join(type(s).__name__ for s in sub_caches(c))
        entry = record.replay.get(id(c))
        if entry is None and not recorded_apart(c, record):
            return (f"cache {i} ({name}) holds recurrent state that no decoder layer is handed (e.g. an "
                    "embedding's own cache), so a partial accept cannot re-run what fed it"), False
        entries = [entry] if entry is not None else [record.replay[id(s)] for s in sub_caches(c)
                                                     if id(s) in record.replay]
        odd = next((v for e in entries for v in list(e.args) + list(e.kwargs.values()) if not _cuttable(v)), None)
        if odd is not None:
            if target.replay_mixers or isinstance(c, CacheList):
                return (f"cache {i} ({name}) holds recurrent state whose layer also takes a "
                        f"{type(odd).__name__} that a replay cannot cut to the accepted tokens"), False
            return None, True
    return None, False


def _close(target):
    """Whether two cached arrays agree (a wrong state is off by O(1), rounding far less)."""
    tight = 1e-4 if target.embed_tokens_dtype == mx.float32 else 3e-2

    def close(u, v):
        if not isinstance(u, mx.array) or not isinstance(v, mx.array):
            return u == v if not isinstance(u, mx.array) and not isinstance(v, mx.array) else False
        u, v = u.astype(mx.float32), v.astype(mx.float32)
        return u.shape == v.shape and (mx.abs(u - v).max() <= tight * (1.0 + mx.abs(v).max())).item()

    return close


def _mixers_replay(target) -> Optional[str]:
    """With `replay_mixers`: a rollback of one of two tokens leaves every recurrent state as a
    forward of the first token alone does (a layer that hands one state to two modules fails it)."""
    a, b = 1 % target.vocab_size, 2 % target.vocab_size
    rolled, alone = target.make_cache(), target.make_cache()
    record = VerifyRecord()
    _forward(target, [a, b], rolled, record=record)
    target.rollback(rolled, 2, 1, record)
    _forward(target, [a], alone)
    close = _close(target)
    for i, (x, y, kind) in enumerate(zip(rolled, alone, target.rollback_kinds())):
        if kind == "replay" and not all(close(u, v) for u, v in zip(x.cache, y.cache)):
            return (f"cache {i} ({type(x).__name__}) holds recurrent state whose layer takes an argument a "
                    "replay cannot cut, and the module it hands the state to cannot be re-run alone")
    return None


def _rerun_keeps_state(target) -> Optional[str]:
    """Caches re-run with the text model (`rerun`): a rollback of one of two tokens leaves each
    cache's fields as a forward of the first token alone does (a model that writes into its
    caches' arrays, rather than replacing them, fails it)."""
    a, b = 1 % target.vocab_size, 2 % target.vocab_size
    rolled, alone = target.make_cache(), target.make_cache()
    _, _, record = target.forward(mx.array([[a, b]]), rolled, record=True)
    target.rollback(rolled, 2, 1, record)
    target.forward(mx.array([[a]]), alone)
    close = _close(target)
    for i, (x, y) in enumerate(zip(rolled, alone)):
        odd = next((name for name, v in vars(y).items() if not close(vars(x).get(name), v)), None)
        if odd is not None:
            return (f"cache {i} ({type(x).__name__}) is not put back by keeping its fields ({odd} differs after a "
                    "rollback): its model writes into the cache's arrays, so DFlash has no rollback path for it")
    return None
