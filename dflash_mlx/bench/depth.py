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

import math
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from dflash_mlx.bench.documents import EVAL_DOCUMENTS, document_prompt, read_documents

SCHEMA = "dflash-mlx-bench-depth/1"
DEFAULT_DEPTHS = (256, 1024, 2048, 4096, 0)  # 0: as deep as the context window allows
# What two results must share to be merged (`merge`) or one continued (`--resume`).
MEASURED_WITH = ("max_tokens", "widths", "compare", "documents", "shared_plain_prefill", "repeats")


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


def geomean(xs: Sequence[float]) -> Optional[float]:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


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
        resume: Optional[dict] = None) -> dict:
    """`others`: label -> a loaded draft, run at the default width beside `draft`;
    `resume`: an interrupted run's results (its records are kept, the rest is measured)."""
    from dflash_mlx.policy import sizer
    from dflash_mlx.bench.runner import environment
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
                _log(f"  {k}: {o['decode_tps']:.2f} tok/s tau {o['tau'] or 0:.2f} ttft {o['ttft_s']:.1f}s")
            _log(f"depth {depth} {d.name}: plain {p['decode_tps']:.2f} tok/s ttft {_f(p['ttft_s'], '{:.1f}')}s | "
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


def merge(docs: Sequence[dict]) -> dict:
    """One result from runs that measured different depths with the same settings (a
    benchmark split across processes, one per core): records in depth order, summary
    recomputed, the elapsed time the longest run's."""
    keep = MEASURED_WITH + ("model", "draft")
    first = docs[0]
    for d in docs[1:]:
        differ = [k for k in keep if _setting(d, k) != _setting(first, k)]
        if differ or d["documents"] != first["documents"]:
            raise ValueError(f"depth results measured with other settings ({', '.join(differ) or 'documents'}) "
                             "do not merge")
    seen = set()
    records = []
    for d in docs:
        for r in d["records"]:
            if (r["depth"], r["document"]) in seen:
                raise ValueError(f"depth {r['depth']}, {r['document']} is measured twice")
            seen.add((r["depth"], r["document"]))
            records.append(r)
    records.sort(key=lambda r: r["depth"])
    depths = sorted({r["depth"] for r in records})
    out = dict(first)
    out["config"] = dict(first["config"], resolved_depths=depths,
                         command=" & ".join(d["config"].get("command", "") for d in docs))
    out["records"] = records
    out["elapsed_s"] = max(d.get("elapsed_s", 0.0) for d in docs)
    out["summary"] = summarize(records, first["config"]["widths"])
    return out


def _setting(doc: dict, key: str):
    """A result's setting; results from before `repeats` existed ran each setting once."""
    return doc["config"].get(key, 1 if key == "repeats" else None)


def _others(records: List[dict]) -> List[str]:
    return sorted({k[len("auto "):] for r in records for k in r["runs"] if k.startswith("auto ")})


def summarize(records: List[dict], widths: Sequence[int]) -> Dict[str, dict]:
    out = {}
    for depth in sorted({r["depth"] for r in records}):
        rows = [r for r in records if r["depth"] == depth]

        def speed(name, key="decode_tps"):
            return [r["runs"][name][key] / r["runs"]["plain"][key] for r in rows
                    if r["runs"][name][key] and r["runs"]["plain"][key]]

        fixed = {w: geomean(speed(f"block {w}")) for w in widths}
        best = max((w for w in widths if fixed[w]), key=lambda w: fixed[w], default=None)
        auto = geomean(speed("auto"))
        settled = Counter(r["settled_width"] for r in rows if r["settled_width"] is not None)
        out[str(depth)] = {
            "documents": len(rows),
            "plain_tps": geomean([r["runs"]["plain"]["decode_tps"] for r in rows]),
            "auto_tps": geomean([r["runs"]["auto"]["decode_tps"] for r in rows]),
            "speedup": auto,
            "speedup_cpu": geomean(speed("auto", "decode_tps_cpu")),
            "tau": geomean([r["runs"]["auto"]["tau"] for r in rows]),
            "ttft_plain_s": geomean([r["runs"]["plain"]["ttft_s"] for r in rows]),
            "ttft_auto_s": geomean([r["runs"]["auto"]["ttft_s"] for r in rows]),
            # on the documents whose plain prefill was timed too
            "ttft_ratio": geomean([r["runs"]["auto"]["ttft_s"] / r["runs"]["plain"]["ttft_s"] for r in rows
                                   if r["runs"]["plain"]["ttft_s"] and r["runs"]["auto"]["ttft_s"]]),
            "settled_widths": dict(sorted(settled.items())),
            "fixed_speedup": {str(w): fixed[w] for w in widths},
            "fixed_tau": {str(w): geomean([r["runs"][f"block {w}"]["tau"] for r in rows]) for w in widths},
            "best_fixed_width": best,
            "auto_vs_best_fixed": (auto / fixed[best]) if auto and best else None,
            "mismatches": sum(not run["identical"] for r in rows for run in r["runs"].values()),
            "others": {k: {"speedup": geomean(speed(f"auto {k}")),
                           "speedup_cpu": geomean(speed(f"auto {k}", "decode_tps_cpu")),
                           "tau": geomean([r["runs"][f"auto {k}"]["tau"] for r in rows]),
                           "ttft_s": geomean([r["runs"][f"auto {k}"]["ttft_s"] for r in rows])}
                       for k in _others(rows)},
        }
    return out


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def markdown(doc: dict) -> str:
    cfg, env = doc["config"], doc["environment"]
    widths = cfg["widths"]
    lines = [
        f"# Depth benchmark: {cfg['model']} with draft {cfg['draft']}",
        "",
        f"Held-out documents: {', '.join(d['name'] for d in doc['documents'])}; each cut so the whole "
        f"prompt is the depth's length, then one question. {cfg['max_tokens']} tokens, greedy, "
        "plain decoding (`baseline=True`) and the default width (`block_size=\"auto\"`) from empty "
        "caches, interleaved; fixed widths from the auto run's prompt cache"
        + ("; plain decoding's prefill timed on each depth's first document, the others decode from "
           "the auto run's target cache" if cfg.get("shared_plain_prefill", True) else "")
        + (f"; decode speeds the median of {cfg['repeats']} runs" if cfg.get("repeats", 1) > 1 else "")
        + ". Geometric means over documents; the width policy reset at each depth.",
        "",
        "| depth | docs | plain tok/s | auto tok/s | speed-up | tau | TTFT plain s | TTFT auto s | TTFT auto / plain | "
        "speed-up (CPU time) | auto settled on | " + " | ".join(f"block {w}" for w in widths)
        + " | auto / best fixed | identical |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|" + "---:|" * len(widths) + "---:|---|",
    ]
    for depth, s in doc["summary"].items():
        settled = ", ".join(f"{w} ({n})" for w, n in s["settled_widths"].items()) or "–"
        fixed = " | ".join(f"{_f(s['fixed_speedup'][str(w)])}x" for w in widths)
        lines.append(
            f"| {depth} | {s['documents']} | {_f(s['plain_tps'])} | {_f(s['auto_tps'])} | "
            f"**{_f(s['speedup'])}x** | {_f(s['tau'])} | {_f(s['ttft_plain_s'])} | {_f(s['ttft_auto_s'])} | "
            f"{_f(s['ttft_ratio'])} | "
            f"{_f(s['speedup_cpu'])}x | {settled} | {fixed} | {_f(s['auto_vs_best_fixed'], '{:.3f}')} (best: {s['best_fixed_width']}) | "
            f"{'yes' if not s['mismatches'] else 'NO: ' + str(s['mismatches'])} |")
    others = sorted({k for s in doc["summary"].values() for k in s.get("others", {})})
    if others:
        lines += ["", f"Other drafts beside the main draft (`{cfg['draft']}`, the table above), at the "
                  f"default width from empty caches: {', '.join(others)}.", "",
                  "| depth | draft | speed-up | speed-up (CPU time) | tau | TTFT s |", "|---:|---|---:|---:|---:|---:|"]
        for depth, s in doc["summary"].items():
            lines.append(f"| {depth} | {cfg['draft']} | {_f(s['speedup'])}x | {_f(s['speedup_cpu'])}x | "
                         f"{_f(s['tau'])} | {_f(s['ttft_auto_s'])} |")
            for k in others:
                o = s["others"].get(k)
                if o:
                    lines.append(f"| {depth} | {k} | {_f(o['speedup'])}x | {_f(o['speedup_cpu'])}x | "
                                 f"{_f(o['tau'])} | {_f(o['ttft_s'])} |")
    lines += [
        "",
        "Fixed-width columns: speed-up over plain decoding (geometric mean); tau at each: "
        + "; ".join(f"depth {d}: " + ", ".join(f"{w}: {_f(s['fixed_tau'][str(w)])}" for w in widths)
                    for d, s in doc["summary"].items()) + ".",
        "",
        f"Machine: {env.get('platform')}, {env.get('cpu_count')} cores, MLX {env.get('mlx_version')}, "
        f"BLAS {env.get('blas')}, threads {env.get('thread_env')}, load average "
        f"{env.get('loadavg')} at start, {env.get('loadavg_end')} at end, {doc.get('elapsed_s')} s.",
        "",
        f"Command: `{cfg.get('command')}`",
        "",
        "## Per document",
        "",
        "| depth | document | plain tok/s | auto tok/s | tau | TTFT plain / auto s | settled | auto's tokens "
        "(draft / tree / copy / plain) | " + " | ".join(f"block {w} tok/s" for w in widths) + " |",
        "|---:|---|---:|---:|---:|---|---:|---|" + "---:|" * len(widths),
    ]
    for r in doc["records"]:
        p, a = r["runs"]["plain"], r["runs"]["auto"]
        kinds = a.get("proposals") or {}
        split = " / ".join(str(kinds.get(k, [0, 0])[1]) for k in ("draft", "tree", "copy", "plain")) if kinds else "–"
        lines.append(
            f"| {r['depth']} | {r['document']} | {_f(p['decode_tps'])} | {_f(a['decode_tps'])} | {_f(a['tau'])} | "
            f"{_f(p['ttft_s'])} / {_f(a['ttft_s'])} | {r['settled_width']} | {split} | "
            + " | ".join(_f(r["runs"][f"block {w}"]["decode_tps"]) for w in widths) + " |")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    s = doc["summary"]
    depths = [int(d) for d in s]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ax = axes[0]
    ax.plot(depths, [s[str(d)]["speedup"] for d in depths], "o-", label="auto")
    for w in doc["config"]["widths"]:
        ax.plot(depths, [s[str(d)]["fixed_speedup"][str(w)] for d in depths], ".--", alpha=0.6, label=f"block {w}")
    others = sorted({k for v in s.values() for k in v.get("others", {})})
    for k in others:
        ax.plot(depths, [s[str(d)]["others"].get(k, {}).get("speedup") for d in depths], "s-", label=f"auto, {k}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="prompt tokens", ylabel="speed-up over plain", title="decode speed-up")
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.plot(depths, [s[str(d)]["tau"] for d in depths], "o-", label=doc["config"]["draft"])
    for k in others:
        ax.plot(depths, [s[str(d)]["others"].get(k, {}).get("tau") for d in depths], "s-", label=k)
    ax.legend(fontsize=7)
    ax.set(xscale="log", xlabel="prompt tokens", ylabel="tau (auto)", title="tokens per target forward")
    ax = axes[2]
    ax.plot(depths, [s[str(d)]["ttft_plain_s"] for d in depths], "o-", label="plain")
    ax.plot(depths, [s[str(d)]["ttft_auto_s"] for d in depths], "s--", label="auto")
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="seconds", title="time to first token")
    ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(depths, [str(d) for d in depths], minor=False)
        ax.set_xticks([], minor=True)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"{doc['config']['model']} + {doc['config']['draft']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(doc: dict, out_dir: Path, with_plot: bool = True) -> List[Path]:
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "README.md"]
    tmp = paths[0].with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(paths[0])
    paths[1].write_text(markdown(doc))
    if with_plot and doc["summary"]:
        p = plot(doc, out_dir / "depth.png")
        if p:
            paths.append(p)
    return paths


def mismatches(doc: dict) -> int:
    return sum(s["mismatches"] for s in doc["summary"].values())
