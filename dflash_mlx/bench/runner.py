"""Run DFlash against plain decoding, prompt by prompt, and collect traces.

Per prompt, in one go (so slow drift of a shared machine hits both sides alike):
plain decoding with mlx-lm's own `stream_generate`, then DFlash at each block
size; the order flips on every other prompt so neither side always runs on a
warmer cache. Same token ids, same budget, same sampler settings.

Timing and profiling are separate passes. `profile=True` makes the engine
evaluate at every phase boundary, which adds host syncs and so slows the
cycle; the timed pass therefore runs with profiling off (one sync per cycle,
as users run it) and a second, profiled pass of the same prompt gives the
draft/verify/rollback/other split. Under greedy decoding the profiled pass
must produce the same tokens; that is checked too.
"""

import functools
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

import mlx.core as mx

from dflash_mlx.generate import encode_prompt, stop_ids, tau
from dflash_mlx.options import AUTO, DRAFT_WIDTH, GenerationOptions, parse_block_size
from dflash_mlx.progress import eta_seconds, format_duration

from dflash_mlx.bench import metrics
from dflash_mlx.bench.environment import environment, loadavg
from dflash_mlx.bench.suites import Prompt, format_prompt, load_suite

SCHEMA = "dflash-mlx-bench/1"


@dataclass
class BenchConfig:
    suites: List[str]
    limit: Optional[int] = 10
    max_tokens: int = 256
    # "auto": the engine's adaptive verify width (the default); "draft": the draft's own; or widths
    block_sizes: List[Union[int, str]] = field(default_factory=lambda: [AUTO])
    temperature: float = 0.0
    top_p: float = 1.0  # sampling filters, as in dflash_mlx.options (off by default)
    top_k: int = 0
    min_p: float = 0.0
    draft_sampling: str = "argmax"  # proposal mode at temperature > 0 (see dflash_mlx.speculation.accept)
    seed: int = 0
    # mlx-lm's logits processors on both engines: `GenerationOptions`' penalty and logit bias fields
    penalties: Dict[str, Any] = field(default_factory=dict)
    warmup: bool = True
    profile: bool = True  # run the extra profiled pass for the time split
    forward_reps: int = 5
    model: str = ""
    draft: str = ""
    data_dir: Optional[str] = None
    command: str = ""  # the command line, so a result says how to rerun it


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


# -- streams -----------------------------------------------------------------


def collect(responses: Iterable, stops: Iterable[int] = ()) -> metrics.Trace:
    """Drain a response stream (mlx-lm's or ours) into a Trace, timing it here.

    Timing is taken at the client, the same way for both engines: the clock
    starts before the call, the first response marks the end of the prefill.
    """
    tokens: List[int] = []
    sums: Dict[str, float] = {}
    profiled = 0
    last = None
    first_tokens = 0
    tic = time.perf_counter()
    t_first = t_last = tic
    for r in responses:
        now = time.perf_counter()
        new = list(r.tokens) if getattr(r, "tokens", None) is not None else [r.token]
        if last is None:
            t_first = now
            first_tokens = len(new)
        tokens.extend(new)
        t_last = now
        ct = getattr(r, "cycle_times", None)
        if ct and getattr(r, "accept_length", None) is not None:
            for k, v in ct.items():
                sums[k] = sums.get(k, 0.0) + v
            profiled += 1
        last = r
    if last is None:
        raise RuntimeError("the generation stream produced no response")
    # Engines differ on whether a final EOS is emitted; both spent a forward on
    # it, but only the text before it is compared and counted.
    kept = metrics.strip_stop(tokens, stops)
    return metrics.Trace(
        tokens=kept,
        prompt_tokens=last.prompt_tokens,
        first_tokens=min(first_tokens, len(kept)),
        prefill_s=t_first - tic,
        generation_s=t_last - t_first,
        accept_lengths=list(getattr(last, "accept_lengths", None) or []),
        cycle_times=sums or None,
        profiled_cycles=profiled,
        finish_reason=last.finish_reason,
        proposals=dict(getattr(last, "proposal_counts", None) or {}) or None,
    )


def baseline_stream(model, tokenizer, ids: List[int], max_tokens: int,
                    temperature: float, seed: int, top_p: float = 1.0, top_k: int = 0,
                    min_p: float = 0.0, penalties: Optional[dict] = None):
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    processors = GenerationOptions(**penalties).processors() if penalties else None
    return stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens,
                           sampler=make_sampler(temp=temperature, top_p=top_p, min_p=min_p,
                                                top_k=top_k), logits_processors=processors)


def dflash_stream(model, draft, tokenizer, ids: List[int], max_tokens: int,
                  block_size: Union[int, str, None], temperature: float, seed: int,
                  profile: bool, draft_sampling: str = "argmax", top_p: float = 1.0,
                  top_k: int = 0, min_p: float = 0.0, penalties: Optional[dict] = None):
    from dflash_mlx.generate import stream_generate

    return stream_generate(model, draft, tokenizer, ids, max_tokens=max_tokens,
                           block_size=block_size, temperature=temperature, top_p=top_p,
                           top_k=top_k, min_p=min_p, seed=seed, profile=profile,
                           draft_sampling=draft_sampling, **(penalties or {}))


# -- direct forward timing ---------------------------------------------------


def measure_forward_times(model, context: List[int], sizes: Iterable[int],
                          reps: int = 5, warmup: bool = True) -> Dict[int, List[float]]:
    """Seconds of one target forward of n tokens after `context`, `reps` samples per n.

    A DFlash cycle's verify is one n=B forward; plain decoding is n=1. Both run
    on a cache holding the context, then the cache is rolled back so every
    repetition sees the same length. Sizes are timed round-robin, so a burst of
    load from other processes hits every size rather than one.
    """
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

    def fresh():
        cache = make_prompt_cache(model)
        model(mx.array(context)[None], cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    sizes = sorted(set(sizes))
    cache = fresh()
    trimmable = can_trim_prompt_cache(cache)
    out: Dict[int, List[float]] = {n: [] for n in sizes}
    skip = 1 if warmup else 0
    for i in range(reps + skip):  # the first round warms up
        for n in sizes:
            if not trimmable:
                cache = fresh()
            x = mx.array(context[-1:] * n)[None]
            tic = time.perf_counter()
            mx.eval(model(x, cache=cache))
            dt = time.perf_counter() - tic
            if trimmable:
                trim_prompt_cache(cache, n)
            if i >= skip:
                out[n].append(dt)
    return out


# -- the run -------------------------------------------------------------------


def _dflash_record(trace: metrics.Trace, base: metrics.Trace, block: Union[int, str],
                   ratio: Optional[float], greedy: bool, stops,
                   profiled: Optional[metrics.Trace], max_block: Optional[int] = None) -> dict:
    max_block = block if isinstance(block, int) else max_block
    d_tps, b_tps = metrics.generation_tps(trace), metrics.generation_tps(base)
    t = tau(trace.accept_lengths)
    s = metrics.speedup(d_tps, b_tps)
    mismatch = metrics.first_mismatch(trace.tokens, base.tokens, stops) if greedy else None
    rec = {
        "block_size": block,
        "max_block_size": max_block,
        "prompt_tokens": trace.prompt_tokens,
        "prefill_s": trace.prefill_s,
        "prefill_tps": metrics.prefill_tps(trace),
        "generated": trace.generated,
        "generation_s": trace.generation_s,
        "tps": d_tps,
        "cycles": len(trace.accept_lengths),
        "accept_lengths": trace.accept_lengths,
        "accept_hist": metrics.accept_histogram(trace.accept_lengths, max_block),
        "tau": t,
        "speedup": s,
        "efficiency": metrics.efficiency(s, t),
        "forward_ratio": ratio,
        "limit": t * ratio if ratio else None,
        "tokens_match": (mismatch is None) if greedy else None,
        "first_mismatch": mismatch,
        "finish_reason": trace.finish_reason,
        "proposals": trace.proposals,  # kind ("draft" | "tree" | "copy" | "plain") -> [cycles, tokens committed]
        "baseline_generated": base.generated,
        "baseline_generation_s": base.generation_s,
        "baseline_prefill_s": base.prefill_s,
        "cycle_time_sums": None,
        "profiled_cycles": 0,
        "cycle_split_s": None,
        "profiled_tokens_match": None,
    }
    if mismatch is not None:
        rec["tokens"] = trace.tokens
    if profiled is not None:
        rec["cycle_time_sums"] = profiled.cycle_times
        rec["profiled_cycles"] = profiled.profiled_cycles
        rec["cycle_split_s"] = metrics.per_cycle(profiled.cycle_times, profiled.profiled_cycles)
        if greedy:
            rec["profiled_tokens_match"] = metrics.first_mismatch(
                profiled.tokens, trace.tokens, stops) is None
    return rec


def run(model, draft, tokenizer, cfg: BenchConfig,
        prompts: Optional[List[Prompt]] = None,
        on_prompt: Optional[Callable[[dict], None]] = None,
        log: Callable[[str], None] = _log,
        baseline_fn=None, dflash_fn=None) -> dict:
    """Benchmark every prompt; returns the result document (see report.validate).

    `baseline_fn` / `dflash_fn` replace the two engines (tests use scripted drafts).
    """
    # the sampling filters go to both engines alike; only set ones, so that a
    # test's stand-in engine without them still fits
    off = {"top_p": 1.0, "top_k": 0, "min_p": 0.0}
    filters = {k: getattr(cfg, k) for k in off if getattr(cfg, k) != off[k]}
    if cfg.penalties:
        filters["penalties"] = cfg.penalties
    if baseline_fn is None:
        baseline_fn = functools.partial(baseline_stream, **filters)
    if dflash_fn is None:
        proposals = {} if cfg.draft_sampling == "argmax" else {"draft_sampling": cfg.draft_sampling}
        dflash_fn = functools.partial(dflash_stream, **proposals, **filters)
    if prompts is None:
        prompts = [p for s in cfg.suites
                   for p in load_suite(s, cfg.limit, cfg.seed, cfg.data_dir)]
    if not prompts:
        raise ValueError("no prompts to run")
    blocks = [parse_block_size(b) for b in cfg.block_sizes]
    blocks = [draft.block_size if b == DRAFT_WIDTH else b for b in blocks]
    blocks = list(dict.fromkeys(blocks))  # keep order, drop repeats
    fixed = [b for b in blocks if b != "auto"]
    # "auto" varies the width per cycle: its histogram spans the draft's block,
    # and it has no single verify width, so no limit.
    max_block = draft.block_size if "auto" in blocks else None
    greedy = cfg.temperature == 0
    stops = stop_ids(tokenizer)
    encoded = [encode_prompt(tokenizer, format_prompt(tokenizer, p)) for p in prompts]

    # Target forward times at a realistic context: the median prompt length.
    # Sampled up front and again after every prompt, so on a shared machine the
    # forward times see the same load as the generations they are compared with.
    ctx = sorted(encoded, key=len)[len(encoded) // 2]
    widths = ", ".join(str(w) for w in [1, *fixed])
    log(f"timing target forwards of {widths} token{'s' if fixed else ''} after {len(ctx)} context tokens")
    samples = measure_forward_times(model, ctx, [1, *fixed], reps=cfg.forward_reps)

    def ratios():
        fwd = {n: statistics.median(ts) for n, ts in samples.items()}
        return fwd, {b: fwd[1] / fwd[b] if b in fwd else None for b in blocks}

    fwd, ratio = ratios()

    if cfg.warmup:
        # Compile kernels and fill allocator pools before anything is timed.
        n = min(8, cfg.max_tokens)
        collect(baseline_fn(model, tokenizer, encoded[0], n, cfg.temperature, cfg.seed))
        for b in blocks:
            collect(dflash_fn(model, draft, tokenizer, encoded[0], n, b,
                              cfg.temperature, cfg.seed, False))

    doc = {
        "schema": SCHEMA,
        "environment": environment(model),
        "config": {**asdict(cfg), "block_sizes": blocks, "greedy": greedy},
        "forward_times_s": {str(k): v for k, v in fwd.items()},  # medians
        "forward_time_samples_s": {str(k): v for k, v in samples.items()},
        "forward_context_tokens": len(ctx),
        "prompts": [],
        "summary": {},
    }
    start = time.perf_counter()
    for i, (p, ids) in enumerate(zip(prompts, encoded)):
        def base_pass():
            return collect(baseline_fn(model, tokenizer, ids, cfg.max_tokens,
                                       cfg.temperature, cfg.seed), stops)

        def dflash_pass(b, profile):
            return collect(dflash_fn(model, draft, tokenizer, ids, cfg.max_tokens, b,
                                     cfg.temperature, cfg.seed, profile), stops)

        if i % 2 == 0:
            base = base_pass()
            timed = {b: dflash_pass(b, False) for b in blocks}
        else:
            timed = {b: dflash_pass(b, False) for b in blocks}
            base = base_pass()
        profiled = {b: dflash_pass(b, True) if cfg.profile else None for b in blocks}

        row = {
            "suite": p.suite,
            "id": p.id,
            "prompt_tokens": len(ids),
            "baseline": {
                "generated": base.generated,
                "prefill_s": base.prefill_s,
                "prefill_tps": metrics.prefill_tps(base),
                "generation_s": base.generation_s,
                "tps": metrics.generation_tps(base),
                "finish_reason": base.finish_reason,
                "tokens": base.tokens,
            },
            "dflash": {
                str(b): _dflash_record(timed[b], base, b, ratio[b], greedy, stops, profiled[b],
                                       max_block)
                for b in blocks
            },
        }
        doc["prompts"].append(row)
        for n, ts in measure_forward_times(model, ctx, [1, *fixed], reps=1,
                                           warmup=False).items():
            samples[n].extend(ts)
        fwd, ratio = ratios()
        _set_forward(doc, fwd, samples, ratio)
        doc["summary"] = summarize(doc["prompts"], blocks)
        if on_prompt is not None:
            on_prompt(doc)

        elapsed = time.perf_counter() - start
        first = row["dflash"][str(blocks[0])]
        bad = [b for b, rec in row["dflash"].items() if rec["tokens_match"] is False]
        flag = f"  MISMATCH (B={','.join(bad)})" if bad else ""
        log(f"[{i + 1:>3}/{len(prompts)}] {p.id:<24} B={blocks[0]} "
            f"tau {first['tau']:.2f}  {first['tps']:.1f} vs {row['baseline']['tps']:.1f} tok/s "
            f"({first['speedup']:.2f}x){flag}  elapsed {format_duration(elapsed)}  "
            f"ETA {format_duration(eta_seconds(i + 1, len(prompts), elapsed))}")
    doc["wall_s"] = time.perf_counter() - start
    doc["loadavg_end"] = loadavg()
    return doc


def _set_forward(doc: dict, fwd, samples, ratio):
    """Store forward times and re-derive every record's limit from the current medians."""
    doc["forward_times_s"] = {str(k): v for k, v in fwd.items()}
    doc["forward_time_samples_s"] = {str(k): list(v) for k, v in samples.items()}
    for row in doc["prompts"]:
        for b, rec in row["dflash"].items():
            r = ratio[rec["block_size"]]
            rec["forward_ratio"] = r
            rec["limit"] = rec["tau"] * r if r else None


def summarize(rows: List[dict], blocks: List[Union[int, str]]) -> dict:
    """summary[B][suite | "all"] = pooled metrics (see metrics.aggregate)."""
    out = {}
    for b in blocks:
        recs = [(r["suite"], {**r["dflash"][str(b)], "suite": r["suite"]}) for r in rows]
        per = {}
        for suite in dict.fromkeys(s for s, _ in recs):
            per[suite] = metrics.aggregate([x for s, x in recs if s == suite])
        per["all"] = metrics.aggregate([x for _, x in recs])
        out[str(b)] = per
    return out
