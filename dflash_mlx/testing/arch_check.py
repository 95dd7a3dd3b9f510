"""Every architecture mlx-lm ships, as a tiny random float32 model, and the quick check that DFlash
runs it exactly (or refuses it, in one line, when the target is built).

`ARCHITECTURES` names each of mlx-lm's model modules (and the wrappers' variants) with the
config it is built from, as a checkpoint's `config.json` would give it: mlx-lm's own
`_get_classes` picks the module from `model_type`, and `ModelArgs.from_dict` builds a
wrapper's language model from its `text_config`. `quick_check` decodes one prompt greedily
with DFlash (a random draft at width 1 and `auto`, a scripted draft right for a random number
of tokens each cycle, tapping every layer) against mlx-lm's own greedy decode. The families z-lab drafts for, and
the other architectures of `testing.archs`, keep their deeper checks (`tests/test_families.py`).
"""

import copy
import os
import random
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)
import mlx.core as mx

from dflash_mlx.testing import archs, more_archs
from dflash_mlx.testing.targets import TINY_CONFIGS, ScriptedDraft, byte_tokenizer, clean_case

VOCAB = more_archs.V
PROMPT_LEN = 20  # past every sliding window of the tiny configs (8)
MAX_TOKENS = 12
BLOCK = 8  # the drafts' block size: verifies of up to 8 tokens

# key -> (kind, config): kind "deep" (tests/test_families.py checks it in depth) or "quick"
ARCHITECTURES: Dict[str, dict] = {}
DEEP = set()
for _key in archs.ALL_ARCHS:
    ARCHITECTURES[_key] = archs.config(_key)[1]
    DEEP.add(_key)
for _key, _cfg in TINY_CONFIGS.items():
    ARCHITECTURES[_key] = _cfg
    DEEP.add(_key)
ARCHITECTURES.update(more_archs.TEXT_CONFIGS)
ARCHITECTURES.update(more_archs.WRAPPER_CONFIGS)
ARCHITECTURES.update(more_archs.OPTION_VARIANTS)
QUICK = [k for k in ARCHITECTURES if k not in DEEP]


def module_of(key: str) -> str:
    """The mlx-lm module (file under mlx_lm/models) the config of `key` builds."""
    from mlx_lm.utils import _get_classes

    with _importable(key):
        _, args_class = _get_classes(ARCHITECTURES[key])
    return args_class.__module__.rsplit(".", 1)[-1]  # (solar_open's Model is glm4_moe's)


def mlx_lm_modules() -> List[str]:
    """Every module under mlx_lm/models that defines a model (a `Model` and its `ModelArgs`)."""
    import mlx_lm.models as models

    folder = os.path.dirname(models.__file__)
    out = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py") or name.startswith("_"):
            continue
        with open(os.path.join(folder, name)) as f:
            text = f.read()
        if "class ModelArgs" in text and ("class Model(" in text or "import Model" in text):
            out.append(name[:-3])
    return out


@contextmanager
def _importable(key: str):
    """mlx-lm's olmo module exits at import unless `hf_olmo` (the ai2-olmo package) imports,
    which it only probes for: an empty stand-in for the duration of the import."""
    if key != "olmo" or "hf_olmo" in sys.modules:
        yield
        return
    import types

    sys.modules["hf_olmo"] = types.ModuleType("hf_olmo")
    try:
        yield
    finally:
        del sys.modules["hf_olmo"]


def build(key: str, seed: int = 0, config: Optional[dict] = None):
    """The float32 eval-mode model of `key`: mlx-lm's classes for its config (`config`: another one for
    its module, e.g. reshaped), random weights (mx.random.seed(seed + SEEDS[key])), token embedding x
    EMBED_SCALE (default 4), TWEAKS."""
    from mlx_lm.utils import _get_classes

    if key in archs.ALL_ARCHS:
        return archs.build(key, seed) if config is None else archs.build_config(key, config, seed)
    cfg = copy.deepcopy(ARCHITECTURES[key] if config is None else config)
    with _importable(key):
        model_class, args_class = _get_classes(cfg)
    base = key.split("/")[0]  # an option variant (more_archs.OPTION_VARIANTS) takes its architecture's knobs
    mx.random.seed(seed + more_archs.SEEDS.get(key, more_archs.SEEDS.get(base, 0)))
    model = model_class(args_class.from_dict(cfg))
    return archs.finish(model, more_archs.EMBED_SCALE.get(key, more_archs.EMBED_SCALE.get(base, 4.0)),
                        more_archs.TWEAKS.get(key, more_archs.TWEAKS.get(base, {})),
                        more_archs.EMBEDDINGS, matrices_only=True)


@dataclass
class Outcome:
    """What the quick check found: "exact", "refused" (reason: the one line) or "mismatch"."""

    status: str
    reason: str = ""
    accepts: List[int] = field(default_factory=list)  # the scripted draft's accept lengths


def case(model, seed: int = 0, length: int = PROMPT_LEN):
    """(prompt, greedy reference): a random byte prompt whose greedy continuation has no EOS
    and is varied (at least 5 distinct tokens), so that a wrong token shows, of a model that
    reads its context (`reads_context`), so that a wrong cache shows."""
    for s in range(seed, seed + 20):
        prompt, ref = clean_case(model, length, MAX_TOKENS, seed=s)
        if len(set(ref)) >= 5:
            if length > 1 and not reads_context(model, prompt):
                raise AssertionError("the tiny model's next token does not depend on the tokens before the last: "
                                     "a check of its caches tests nothing")
            return prompt, ref
    raise AssertionError("the tiny model's greedy continuations are near-constant runs: they test nothing")


def reads_context(model, prompt) -> bool:
    """Whether the logits after `prompt` change when every token before its last does. A tiny
    model whose attention or recurrent state ends in a parameter that starts at zeros (RWKV-7's
    output norm, Baichuan-M1's key and value convolutions) ignores them, and its rollbacks and
    caches can then be wrong without a wrong token (`more_archs.TWEAKS`)."""
    other = [(t + 1) % VOCAB for t in prompt[:-1]] + [prompt[-1]]
    a, b = (model(mx.array([p]))[0, -1] for p in (prompt, other))
    return mx.abs(a - b).max().item() > 1e-4


def reads_state(model) -> Optional[bool]:
    """Whether the next token's logits change when the recurrent states (mlx-lm's `ArraysCache`
    entries) a prompt left are zeroed; None for a model without any. A hybrid's attention
    layers read the context whatever its recurrent layers do (`reads_context` cannot tell), and
    Recurrent Gemma's temporal convolution, left at its zeros, kept its state at zero."""
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    from dflash_mlx.models.target.rollback import sub_caches

    cache = make_prompt_cache(model)
    states = [s for entry in cache for s in sub_caches(entry) if isinstance(s, ArraysCache)]
    if not states:
        return None
    prompt = [(7 * i + 5) % VOCAB for i in range(PROMPT_LEN)]
    model(mx.array([prompt[:-1]]), cache=cache)
    zeroed = copy.deepcopy(cache)
    for entry in zeroed:
        for s in sub_caches(entry):
            if isinstance(s, ArraysCache):
                s.cache = [None if a is None else mx.zeros_like(a) for a in s.cache]
    a, b = (model(mx.array([prompt[-1:]]), cache=c)[0, -1] for c in (cache, zeroed))
    return mx.abs(a - b).max().item() > 1e-3


def refusal(model) -> Optional[str]:
    """The one line `Target` refuses `model` with, or None when it takes it."""
    from dflash_mlx.models.target.adapter import Target, UnsupportedTargetError

    try:
        Target(model)
    except UnsupportedTargetError as e:
        return str(e)
    return None


def quick_check(model, prompt, ref) -> Outcome:
    """DFlash greedy against `ref` (mlx-lm's own greedy decode of `prompt`): a random draft at
    width 1 and `auto`, then a scripted draft right for a random number of tokens each cycle,
    tapping every layer."""
    from dflash_mlx import stream_generate
    from dflash_mlx.models.draft.checkpoints import random_draft
    from dflash_mlx.models.target.adapter import Target

    reason = refusal(model)
    if reason is not None:
        return Outcome("refused", reason)
    tok = byte_tokenizer()

    def decode(draft, width):
        out, last = [], None
        for last in stream_generate(model, draft, tok, prompt, max_tokens=MAX_TOKENS, block_size=width,
                                    stop_token_ids=[]):
            out += last.tokens
        return out, last.accept_lengths

    for width in (1, "auto"):
        out, _ = decode(random_draft(model, num_layers=1, block_size=BLOCK, seed=3), width)
        if out != ref:
            return Outcome("mismatch", f"width {width}: {out} != mlx-lm's {ref}")
    rng = random.Random(len(prompt))
    right = [rng.randrange(0, BLOCK) for _ in range(100)]
    scripted = ScriptedDraft(Target(model), prompt + ref, lambda c: right[c], block_size=BLOCK, layer_ids="every")
    out, accepts = decode(scripted, "draft")
    if out != ref:
        return Outcome("mismatch", f"scripted draft: {out} != mlx-lm's {ref}")
    return Outcome("exact", accepts=list(accepts))


def distributed(model) -> str:
    """How mlx-lm splits `model` over processes: "tensor" (`Model.shard`), "pipeline" (a
    `pipeline` method on the text model), both, or "–"."""
    modes = []
    if callable(getattr(model, "shard", None)):
        modes.append("tensor")
    if any(callable(getattr(m, "pipeline", None)) for _, m in model.named_modules()):
        modes.append("pipeline")
    return " + ".join(modes) or "–"
