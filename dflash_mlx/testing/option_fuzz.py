"""Random engine options on random architectures, each case checked against mlx-lm's own greedy
decode: what no hand-written test combines (a width with a prefill chunk, a stop, a second turn on the
prompt cache, deterministic mode, mlx-lm's bounded KV cache, a prompt whose answer crosses the KV cache's
growth step; in the batch engine, rows joining a lone row after its rollbacks, second turns joining
together, the index of earlier answers). Drafts: DFlash (random), scripted, mlx-lm's small-model kind, none.

A case is a seed: `stream_case(seed)` decodes one prompt with `stream_generate`, `batch_case(seed)`
serves 2-5 requests through one `BatchEngine`, `split_case(seed, families)` decodes on a model
split over the ranks of an `mlx.launch` (`benchmarks/split_variants.py --fuzz`). Each returns a
row: "exact", "refused" (the one line the engine gave, for a prompt past the target's context
too), "no batch" (the target takes no batches, as `batch_support` says), "no split" (mlx-lm
gives the model no split), "not run" (mlx-lm cannot quantize the config or run it in the dtype drawn),
"mismatch" (where the tokens part) or "raised" (DFlash failed where mlx-lm runs). The tiny models
are `arch_check`'s; `benchmarks/option_fuzz.py` runs thousands, `tests/test_option_fuzz.py` a few.
"""

import contextlib
import random
import time
import traceback
from dataclasses import replace
from typing import List, Optional

import mlx.core as mx

from dflash_mlx.bench.metrics import first_mismatch
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.models.target.exact_rows import MLX_LM_PREFILL_STEP
from dflash_mlx.testing import arch_check, more_archs
from dflash_mlx.testing.foreign import foreign_case, foreign_forwards
from dflash_mlx.testing.quantized_variants import GROUP_SIZE, quantize
from dflash_mlx.testing.serving import serve
from dflash_mlx.testing.targets import (EOS_ID, RowScriptedDrafts, ScriptedDraft, byte_tokenizer, greedy_reference,
                                        small_draft_model)

STATUSES = ("exact", "refused", "no batch", "no split", "not run", "mismatch", "raised")
# Prompt lengths: one token, shorter and longer than the tiny configs' windows and chunks (8)
PROMPT_LENGTHS = (1, 2, 3, 5, 9, 20, 33)
# In about one case in eight, a prompt that crosses mlx-lm's KV-cache growth step (256 entries) as it
# decodes; drawn by a generator of its own, so that a seed's other draws stay what they were
LONG_PROMPTS = (250, 253)
LONG_SHARE = 0.12


def keys() -> List[str]:
    """The architectures a case draws from: every one this machine runs and DFlash takes."""
    return sorted(k for k in arch_check.ARCHITECTURES if k not in more_archs.NOT_RUN and k not in more_archs.REFUSED)


def _draft(kind: str, model, reference, rng):
    from dflash_mlx.models.draft.checkpoints import random_draft

    if kind == "random":
        return random_draft(model, num_layers=1, block_size=rng.choice([4, 8, 16]), seed=3)
    if kind == "scripted":  # right for a random number of tokens each cycle: every rollback length
        right = [rng.randrange(0, 16) for _ in range(400)]
        return ScriptedDraft(Target(model), reference, lambda c: right[c], block_size=16, layer_ids="every")
    return small_draft_model(model, rng.choice([1, 3, 7])) if kind == "autoregressive" else None


def _run(fn, row: dict) -> dict:
    from dflash_mlx.engine.engine import PromptTooLongError
    from dflash_mlx.models.target.rollback import UnsupportedTargetError

    start = time.perf_counter()
    try:
        fn(row)
    except (UnsupportedTargetError, PromptTooLongError) as e:
        row.update(status="refused", reason=str(e))
    except Exception:  # DFlash failing where mlx-lm runs: as wrong as a wrong token
        row.update(status="raised", reason=traceback.format_exc(limit=-3)[-1200:])
    row["seconds"] = round(time.perf_counter() - start, 3)
    return row


def _long_prompt(seed: int) -> Optional[int]:
    """A long prompt's length for the case of `seed`, or None (most cases)."""
    rng = random.Random(f"long prompt {seed}")
    return rng.choice(LONG_PROMPTS) if rng.random() < LONG_SHARE else None


def _parted(out, ref) -> str:
    i = first_mismatch(out, ref)
    return f"first difference at token {i} of {len(ref)}: {out[i:i + 4]} != mlx-lm's {ref[i:i + 4]}"


def stream_case(seed: int, guess: bool = False) -> dict:
    """`guess`: options drawn where drafted chains' successors are queued on the guess that they are
    accepted whole (`policy.lookahead`, forced on): longer answers, narrower widths, one host sync a
    cycle, a scripted draft right for a random number of tokens (often all of them)."""
    rng = random.Random(seed)
    row = dict(seed=seed, kind="stream", key=rng.choice(keys()))
    row["options"] = dict(block_size=rng.choice([1, 2, 3, 4, 7, 16, "auto", "draft"]),
                          split_head=rng.choice([None, True, False]), prefill_step_size=rng.choice([2, 3, 7, 2048]),
                          logprobs=rng.choice([None, 0, 2]), copy_proposals=rng.random() < 0.5,
                          token_trees=rng.random() < 0.5, deterministic=rng.choice([None, None, True]))
    row.update(prompt_len=rng.choice(PROMPT_LENGTHS), max_tokens=rng.choice([1, 2, 5, 12, 20]),
               draft=rng.choice(["random", "scripted", "scripted", "none", "autoregressive"]), turns=rng.random() < 0.3)
    row["prompt_len"] = _long_prompt(seed) or row["prompt_len"]
    extra = random.Random(f"stream extras {seed}")  # (apart, as the long prompt)
    row["options"]["profile"] = extra.random() < 0.1  # the engine syncs at each phase, launches nothing ahead
    row["suffix_index"] = extra.choice([None, None, None, "answer", "other"])  # earlier answers: this one's or not
    if row["suffix_index"]:  # (read only where copies are proposed)
        row["options"].update(block_size="auto", copy_proposals=True)
    # on the CPU, plain steps queued before the last is read (two cores or more) or after (one)
    row["queued_first"] = extra.random() < 0.5
    # every drafted chain's successor queued before its read, on the guess that it is accepted whole
    # (`policy.lookahead`: a pair's own look-ahead rarely learns it pays within a case this short)
    row["guess_whole"] = extra.random() < 0.5
    # bfloat16 (in deterministic mode: outside it a verify may round apart from a one-token step, as
    # docs/targets.md says) and 4- or 8-bit weights as `mlx_lm.convert -q` makes them
    row.update(dtype=rng.choice(["float32", "float32", "bfloat16"]), bits=rng.choice([None, None, None, 4, 8]))
    if row["dtype"] == "bfloat16":
        row["options"]["deterministic"] = True
    row["options"].update(_penalties(random.Random(f"penalties {seed}")))
    if (window := random.Random(f"window {seed}")).random() < 0.2:  # mlx-lm's bounded KV cache, a case in five
        row["options"]["max_kv_size"], row["turns"] = window.choice([5, 6, 8, 13, 32]), False
    row["foreign"] = foreign_case(seed, row["key"])  # mlx-lm's forwards on another thread meanwhile
    if guess:
        row["options"].update(block_size=extra.choice([2, 3, 4, 5, 8]), split_head=False, logprobs=None, profile=False)
        row.update(kind="guess", max_tokens=extra.choice([24, 40, 64]), draft=extra.choice(["scripted", "random"]),
                   guess_whole=True, queued_first=True)
    return _run(lambda r: _stream(r, rng), row)


def _penalties(rng: random.Random) -> dict:
    """mlx-lm's logits processors a case decodes under (a quarter of the cases; the tiny models' vocabulary
    is 258 tokens): `GenerationOptions`' fields, empty for none."""
    if rng.random() >= 0.25:
        return {}
    drawn = dict(repetition_penalty=rng.choice([1.1, 1.5, 3.0]), repetition_context_size=rng.choice([1, 4, 20, 64]),
                 presence_penalty=rng.choice([-0.5, 0.7, 2.0]), frequency_penalty=rng.choice([-1.0, 0.3, 1.5]),
                 logit_bias={rng.randrange(3, arch_check.VOCAB): rng.choice([-5.0, 2.0, 8.0])})
    return {k: v for k, v in drawn.items() if rng.random() < 0.5 or k == "repetition_penalty"}


def _processors(options: dict) -> list:
    from dataclasses import fields

    from dflash_mlx.options import GenerationOptions

    names = {f.name for f in fields(GenerationOptions)}
    return GenerationOptions(**{k: v for k, v in options.items() if k in names}).processors() or None


def split_case(seed: int, families) -> dict:
    """One case on a model split over the ranks of `mx.distributed.init()` (every rank runs the
    same seed together), against the split model's own greedy decode: a family of `families`
    under one of the parallelisms mlx-lm gives it ("no split" where it gives none)."""
    rng = random.Random(seed)
    row = dict(seed=seed, kind="split", key=rng.choice(sorted(families)), mode=rng.random())  # (a split it has)
    row["options"] = dict(block_size=rng.choice([1, 2, 4, 16, "auto", "draft"]),
                          split_head=rng.choice([None, True, False]), prefill_step_size=rng.choice([3, 7, 2048]),
                          logprobs=rng.choice([None, 2]), copy_proposals=rng.random() < 0.5,
                          token_trees=rng.random() < 0.5)
    row.update(prompt_len=rng.choice(PROMPT_LENGTHS), max_tokens=rng.choice([2, 5, 12, 20]),
               draft=rng.choice(["random", "scripted", "none"]), turns=rng.random() < 0.3)
    row["options"].update(_penalties(random.Random(f"penalties {seed}")))  # (every rank draws the same)
    return _run(lambda r: _stream(r, rng), row)


def _model_of(row: dict):
    """(the case's model, split where the case says, the caches its reference decodes with)."""
    from dflash_mlx.models.sharded import modes_of, split

    model = arch_check.build(row["key"])
    if "mode" not in row:
        if row.get("dtype", "float32") != "float32":
            model.set_dtype(getattr(mx, row["dtype"]))
        if row.get("bits"):
            quantize(model, {"quantization": {"group_size": GROUP_SIZE, "bits": row["bits"]}})
        Target(model)  # a refused target: its one line
        return model, None
    modes = [m for m, ok in zip(("tensor", "pipeline"), modes_of(model)) if ok]
    if not modes:
        return None, None
    row["mode"] = modes[int(row["mode"] * len(modes))]
    split(model, row["mode"])
    return model, Target(model).make_cache  # (built on every rank together: it agrees over the split)


@contextlib.contextmanager
def _queuing(queued_first: bool, guess_whole: bool, plain_steps: bool = False):
    """Inside: plain steps queued before the last is read (`queued_first`, on the CPU) or not, and
    with `guess_whole` every drafted chain's successor queued on the guess that it is accepted whole
    (`policy.lookahead`, forced on: a pair's own look-ahead rarely learns it pays within a case);
    `plain_steps`: plain steps' successors too (a batch's, and a lone row's where copies are on)."""
    from unittest import mock

    from dflash_mlx.engine import ahead
    from dflash_mlx.policy.lookahead import LookAhead

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(ahead, "BEFORE_READING_ON_CPU", queued_first))
        if guess_whole:
            patches.enter_context(mock.patch.object(LookAhead, "pays", lambda self, width: width > 1 or plain_steps))
        yield


def _stream(row: dict, rng: random.Random):
    from dflash_mlx import stream_generate
    from dflash_mlx.engine import ahead
    from dflash_mlx.generate import make_prompt_cache
    from dflash_mlx.models.target.probe import error_line
    from dflash_mlx.models.target.rollback import UnsupportedTargetError
    from dflash_mlx.policy.sizer import forget_sizers

    try:
        model, make_cache = _model_of(row)
    except UnsupportedTargetError:
        raise
    except Exception as e:  # mlx-lm cannot quantize the tiny config (its widths do not divide)
        row.update(status="not run", reason=f"mlx-lm: {error_line(e)}")
        return
    if model is None:
        row["status"] = "no split"
        return
    opts, max_tokens = row["options"], row["max_tokens"]
    bound = {"max_kv_size": opts["max_kv_size"]} if opts.get("max_kv_size") else {}
    # deterministic mode and a bounded cache prefill in mlx-lm's own chunks, whatever `prefill_step_size` says
    step = MLX_LM_PREFILL_STEP if opts.get("deterministic") or bound else opts["prefill_step_size"]
    prompt = [rng.randrange(3, arch_check.VOCAB) for _ in range(row["prompt_len"])]
    processors = _processors(opts)
    try:
        whole = greedy_reference(model, prompt, max_tokens, make_cache=make_cache, prefill_step_size=step,
                                 logits_processors=processors, **bound)
    except Exception as e:  # mlx-lm's own decode fails (MLX's CPU GatherMM takes float32 only)
        row.update(status="not run", reason=f"mlx-lm: {error_line(e)}")
        return
    stops = [rng.choice(whole)] if whole and rng.random() < 0.4 else []
    row["stops"] = stops
    stops += [EOS_ID]
    ref = greedy_reference(model, prompt, max_tokens, set(stops), make_cache, step, processors, **bound)
    draft = _draft(row["draft"], model, prompt + whole, rng)
    forget_sizers()
    cache = make_prompt_cache(model, draft) if row["turns"] else None
    index = _earlier_answers(model, row.get("suffix_index"), prompt, whole)

    def decode(ids, n, stop_ids):
        return [t for r in stream_generate(model, draft, byte_tokenizer(), ids, max_tokens=n, stop_token_ids=stop_ids,
                                           prompt_cache=cache, suffix_index=index, **opts) for t in r.tokens]

    with _queuing(row.get("queued_first", ahead.BEFORE_READING_ON_CPU), row.get("guess_whole", False)), \
            foreign_forwards(model, prompt[:8], row.get("foreign", False)) as foreign:
        out = decode(prompt, max_tokens, stops)
    if out != ref or foreign.fault():
        row.update(status="mismatch", reason=_parted(out, ref) if out != ref else foreign.fault())
        return
    row["status"] = "exact"
    # a second turn extending the first's prompt and answer, on its caches, against a fresh decode of the whole:
    # float32 only, where the reused entries round as a fresh prefill's do to the last bits or so (docs/targets.md);
    # never with a bounded cache (turns off when drawn), whose window a fresh decode fills in other chunks
    if row["turns"] and row.get("dtype", "float32") == "float32":
        extra = [rng.randrange(3, arch_check.VOCAB) for _ in range(rng.choice([1, 4, 9]))]
        if isinstance(draft, ScriptedDraft):  # (scripted for the first turn only)
            draft = _draft("random", model, None, rng)
            cache = make_prompt_cache(model, draft)
            decode(prompt, max_tokens, stops)
        # (its own generator: the cases drawn before it was added keep their options)
        cut = random.Random(row["seed"] * 31 + 7)
        if len(out) > 3 and cut.random() < 0.5:  # the first turn broken off: its cycle ahead discarded
            row["broken_off"] = cut.randrange(1, len(out) - 1)
            cache = make_prompt_cache(model, draft)
            with _queuing(row.get("queued_first", ahead.BEFORE_READING_ON_CPU), row.get("guess_whole", False)):
                out = _broken_off(stream_generate(model, draft, byte_tokenizer(), prompt, max_tokens=max_tokens,
                                                  stop_token_ids=stops, prompt_cache=cache, suffix_index=index,
                                                  **opts), row["broken_off"])
            if out != ref[: len(out)]:
                row.update(status="mismatch", reason="broken off: " + _parted(out, ref[: len(out)]))
                return
        turn2 = prompt + out + extra
        want = greedy_reference(model, turn2, 8, {EOS_ID}, make_cache, step, processors)
        second = decode(turn2, 8, [EOS_ID])
        if second != want:
            row.update(status="mismatch", reason="second turn: " + _parted(second, want))


def _broken_off(stream, after: int) -> List[int]:
    """The tokens `stream` gave until it had given `after` or more, then closed (as a client that
    hangs up)."""
    got = []
    for r in stream:
        got += r.tokens
        if len(got) >= after:
            break
    stream.close()
    return got


def _earlier_answers(model, kind, prompt, whole):
    """The index of earlier answers a stream case decodes with: None, or one holding this prompt
    and its whole answer past any stop ("answer": copies of it are right until they cross the stop
    or the budget) or another text that shares the prompt's last tokens ("other": copies are wrong)."""
    from dflash_mlx.speculation.suffix_index import SuffixIndex

    if kind is None:
        return None
    index = SuffixIndex(model=model)
    tail = prompt[-3:]
    index.add(prompt + whole if kind == "answer" else tail + [(t * 7 + 1) % arch_check.VOCAB for t in whole] + tail)
    return index


def batch_case(seed: int, guess: bool = False) -> dict:
    """`guess`: chains' successors queued on the guess that they are accepted whole (forced on) and
    plain steps queued first, while a row decodes alone (`stream_case`'s guess), and batched plain
    steps' successors queued before their read (`engine.batch_ahead`, forced on)."""
    rng = random.Random(seed)
    row = dict(seed=seed, kind="batch", key=rng.choice(keys()))
    row.update(prompt_lens=rng.sample(PROMPT_LENGTHS + (4, 6, 12, 17, 25), rng.choice([2, 3, 4, 5])),
               draft=rng.choice(["random", "scripted", "none", "autoregressive"]), join_every=rng.choice([1, 2, 3, 6]),
               turns=rng.random() < 0.5, suffix_index=rng.random() < 0.3)
    long = _long_prompt(seed)
    if long and long not in row["prompt_lens"]:
        row["prompt_lens"][0] = long
    row["options"] = dict(max_batch=rng.choice([2, 3, 4, 8]), prefill_chunk=rng.choice([2, 5, 16, 256]),
                          prefill_budget=rng.choice([3, 16, 512]), block_size=rng.choice([1, 2, 4, 6, 16, "auto"]),
                          copy_proposals=rng.random() < 0.5, token_trees=rng.random() < 0.5,
                          split_head=rng.choice([None, True, False]))
    row["foreign"] = foreign_case(seed, row["key"])  # mlx-lm's forwards on another thread meanwhile
    if guess:
        row.update(kind="batch guess", guess_whole=True)
    return _run(lambda r: _batch(r, rng), row)


def _batch(row: dict, rng: random.Random):
    from dflash_mlx.engine.batch_caches import batch_support
    from dflash_mlx.engine.engine import BatchEngine
    from dflash_mlx.engine.rows import BatchRequest
    from dflash_mlx.options import GenerationOptions
    from dflash_mlx.policy.sizer import forget_sizers
    from dflash_mlx.speculation.suffix_index import SuffixIndex

    model = arch_check.build(row["key"])
    if batch_support(Target(model)) is not None:
        row["status"] = "no batch"
        return
    cases, wants, requests = [], [], []
    drawn = random.Random(f"penalties {row['seed']}")  # (apart: the cases drawn before it keep their options)
    for length in row["prompt_lens"]:
        prompt = [rng.randrange(3, arch_check.VOCAB) for _ in range(length)]
        max_tokens = rng.choice([1, 3, 8, 15])
        penalties = _penalties(drawn)
        processors = _processors(penalties)
        whole = greedy_reference(model, prompt, max_tokens, logits_processors=processors)
        stops = ([rng.choice(whole)] if whole and rng.random() < 0.3 else []) + [EOS_ID]
        cases.append((prompt, whole))
        wants.append(greedy_reference(model, prompt, max_tokens, set(stops), logits_processors=processors))
        requests.append(BatchRequest(prompt, GenerationOptions(max_tokens=max_tokens, **penalties),
                                     stop_token_ids=stops))
    row["penalties"] = sum(bool(r.options.processors()) for r in requests)
    if row["draft"] == "scripted":  # (a row's reference is the case of its prompt's length)
        right = random.Random(row["seed"])
        draft = RowScriptedDrafts(Target(model), cases, lambda c: right.randrange(0, 9), block_size=8)
    else:
        draft = _draft(row["draft"], model, None, rng)
    forget_sizers()
    index = SuffixIndex(model=model) if row["suffix_index"] else None
    engine = BatchEngine(model, draft, byte_tokenizer(), suffix_index=index, **row["options"])
    # (its own generator: the cases drawn before it was added keep their options)
    cut = random.Random(row["seed"] * 31 + 11)
    cancel = {cut.randrange(len(requests)): cut.choice([1, 2, 3])} if cut.random() < 0.4 else None
    if cancel:  # a client hangs up after that many responses: its cycle launched ahead is discarded
        row["cancel"] = {str(i): n for i, n in cancel.items()}
    with _queuing(True, True, plain_steps=True) if row.get("guess_whole") else contextlib.nullcontext(), \
            foreign_forwards(model, requests[0].prompt_ids[:8], row.get("foreign", False)) as foreign:
        tokens, _, states = serve(engine, requests, row["join_every"], cancel, max_steps=5000)
    if foreign.fault():
        row.update(status="mismatch", reason=foreign.fault())
        return
    if cancel:  # what the cancelled request got must begin mlx-lm's answer
        wants = [w[: len(tokens[i])] if i in cancel else w for i, w in enumerate(wants)]
    wrong = [i for i in range(len(requests)) if tokens[i] != wants[i]]
    if wrong:
        i = wrong[0]
        row.update(status="mismatch", reason=f"request {i}: " + _parted(tokens[i], wants[i]))
        return
    row["status"] = "exact"
    if not row["turns"]:
        return
    # second turns, each extending a request's prompt and answer, on its prompt cache, joining together
    lengths, seconds, wants2 = set(row["prompt_lens"]), [], []
    for i, request in enumerate(requests):
        turn2 = request.prompt_ids + tokens[i] + [rng.randrange(3, arch_check.VOCAB) for _ in range(rng.choice([1, 4]))]
        while len(turn2) in lengths:  # (scripted drafts tell rows apart by their prompts' lengths)
            turn2.append(rng.randrange(3, arch_check.VOCAB))
        lengths.add(len(turn2))
        processors = request.options.processors() or None
        if row["draft"] == "scripted":
            draft.add_case(turn2, greedy_reference(model, turn2, 8, logits_processors=processors))
        wants2.append(greedy_reference(model, turn2, 8, {EOS_ID}, logits_processors=processors))
        seconds.append(BatchRequest(turn2, replace(request.options, max_tokens=8), stop_token_ids=[EOS_ID],
                                    prompt_cache=states[i]))
    with _queuing(True, True, plain_steps=True) if row.get("guess_whole") else contextlib.nullcontext():
        tokens, _, _ = serve(engine, seconds, row["join_every"], max_steps=5000)
    wrong = [i for i in range(len(seconds)) if tokens[i] != wants2[i]]
    if wrong:
        i = wrong[0]
        row.update(status="mismatch", reason=f"second turn of request {i}: " + _parted(tokens[i], wants2[i]))
