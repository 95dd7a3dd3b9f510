"""Config variants of every architecture in `testing.arch_check`, generated from the options
each model's `ModelArgs` actually has: windows and chunks shorter than the test prompt, every
RoPE scaling type the model's code reads, partial rotary, q/k norms, attention sinks, logit
soft-caps, KV sharing, no-RoPE layers, MoE on some layers only, short-convolution widths, sparse
attention's top-k, llama4's attention temperature, one KV head, one layer or three.

A tiny config leaves most such options at their defaults, or sets them where a short prompt
never reaches them (a window of 4096), so a mismatch in how DFlash handles them stays silent.
`variants(key)` reads the fields of the model's args dataclass (and, for a wrapper, of the
text model's args class it builds from `text_config`) and applies `RULES`: one small rule per
option kind, each giving the overrides that make the option bite in a 20-token prompt, or none
when the model lacks the field or the tiny config already sets it so. Which RoPE scaling types a
model takes is read from its module's source (`rope_types`). `testing.variant_check` checks them.
"""

import copy
import dataclasses
import importlib
import inspect
import re
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Set

from dflash_mlx.testing import arch_check, archs, more_archs, quantized_variants

WINDOW = 5  # windows and chunks: a quarter of arch_check.PROMPT_LEN, so prompt and answer cross several
SHORT_POSITIONS = 8  # "original" context lengths of scaled RoPEs: the prompt runs past them
# dynamic NTK moves only past max_position_embeddings: one past the 20-token prompt, inside its answer
POSITION_LIMIT = 30
WINDOW_NAMES = ("sliding_window", "sliding_window_size", "attention_window_size", "window_size",
                "loop_window_size")  # set to WINDOW
CHUNK_NAME = "attention_chunk_size"  # set to WINDOW too


@dataclass
class Variant:
    key: str  # the architecture, as in arch_check.ARCHITECTURES
    kind: str  # the option kind: "window", "chunk", "rope:yarn", "qk_norm", ...
    overrides: Dict[str, object]  # fields of the text model's config (a wrapper's text_config)
    candidates: List[Dict[str, object]] = field(default_factory=list)  # fallbacks mlx-lm may need

    @property
    def name(self) -> str:
        return f"{self.key}/{self.kind}"

    def option(self) -> str:
        """The overrides in one line, for tables and reports."""
        return ", ".join(f"{k}={_short(v)}" for k, v in self.overrides.items())

    def config(self, overrides: Optional[Dict[str, object]] = None) -> dict:
        """The architecture's config with the overrides (in `text_config` where it has one)."""
        cfg = copy.deepcopy(arch_check.ARCHITECTURES[self.key])
        (cfg["text_config"] if "text_config" in cfg else cfg).update(
            copy.deepcopy(self.overrides if overrides is None else overrides))
        return cfg


def _short(v) -> str:
    if isinstance(v, list) and len(v) > 4 and len(set(map(str, v))) <= 2:
        return f"[{', '.join(map(str, v[:2]))}, ...]x{len(v)}"
    return str(v).replace("'", "")


# -- what a model has -----------------------------------------------------------------------


@dataclass
class Options:
    """What `RULES` see of one architecture: its config's fields, their current values (the tiny
    config's, else the dataclass default), the source of its modules, its layer count."""

    key: str
    fields: Set[str]
    values: Dict[str, object]
    source: str
    layers: int

    def has(self, name: str) -> bool:
        return name in self.fields

    def get(self, name: str, default=None):
        return self.values.get(name, default)


def _args_classes(key: str) -> list:
    """The args dataclasses a config of `key` is read into: the model's, and the text model's
    a wrapper builds (found on the built model: mlx-lm names them TextArgs, TextConfig, ...)."""
    from mlx_lm.utils import _get_classes

    with arch_check._importable(key):
        _, args_class = _get_classes(copy.deepcopy(arch_check.ARCHITECTURES[key]))
    found = [args_class]
    if "text_config" in {f.name for f in dataclasses.fields(args_class)}:
        model = build(key, arch_check.ARCHITECTURES[key])
        for name, module in model.named_modules():
            args = getattr(module, "args", None) or getattr(module, "config", None)
            if name and dataclasses.is_dataclass(args) and type(args) is not args_class:
                found.append(type(args))
                break
    return found


@lru_cache(maxsize=None)
def options(key: str) -> Options:
    cfg = arch_check.ARCHITECTURES[key]
    text = cfg.get("text_config", cfg)
    fields, values, sources = set(), {}, []
    for cls in _args_classes(key):
        for f in dataclasses.fields(cls):
            fields.add(f.name)
            if f.default is not dataclasses.MISSING:
                values.setdefault(f.name, f.default)
        module = sys.modules[cls.__module__]
        sources.append(inspect.getsource(module))
    fields.discard("text_config")
    values.update({k: v for k, v in text.items() if k in fields})
    layers = next((text[k] for k in ("num_hidden_layers", "num_layers", "n_layers", "n_layer") if k in text), 2)
    return Options(key, fields, values, "\n".join(sources), int(layers))


def rope_types(source: str) -> List[str]:
    """The RoPE scaling types a model's code reads: everything mlx-lm's `initialize_rope`
    builds when the module calls it, and the types its own code names."""
    found = []
    if "initialize_rope(" in source:
        found += ["linear", "dynamic", "yarn", "llama3", "longrope"]
    named = {"linear": r"[\"']linear[\"']", "dynamic": r"[\"']dynamic[\"']", "yarn": r"[\"'](deepseek_)?yarn[\"']",
             "llama3": r"[\"']llama3[\"']", "longrope": r"[\"'](longrope|su)[\"']", "ntk-alpha": r"[\"']alpha[\"']",
             "mrope": r"mrope_section", "proportional": r"[\"']proportional[\"']"}
    for kind, pattern in named.items():
        if kind not in found and re.search(pattern, source):
            found.append(kind)
    return found


# -- the rules ------------------------------------------------------------------------------


def _head_dim(o: Options) -> int:
    if o.get("head_dim"):
        return int(o.get("head_dim"))
    hidden = o.get("hidden_size") or o.get("d_model") or o.get("hidden_dim") or 64
    heads = o.get("num_attention_heads") or o.get("n_heads") or o.get("num_heads") or 4
    return int(hidden) // int(heads)


def _rope_spec(kind: str, o: Options) -> List[Dict[str, object]]:
    """The scaling dicts (first choice, then fallbacks) of one RoPE type, at values that bite."""
    n = SHORT_POSITIONS
    if kind == "linear":
        return [{"factor": 4.0}]
    if kind == "dynamic":  # (its base moves only past max_position_embeddings: `POSITION_LIMIT`)
        return [{"factor": 4.0}]
    if kind == "ntk-alpha":  # Hunyuan's: the base times alpha ** (d / (d - 2)), named "dynamic"
        return [{"type": "dynamic", "alpha": 1000.0, "factor": 1.0}]
    if kind == "yarn":
        return [{"factor": 4.0, "original_max_position_embeddings": n, "beta_fast": 32.0, "beta_slow": 1.0,
                 "mscale": 1.0, "mscale_all_dim": 1.0}]
    if kind == "llama3":
        return [{"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": n}]
    if kind == "longrope":
        half = max(1, int(_head_dim(o) * (o.get("partial_rotary_factor") or 1.0)) // 2)
        return [{"short_factor": 1.0, "long_factor": 4.0, "original_max_position_embeddings": n},
                {"short_factor": [1.0] * half, "long_factor": [4.0] * half, "original_max_position_embeddings": n}]
    if kind == "mrope":
        return [{"mrope_section": [2, 1, 1]}]
    if kind == "proportional":
        return [{"partial_rotary_factor": 0.5, "factor": 4.0}]
    raise ValueError(kind)


def _rope(o: Options) -> List[Variant]:
    slot = "rope_scaling" if o.has("rope_scaling") else "rope_parameters" if o.has("rope_parameters") else None
    if slot is None:
        return []
    out = []
    for kind in rope_types(o.source):
        candidates = []
        for spec in _rope_spec(kind, o):
            name = spec.pop("type", "dynamic" if kind == "ntk-alpha" else kind)
            spec = dict(spec, type=name, rope_type=name)
            if slot == "rope_parameters":
                current = copy.deepcopy(o.get(slot) or {})
                if current and all(isinstance(v, dict) for v in current.values()):  # per layer type
                    value = {k: dict(v, **spec) for k, v in current.items()}
                else:
                    value = dict(current or {"rope_theta": o.get("rope_theta") or 10000.0}, **spec)
            else:
                value = spec
            over = {slot: value}
            if kind == "longrope" and o.has("max_position_embeddings"):
                over["max_position_embeddings"] = 8 * SHORT_POSITIONS
            if kind == "dynamic" and o.has("max_position_embeddings"):
                over["max_position_embeddings"] = POSITION_LIMIT
            candidates.append(over)
        out.append(Variant(o.key, f"rope:{kind}", candidates[0], candidates[1:]))
    return out


def _window(o: Options) -> List[Variant]:
    over = {}
    for name in WINDOW_NAMES:
        if o.has(name):
            over[name] = WINDOW
    if not over:
        return []
    if o.has("use_sliding_window"):
        over["use_sliding_window"] = True
    if o.has("sliding_window_pattern"):
        over["sliding_window_pattern"] = 2
    types = o.get("layer_types")
    if o.has("layer_types") and set(types or ["full_attention"]) <= {"sliding_attention", "full_attention"}:
        over["layer_types"] = ["sliding_attention", "full_attention"] * (o.layers // 2) + \
            ["sliding_attention"] * (o.layers % 2)
    if o.has("max_window_layers"):
        over["max_window_layers"] = o.layers
    return [Variant(o.key, "window", over)]


def _set(kind: str, names, value: Callable[[Options], object], *, only_if: Callable[[Options], bool] = None):
    """A rule: for each field of `names` the model has, a variant setting it to `value(o)`,
    unless the tiny config has that already (its own check covers it)."""
    names = [names] if isinstance(names, str) else list(names)

    def rule(o: Options) -> List[Variant]:
        if only_if is not None and not only_if(o):
            return []
        out = []
        for name in names:
            if not o.has(name):
                continue
            v = value(o)
            if v is None or o.get(name) == v:
                continue
            suffix = f":{name}" if len(names) > 1 else ""
            out.append(Variant(o.key, kind + suffix, {name: v}))
        return out

    return rule


def _moe(o: Options) -> bool:
    return any(o.has(n) for n in ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"))


def _alternate(a, b):
    return lambda o: [a, b] * (o.layers // 2) + [a] * (o.layers % 2)


def _kv_shared(o: Options) -> List[Variant]:
    out = _set("kv_sharing", "num_kv_shared_layers", lambda o: o.layers // 2)(o)
    if o.has("use_cla") and not o.get("use_cla"):
        out.append(Variant(o.key, "kv_sharing:cla", {"use_cla": True, "cla_share_factor": 2}))
    out += _set("kv_sharing", "num_kv_reuse_layers", lambda o: 1)(o)
    return out


CONV_NAMES = ("conv_kernel", "linear_conv_kernel_dim", "mamba_d_conv", "conv_L_cache", "conv1d_width",
              "short_conv_kernel_size")
CONV_WIDTHS = (2, 6)  # the narrowest conv state (one input kept), and one wider than a width-4 verify


def _conv(o: Options) -> List[Variant]:
    """Short-convolution widths other than the tiny config's: the conv state a rollback puts back
    keeps width - 1 inputs, fewer or more than a verify's rows."""
    return [v for width in CONV_WIDTHS for v in _set(f"conv{width}", CONV_NAMES, lambda o, width=width: width)(o)]


def _temperature(o: Options) -> List[Variant]:
    """llama4's attention temperature: NoPE layers scale queries by a log of their position over
    `floor_scale` (8192 by default: constant over a test's positions); at 4 the scale moves every few
    positions, so each verify row must get its own position's scale."""
    if not (o.has("floor_scale") and o.has("attn_temperature_tuning")):
        return []
    return [Variant(o.key, "attn_temperature", {"floor_scale": 4, "attn_temperature_tuning": True})]


def _fewer(n: int) -> Callable[[str], Callable[[Options], object]]:
    """A value rule for field `name`: n where the model's value is a larger int, else none."""
    return lambda name: (lambda o: n if isinstance(o.get(name), int) and o.get(name) > n else None)


LAYER_COUNTS = (1, 3)  # one layer (every tap on it), and an odd count (patterns cut mid-period)
LAYER_COUNT_NAMES = ("num_hidden_layers", "num_layers", "n_layers", "n_layer")


def _layers(o: Options) -> List[Variant]:
    """Other layer counts, with the per-layer lists (layer types, no-RoPE flags) cut or repeated to
    match: a list longer than the layers leaves caches no layer writes, which no real config has."""
    name = next((n for n in LAYER_COUNT_NAMES if o.has(n)), None)
    if name is None:
        return []
    lists = {k: v for k, v in o.values.items() if isinstance(v, list) and len(v) == o.layers and o.layers > 1}
    out = []
    for count in LAYER_COUNTS:
        if count == o.layers:
            continue
        heads = dict({name: count}, **{k: (v * count)[:count] for k, v in lists.items()})
        tails = dict({name: count}, **{k: (v * count)[-count:] for k, v in lists.items()})
        out.append(Variant(o.key, f"layers{count}", heads, [tails] if tails != heads else []))
    return out


# option kind -> rule; a rule returns the variants of one model (none when it lacks the option)
RULES: Dict[str, Callable[[Options], List[Variant]]] = {
    "window": _window,
    "chunk": _set("chunk", CHUNK_NAME, lambda o: WINDOW),
    "rope": _rope,
    "rope_traditional": _set("rope_traditional", ["rope_traditional", "rope_interleave"], lambda o: True),
    "partial_rotary": lambda o: (
        _set("partial_rotary", "partial_rotary_factor", lambda o: 0.5)(o)
        + _set("partial_rotary", "rotary_dim", lambda o: _head_dim(o) // 2)(o)
        + _set("partial_rotary", ["rotary_pct", "rope_pct"], lambda o: 0.5)(o)),
    "nope": lambda o: (_set("nope", "no_rope_layer_interval", lambda o: 2)(o)
                       + _set("nope", "no_rope_layers", _alternate(1, 0))(o)),
    "qk_norm": _set("qk_norm", ["use_qk_norm", "qk_norm", "qk_layernorm", "normalize_qk_projections"], lambda o: True),
    "sinks": lambda o: _set("sinks", sorted(n for n in o.fields if "sink" in n and "sinkhorn" not in n),
                                lambda o: True)(o),
    "softcap": _set("softcap", ["final_logit_softcapping", "attn_logit_softcapping", "logits_soft_cap",
                                "moe_router_logit_softcapping"], lambda o: 2.0),
    "kv_sharing": _kv_shared,
    "moe_layers": lambda o: [v for name, value in (
        ("decoder_sparse_step", lambda o: 2), ("mlp_only_layers", lambda o: [0]),
        ("first_k_dense_replace", lambda o: 1), ("moe_layer_freq", lambda o: 2),
        ("interleave_moe_layer_step", lambda o: 2), ("moe_layer_start_index", lambda o: 1),
        ("moe_layer_interval", lambda o: 2), ("num_dense_layers", lambda o: 1),
        ("is_moe_layer", _alternate(False, True)))
        for v in _set("moe_layers", name, value, only_if=_moe)(o)],
    "bidirectional": _set("bidirectional", "use_bidirectional_attention", lambda o: True),
    "conv": _conv,
    # sparse attention's indexer keeps fewer keys (or key blocks) than the prompt has
    "sparse_topk": lambda o: [v for name in ("index_topk", "index_topk_blocks", "candidate_topk_blocks")
                              for v in _set(f"sparse_topk:{name}", name,
                                            _fewer(1 if "blocks" in name else 3)(name))(o)],
    "attn_temperature": _temperature,
    "layers": _layers,
    "kv_heads": lambda o: [v for name in ("num_key_value_heads", "num_kv_heads")  # one KV head for all queries
                           for v in _set(f"kv_heads:{name}", name, _fewer(1)(name))(o)],
    "quantized": lambda o: [Variant(o.key, *spec) for spec in quantized_variants.specs(o.values)],
}


def variants(key: str) -> List[Variant]:
    """Every variant of `key` the rules give (none for what this machine cannot run)."""
    if key in more_archs.NOT_RUN:
        return []
    o = options(key)
    out = []
    for rule in RULES.values():
        out += rule(o)
    for v in out:
        if v.kind.startswith("moe_layers:"):
            v.kind = "moe_layers"
    return out


def all_variants(keys=None) -> List[Variant]:
    return [v for key in (keys or arch_check.ARCHITECTURES) for v in variants(key)]


# -- building ---------------------------------------------------------------------------------


def build(key: str, cfg: dict, seed: int = 0):
    """The float32 eval-mode model of `cfg` (a config of `key`), random weights made as
    `arch_check.build(key, seed)` makes them (same seeds, embedding scale and tweaks); with a
    `quantization` entry, then quantized as `mlx_lm.convert` quantizes it."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    cfg = copy.deepcopy(cfg)
    if key in archs.ALL_ARCHS:
        module = importlib.import_module(f"mlx_lm.models.{archs.ALL_ARCHS[key][0]}")
        mx.random.seed(archs.SEEDS.get(key, 0) + seed)
        model = module.Model(module.ModelArgs.from_dict(cfg))
        model = archs.finish(model, archs.EMBED_SCALE.get(key, 4.0), archs.TWEAKS.get(key, {}), archs._EMBED_SUFFIXES)
    else:
        with arch_check._importable(key):
            model_class, args_class = _get_classes(cfg)
        mx.random.seed(seed + more_archs.SEEDS.get(key, 0))
        model = model_class(args_class.from_dict(cfg))
        model = archs.finish(model, more_archs.EMBED_SCALE.get(key, 4.0), more_archs.TWEAKS.get(key, {}),
                             more_archs.EMBEDDINGS, matrices_only=True)
    return quantized_variants.quantize(model, cfg)
