"""The depth suite: DFlash against plain decoding of the same target, deep into a context.

A held-out long document (`dflash_mlx.bench.documents.EVAL_DOCUMENTS`) is cut so that the
whole prompt (chat template, document, question) is exactly `depth` tokens, then the
model answers. At each depth, for each document, in one process and interleaved (the
order of plain and DFlash flips from document to document):

- plain decoding (`baseline=True`) and the default width (`block_size="auto"`), each
  from an empty cache: time to first token (TTFT, the prefill) and decode tok/s;
- fixed widths (`widths`), from the default width's prompt cache (the prompt's prefix
  is reused, so only decode is paid again): what the best fixed width would have done.

The width policy is reset at each depth (`sizer.forget_sizers`), so each depth pays
its own exploration, as a first long request would; within a depth it carries over
from one document to the next, as in a chat. Every run must return plain decoding's
tokens exactly (greedy); a difference is reported and makes the exit status 1.
Per depth: geometric means over documents of speed-up, tau and TTFT, the width the
policy settled on (its most used width in the second half of each answer's cycles)
and its speed against the best fixed width.
"""

import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

from dflash_mlx.bench.depth_report import fmt
from dflash_mlx.bench.depth_summary import summarize
from dflash_mlx.bench.documents import EVAL_DOCUMENTS, document_prompt, read_documents

SCHEMA = "dflash-mlx-bench-depth/1"
DEFAULT_DEPTHS = (256, 1024, 2048, 4096, 0)  # 0: as deep as the context window allows


@dataclass
class DepthConfig:
    depths: List[int] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    documents: int = 3  # per depth
    max_tokens: int = 32
    widths: List[int] = field(default_factory=lambda: [2, 4, 8])
    # other drafts run beside the first at the default width, each from an empty cache
    # (a before/after comparison in one process); label -> draft name or folder
    compare: Dict[str, str] = field(default_factory=dict)
    shared_plain_prefill: bool = True  # plain decoding's TTFT on each depth's first document only
    # decode runs per setting and document: decode speeds are their median, TTFT, tau and widths
    # the first run's (one 32-token run moves by ~10% on a shared 2-core machine)
    repeats: int = 1
    warmup: bool = True
    model: str = ""
    draft: str = ""
    command: str = ""


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def resolve_depths(depths: Sequence[int], context: Optional[int], max_tokens: int) -> List[int]:
    """Depths as prompt lengths: 0 means the window less the answer (and a small margin)."""
    window = context or 8192
    deepest = window - max_tokens - 8
    out = []
    for d in depths:
        d = deepest if d == 0 else d
        if d > deepest:
            raise ValueError(f"depth {d} leaves no room for {max_tokens} answer tokens in a "
                             f"{window}-token window: use at most {deepest} (or 0)")
        out.append(d)
    return out


def prompt_at_depth(tokenizer, doc, depth: int) -> List[int]:
    """Exactly `depth` token ids: template + the document's first tokens + the first question."""
    return document_prompt(tokenizer, doc, depth, 0)


def _run(stream) -> dict:
    """Tokens, TTFT, decode tok/s, accept lengths and verify widths of one generation."""
    tokens, accepts, widths = [], [], []
    tic = time.perf_counter()
    t_first = t_last = c_first = c_last = None
    r = None
    for r in stream:
        now, cpu = time.perf_counter(), time.process_time()
        tokens.extend(r.tokens)
        if t_first is None:
            t_first, c_first = now, cpu
        else:
            accepts.append(r.accept_length)
            widths.append(r.verify_width)
        t_last, c_last = now, cpu
    decoded = len(tokens) - 1
    gen_s = (t_last - t_first) if t_first is not None else 0.0
    cpu_s = (c_last - c_first) if c_first is not None else 0.0
    return {
        "tokens": tokens,
        "ttft_s": (t_first - tic) if t_first is not None else None,
        "decode_tps": decoded / gen_s if gen_s > 0 and decoded > 0 else None,
        # this process's CPU time: on a shared machine it moves far less with the load
        "decode_tps_cpu": decoded / cpu_s if cpu_s > 0 and decoded > 0 else None,
        "tau": (sum(a + 1 for a in accepts) / len(accepts)) if accepts else None,
        "accept_lengths": accepts,
        "widths": widths,
        # kind ("draft" | "tree" | "copy" | "plain") -> [cycles, tokens committed]
        "proposals": dict(getattr(r, "proposal_counts", None) or {}),
    }


def settled_width(widths: Sequence[int]) -> Optional[int]:
    """The width used most in the second half of an answer's cycles."""
    late = list(widths)[len(widths) // 2:]
    return Counter(late).most_common(1)[0][0] if late else None


def run(model, draft, tokenizer, cfg: DepthConfig, on_record=None, others: Optional[Dict[str, object]] = None,
        resume: Optional[dict] = None, log=_log) -> dict:
    """`others`: label -> a loaded draft, run at the default width beside `draft`;
    `resume`: an interrupted run's results (its records are kept, the rest is measured);
    `log`: where progress lines go."""
    from dflash_mlx.policy import sizer
    from dflash_mlx.bench.environment import environment
    from dflash_mlx.generate import make_prompt_cache, stream_generate
    from dflash_mlx.models.target.adapter import target_for

    docs, missing = read_documents(EVAL_DOCUMENTS)
    if len(docs) < cfg.documents:
        raise ValueError(f"the depth suite needs {cfg.documents} documents, found {len(docs)} "
                         f"(missing: {', '.join(missing)})")
    docs = docs[: cfg.documents]
    depths = resolve_depths(cfg.depths, target_for(model, draft).max_context, cfg.max_tokens)
    doc = {
        "schema": SCHEMA,
        "config": asdict(cfg) | {"resolved_depths": depths},
        "environment": environment(model),
        "documents": [{"name": d.name, "kind": d.kind, "sha256": d.sha256} for d in docs],
        "records": [],
        "summary": {},
    }
    started = time.perf_counter()

    def plain(ids):
        return _run(stream_generate(model, draft, tokenizer, ids, max_tokens=cfg.max_tokens, baseline=True))

    others = dict(others or {})

    def dflash(ids, block, cache, d=None):
        return _run(stream_generate(model, d or draft, tokenizer, ids, max_tokens=cfg.max_tokens,
                                    block_size=block, prompt_cache=cache))

    if cfg.warmup:
        ids = prompt_at_depth(tokenizer, docs[0], 128)
        plain(ids)
        dflash(ids, "auto", None)
        for d in others.values():
            dflash(ids, "auto", None, d)
        sizer.forget_sizers()

    n = 0
    done = {(r["depth"], r["document"]): r for r in (resume or {}).get("records", [])}
    for depth in depths:
        sizer.forget_sizers()
        for i, d in enumerate(docs):
            if (depth, d.name) in done:  # measured by the run this one continues
                doc["records"].append(done[(depth, d.name)])
                n += 1
                continue
            ids = prompt_at_depth(tokenizer, d, depth)
            cache = make_prompt_cache(model, draft)
            other_caches = {k: make_prompt_cache(model, o) for k, o in others.items()}
            runs: Dict[str, dict] = {}
            # The first document at a depth times plain decoding's prefill (TTFT) from an
            # empty cache; the others decode from the auto run's target cache (a prefill
            # at depth costs minutes here and plain decoding's TTFT is the same for each).
            order = ["plain", "auto"] + [f"auto {k}" for k in others]
            order = order[n % len(order):] + order[: n % len(order)]  # rotates from document to document
            if i > 0 and cfg.shared_plain_prefill:
                order.remove("plain")
            for name in order:
                if name == "plain":
                    runs[name] = plain(ids)
                elif name == "auto":
                    runs[name] = dflash(ids, "auto", cache)
                else:
                    k = name[len("auto "):]
                    runs[name] = dflash(ids, "auto", other_caches[k], others[k])
            for w in cfg.widths:  # the prompt's prefix comes from the auto run's cache
                runs[f"block {w}"] = dflash(ids, w, cache)

            def decode_again(name):
                """`name` once more from its prompt cache (its prefill is not paid again)."""
                if name == "plain":
                    from dflash_mlx.engine.prompt_cache import PromptCache

                    shared = PromptCache(model=model, target_cache=cache.target_cache, tokens=list(cache.tokens))
                    return _run(stream_generate(model, draft, tokenizer, ids, max_tokens=cfg.max_tokens,
                                                baseline=True, prompt_cache=shared))
                if name == "auto":
                    return dflash(ids, "auto", cache)
                if name.startswith("auto "):
                    k = name[len("auto "):]
                    return dflash(ids, "auto", other_caches[k], others[k])
                return dflash(ids, int(name[len("block "):]), cache)

            if "plain" not in runs:
                runs["plain"] = decode_again("plain")
                runs["plain"]["ttft_s"] = None  # 1 prompt token run: no TTFT
            ref = runs["plain"]["tokens"]
            names = list(runs)
            for name in names:
                for key in ("decode_tps", "decode_tps_cpu"):
                    runs[name][key + "_runs"] = [runs[name][key]]
            for repeat in range(1, cfg.repeats):
                for name in names[repeat % len(names):] + names[: repeat % len(names)]:
                    again = decode_again(name)
                    if again["tokens"] != ref:
                        runs[name]["tokens"] = again["tokens"]  # reported as a mismatch below
                    for key in ("decode_tps", "decode_tps_cpu"):
                        runs[name][key + "_runs"].append(again[key])
            for name in names:
                for key in ("decode_tps", "decode_tps_cpu"):
                    measured = [x for x in runs[name][key + "_runs"] if x]
                    runs[name][key] = statistics.median(measured) if measured else None
            rec = {"depth": depth, "document": d.name, "prompt_tokens": len(ids), "runs": {}}
            for name, r in runs.items():
                r = dict(r)
                r["identical"] = r["tokens"] == ref
                if name != "plain":
                    r.pop("tokens")
                rec["runs"][name] = r
            rec["settled_width"] = settled_width(runs["auto"]["widths"])
            doc["records"].append(rec)
            n += 1
            a, p = runs["auto"], runs["plain"]
            for k in others:
                o = runs[f"auto {k}"]
                log(f"  {k}: {o['decode_tps']:.2f} tok/s tau {o['tau'] or 0:.2f} ttft {o['ttft_s']:.1f}s")
            log(f"depth {depth} {d.name}: plain {p['decode_tps']:.2f} tok/s ttft {fmt(p['ttft_s'], '{:.1f}')}s | "
                 f"auto {a['decode_tps']:.2f} tok/s tau {a['tau'] or 0:.2f} ttft {a['ttft_s']:.1f}s "
                 f"width {rec['settled_width']} | "
                 + " ".join(f"{w}: {runs[f'block {w}']['decode_tps']:.2f}" for w in cfg.widths)
                 + f" [{time.perf_counter() - started:.0f}s]")
            doc["summary"] = summarize(doc["records"], cfg.widths)
            if on_record is not None:
                on_record(doc)
    doc["elapsed_s"] = round(time.perf_counter() - started, 1)
    doc["environment"]["loadavg_end"] = environment(model)["loadavg"]
    doc["summary"] = summarize(doc["records"], cfg.widths)
    return doc
