"""The check of one config variant (`testing.variants`): DFlash greedy against mlx-lm's own
greedy decode at widths 1, 4, 16 and `auto`, over two chat turns on one prompt cache, on prompts
no longer than its window or chunk where it has one, under token trees and in a batch where the
model takes them, or the one line `Target` refuses it with.

A variant's random model whose greedy continuations are near-constant, or whose top two logits
tie where DFlash's tokens part from mlx-lm's, is built again from the next seed (up to `SEEDS`),
not counted; a variant whose logits equal the base config's on the test prompt (`inert`: the
option does not bite at this length, or the model's code ignores it) is checked all the same and
marked so; a config mlx-lm itself rejects or cannot run is `not built`.
"""

import random
import time
from dataclasses import dataclass, field
from typing import List, Optional

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx.bench.metrics import first_mismatch
from dflash_mlx.models.target.probe import error_line
from dflash_mlx.testing import arch_check, variants
from dflash_mlx.testing.targets import (EOS_ID, RankedDraft, RowScriptedDrafts, ScriptedDraft, byte_tokenizer,
                                       clean_case)

WIDTHS = (1, 4, 16, "auto")
SEEDS = 3  # model seeds tried before a variant is called degenerate
MAX_TOKENS = 16
TIE_GAP = 1e-3  # mlx-lm's top two logits closer than this: a tie, not a test of the engine
TIE = "tie"
CONTEXT = arch_check.PROMPT_LEN + 30  # the longest context a check runs (second turns, the batch's longest row)
STATUSES = ("exact", "refused", "mismatch", "inert", "degenerate", "not built")  # ("inert": older sweeps)
INERT = "inert: the model's logits on the prompt and its answer equal the base config's"


@dataclass
class Result:
    name: str
    key: str
    kind: str
    option: str
    status: str
    reason: str = ""
    checked: List[str] = field(default_factory=list)  # what ran exact: widths, "turns", "short prompts", ...
    inert: bool = False  # its logits equal the base config's: the option does not bite here
    seed: int = 0
    seconds: float = 0.0

    def row(self) -> dict:
        return dict(self.__dict__)


def _decode(model, draft, prompt, max_tokens, **kw):
    from dflash_mlx import stream_generate

    out = []
    for r in stream_generate(model, draft, byte_tokenizer(), prompt, max_tokens=max_tokens, stop_token_ids=[],
                             **kw):
        out += r.tokens
    return out


def _wrong(model, context, out, ref, what) -> Optional[str]:
    """None when `out == ref` (the continuation of `context`), TIE when they part where mlx-lm's
    own top two logits tie (a random model's accident, not the engine's), else where they part."""
    if out == ref:
        return None
    i = first_mismatch(out, ref)
    if i < len(ref):
        logits = model(mx.array([list(context) + list(ref[:i])]))[0, -1]
        top = mx.sort(logits)
        if (top[-1] - top[-2]).item() < TIE_GAP:
            return TIE
    return f"{what}: first difference at token {i} of {len(ref)}"


def _widths(model, prompt, ref, widths) -> Optional[str]:
    """None when every width commits `ref`, else which one did not and where."""
    from dflash_mlx.models.draft.checkpoints import random_draft
    from dflash_mlx.models.target.adapter import Target
    from dflash_mlx.policy.sizer import forget_sizers

    rng = random.Random(len(prompt))
    for width in widths:
        forget_sizers()
        if width == 1:
            out = _decode(model, random_draft(model, num_layers=1, block_size=16, seed=3), prompt, len(ref),
                          block_size=1)
        else:  # a scripted draft right for a random number of tokens each cycle: every rollback length;
            # it taps every layer, so each layer runs behind the stand-in that keeps its output
            block = 16 if width == "auto" else width
            right = [rng.randrange(0, block) for _ in range(200)]
            draft = ScriptedDraft(Target(model), prompt + ref, lambda c: right[c], block_size=block, layer_ids="every")
            out = _decode(model, draft, prompt, len(ref), block_size="draft" if width != "auto" else "auto",
                          token_trees=False)
        wrong = _wrong(model, prompt, out, ref, f"width {width}")
        if wrong is not None:
            return wrong
    return None


def _short_prompts(model) -> Optional[str]:
    """Prompts no longer than the window or chunk (2, its size, one past it), answers that cross
    it, at widths 4 and 16: the caches fill while the engine verifies and rolls back."""
    for length in (2, variants.WINDOW, variants.WINDOW + 1):
        prompt, ref = clean_case(model, length, MAX_TOKENS, seed=length)
        wrong = _widths(model, prompt, ref, [4, 16])
        if wrong is not None:
            return wrong if wrong == TIE else f"prompt of {length} tokens: {wrong}"
    return None


def _turns(model, prompt, ref) -> Optional[str]:
    """Two chat turns on one prompt cache, prompts prefilled in chunks of 8: the second extends
    the first's prompt and answer, so it runs on caches the first left (trimmed windows too)."""
    from dflash_mlx.generate import make_prompt_cache
    from dflash_mlx.models.draft.checkpoints import random_draft
    from dflash_mlx.models.target.adapter import Target
    from dflash_mlx.testing.targets import greedy_reference

    draft = random_draft(model, num_layers=1, block_size=16, seed=4)
    cache = make_prompt_cache(model, draft)
    first = _decode(model, draft, prompt, 8, block_size=4, prompt_cache=cache, prefill_step_size=8)
    wrong = _wrong(model, prompt, first, ref[:8], "first turn (prefill chunks of 8) at width 4")
    if wrong is not None:
        return wrong
    turn2 = prompt + first + prompt[:10]
    limit = Target(model).max_context
    if limit and len(turn2) >= limit:  # a prompt past the window is refused: the turn runs on past it
        turn2 = turn2[: limit - 1]
    # the engine stops at the tokenizer's EOS, as mlx-lm's own generate does; the first turn's
    # reference has none (`clean_case`), the second's may
    want = greedy_reference(model, turn2, 12, stop_ids=(EOS_ID,))
    second = _decode(model, draft, turn2, 12, block_size=4, prompt_cache=cache, prefill_step_size=8)
    return _wrong(model, turn2, second, want, "second turn at width 4")


def _trees(model, prompt, ref) -> Optional[str]:
    from dflash_mlx.models.target.adapter import Target
    from dflash_mlx.policy.sizer import forget_sizers

    forget_sizers()
    draft = RankedDraft(Target(model), prompt + ref, lambda c, i: (c + 2 * i) % 5 if i < 6 else 0, block_size=8,
                        layer_ids="every")
    out = _decode(model, draft, prompt, len(ref), block_size="auto", copy_proposals=False)
    return _wrong(model, prompt, out, ref, "token trees at auto")


def _batches(model, length) -> Optional[str]:
    """Three rows of different prompt lengths (the shortest `length`) at width 4 in one batch."""
    from dflash_mlx.engine.engine import BatchEngine
    from dflash_mlx.engine.rows import BatchRequest
    from dflash_mlx.models.target.adapter import Target
    from dflash_mlx.options import GenerationOptions
    from dflash_mlx.policy.sizer import forget_sizers

    forget_sizers()
    target = Target(model)
    limit = target.max_context  # every prompt inside the window (a longer one is refused)
    step = max(1, min(7, (limit - 1 - length) // 2)) if limit else 7
    cases = [clean_case(model, length + step * i, MAX_TOKENS, seed=i, make_cache=target.make_cache) for i in range(3)]
    draft = RowScriptedDrafts(target, cases, lambda c: (c * 3) % 5, block_size=8, layer_ids="every")
    engine = BatchEngine(model, draft, byte_tokenizer(), max_batch=3, prefill_chunk=8, block_size=4)
    index, tokens = {}, {}
    for i, (prompt, ref) in enumerate(cases):
        row = engine.add(BatchRequest(prompt, GenerationOptions(max_tokens=len(ref))))
        draft.register(row.state, prompt)
        index[row.uid], tokens[i] = i, []
    while not engine.idle:
        for row, r in engine.step():
            tokens[index[row.uid]] += r.tokens
    for i, (prompt, ref) in enumerate(cases):
        wrong = _wrong(model, prompt, tokens[i], ref, f"batch row {i} (prompt {len(prompt)}) at width 4")
        if wrong is not None:
            return wrong
    return None


def _logits(model, prompt):
    # with a prompt cache, as decoding runs it: a KV-shared layer reads its owner's cache only then
    out = model(mx.array([prompt]), cache=make_prompt_cache(model))
    mx.eval(out)
    return out


def _inert(variant, model, seed, prompt) -> bool:
    """The variant's logits on `prompt` (the check's whole first context) equal the base
    config's (same weights): nothing bit."""
    from mlx.utils import tree_flatten

    base = variants.build(variant.key, arch_check.ARCHITECTURES[variant.key], seed)
    shapes = [(k, v.shape) for k, v in tree_flatten(model.parameters())]
    if shapes != [(k, v.shape) for k, v in tree_flatten(base.parameters())]:
        return False
    a, b = _logits(model, prompt), _logits(base, prompt)
    return a.shape == b.shape and mx.allclose(a, b, atol=1e-5).item()


def _built(variant: variants.Variant, seed: int):
    """(model, overrides used) for the first of the variant's configs mlx-lm builds and runs."""
    errors = []
    for over in [variant.overrides] + variant.candidates:
        try:
            model = variants.build(variant.key, variant.config(over), seed)
            mx.eval(model(mx.array([list(range(1, arch_check.PROMPT_LEN + 1))])))
            return model, over, None
        except Exception as e:  # mlx-lm's own args or forward reject this config
            errors.append(error_line(e)[:160])
    return None, None, errors[0]


def check(variant: variants.Variant, widths=WIDTHS, turns: bool = True, trees: bool = True,
          batches: bool = True) -> Result:
    from dflash_mlx.engine.batch_caches import batch_support
    from dflash_mlx.models.target.adapter import Target
    from dflash_mlx.models.target.tree_attention import tree_support

    start = time.perf_counter()
    result = Result(variant.name, variant.key, variant.kind, variant.option(), "degenerate")
    for seed in range(SEEDS):
        model, over, error = _built(variant, seed)
        if model is None:
            result.status, result.reason = "not built", f"mlx-lm: {error}"
            break
        if over is not variant.overrides:
            result.option = variants.Variant(variant.key, variant.kind, over).option()
        reason = arch_check.refusal(model)
        if reason is None:  # a target that serves this option only over short contexts refuses longer ones
            target = Target(model)
            if target.context_note and target.max_context < CONTEXT:
                reason = target.context_note
        if reason is not None:
            result.status, result.reason = "refused", reason
            break
        try:
            prompt, ref = arch_check.case(model)
        except AssertionError:
            continue  # near-constant continuations: the next seed
        ref = ref[:MAX_TOKENS]
        if len(ref) < MAX_TOKENS:
            try:
                prompt, ref = clean_case(model, len(prompt), MAX_TOKENS, seed=0)
            except AssertionError:
                continue  # every continuation ends at once: the next seed
        result.seed = seed
        result.inert = _inert(variant, model, seed, prompt + ref)
        target = Target(model)
        steps = [(str(w), lambda w=w: _widths(model, prompt, ref, [w])) for w in widths]
        if turns:
            steps.append(("turns", lambda: _turns(model, prompt, ref)))
        if any(f in over for f in variants.WINDOW_NAMES + (variants.CHUNK_NAME,)):
            steps.append(("short prompts", lambda: _short_prompts(model)))
        if trees and tree_support(target) is None:
            steps.append(("trees", lambda: _trees(model, prompt, ref)))
        if batches and batch_support(target) is None:
            steps.append(("batches", lambda: _batches(model, len(prompt))))
        wrong = None
        for what, step in steps:
            try:
                wrong = step()
            except Exception as e:  # DFlash failing where mlx-lm runs: as wrong as a wrong token
                wrong = f"{what}: raised {error_line(e)}"[:200]
            if wrong is not None:
                break
            result.checked.append(what)
        if wrong == TIE:  # the random model ties where the engine parted from it: the next seed
            result.checked, result.reason = [], f"mlx-lm's top two logits tie on seeds 0-{seed}"
            continue
        result.status, result.reason = ("exact", "") if wrong is None else ("mismatch", wrong)
        if result.inert:
            result.reason = (result.reason + "; " if result.reason else "") + INERT
        break
    else:
        result.reason = result.reason or f"greedy continuations near-constant for seeds 0-{SEEDS - 1}"
    result.seconds = round(time.perf_counter() - start, 2)
    return result
