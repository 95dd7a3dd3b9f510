"""Write a benchmark result: JSON (the record), Markdown tables, PNG plots."""

import json
from pathlib import Path
from typing import List, Optional

from dflash_mlx.bench.metrics import PHASES

# Required keys and their types, checked by `validate` (tests and readers of
# old result files rely on this shape; bump runner.SCHEMA when it changes).
_NUM = (int, float)
_OPT_NUM = (int, float, type(None))
TOP_KEYS = {"schema": str, "environment": dict, "config": dict, "forward_times_s": dict,
            "forward_context_tokens": int, "prompts": list, "summary": dict}
ENV_KEYS = {"date": str, "mlx_version": str, "backend": str, "cpu": str,
            "dtype": (str, type(None)), "blas": object, "gpu": object}
CONFIG_KEYS = {"suites": list, "limit": (int, type(None)), "max_tokens": int,
               "block_sizes": list, "temperature": _NUM, "seed": int, "greedy": bool,
               "model": str, "draft": str, "profile": bool}
BASELINE_KEYS = {"generated": int, "prefill_s": _NUM, "generation_s": _NUM, "tps": _NUM,
                 "tokens": list}
DFLASH_KEYS = {"block_size": (int, str), "generated": int,
               "generation_s": _NUM, "prefill_s": _NUM, "tps": _NUM, "cycles": int,
               "accept_lengths": list, "accept_hist": list,
               "tau": _NUM, "speedup": _NUM, "efficiency": _NUM, "limit": _OPT_NUM,
               "forward_ratio": _OPT_NUM, "tokens_match": (bool, type(None)),
               "cycle_split_s": (dict, type(None))}
SUMMARY_KEYS = {"prompts": int, "cycles": int, "tau": _NUM, "dflash_tps": _NUM,
                "baseline_tps": _NUM, "speedup": _NUM, "efficiency": _NUM,
                "limit": _OPT_NUM, "accept_hist": list, "cycle_split_s": (dict, type(None)),
                "mismatches": int}


def _check(obj: dict, keys: dict, where: str) -> List[str]:
    errors = []
    for k, t in keys.items():
        if k not in obj:
            errors.append(f"{where}: missing '{k}'")
        elif t is not object and not isinstance(obj[k], t):
            errors.append(f"{where}.{k}: {type(obj[k]).__name__} is not {t}")
    return errors


def validate(doc: dict) -> List[str]:
    """Schema errors of a result document (empty list: valid)."""
    errors = _check(doc, TOP_KEYS, "result")
    if errors:
        return errors
    errors += _check(doc["environment"], ENV_KEYS, "environment")
    errors += _check(doc["config"], CONFIG_KEYS, "config")
    blocks = [str(b) for b in doc["config"].get("block_sizes", [])]
    for i, row in enumerate(doc["prompts"]):
        where = f"prompts[{i}]"
        errors += _check(row, {"suite": str, "id": str, "prompt_tokens": int,
                               "baseline": dict, "dflash": dict}, where)
        if not isinstance(row.get("dflash"), dict):
            continue
        errors += _check(row.get("baseline", {}), BASELINE_KEYS, where + ".baseline")
        for b in blocks:
            rec = row["dflash"].get(b)
            if rec is None:
                errors.append(f"{where}.dflash: missing block size {b}")
                continue
            errors += _check(rec, DFLASH_KEYS, f"{where}.dflash[{b}]")
            # max_block_size: added with block size "auto"; older files have int blocks only
            size = rec.get("max_block_size") or (int(b) if b.isdigit() else None)
            if isinstance(rec.get("accept_hist"), list) and len(rec["accept_hist"]) != size:
                errors.append(f"{where}.dflash[{b}].accept_hist: length != block size")
            split = rec.get("cycle_split_s")
            if isinstance(split, dict) and set(split) != set(PHASES):
                errors.append(f"{where}.dflash[{b}].cycle_split_s: phases {sorted(split)}")
    for b in blocks:
        per = doc["summary"].get(b)
        if not isinstance(per, dict) or "all" not in per:
            errors.append(f"summary: missing block size {b} or its 'all' row")
            continue
        for suite, s in per.items():
            errors += _check(s, SUMMARY_KEYS, f"summary[{b}][{suite}]")
    return errors


# -- JSON ----------------------------------------------------------------------


def write_json(doc: dict, path: Path):
    path = Path(path)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)  # a partial file never replaces a complete one


# -- Markdown -------------------------------------------------------------------


def _f(x, fmt="{:.2f}", none="–"):
    return none if x is None else fmt.format(x)


def _x(x) -> str:
    return "–" if x is None else f"{x:.2f}x"


def _ms(split: Optional[dict], phase: str) -> str:
    return "–" if not split else f"{split[phase] * 1e3:.0f}"


def _spread(doc: dict, n: str) -> str:
    ts = (doc.get("forward_time_samples_s") or {}).get(n)
    return f" ({min(ts) * 1e3:.0f}–{max(ts) * 1e3:.0f})" if ts else ""


def _load_line(doc: dict) -> str:
    env = doc["environment"]
    threads = {k: v for k, v in (env.get("thread_env") or {}).items() if v}
    start, end, cpus = env.get("loadavg"), doc.get("loadavg_end"), env.get("cpu_count")
    line = (f"Machine load (1-min average) {_f(start, '{:.1f}', '?')} at start, "
            f"{_f(end, '{:.1f}', '?')} at end, {cpus} CPUs; BLAS threads "
            + (", ".join(f"{k}={v}" for k, v in threads.items()) or "default") + ".")
    if cpus and max(start or 0, end or 0) > cpus:
        line += " **The machine was shared: absolute timings are contended; ratios are less affected.**"
    return line


def markdown(doc: dict) -> str:
    env, cfg = doc["environment"], doc["config"]
    blocks = [str(b) for b in cfg["block_sizes"]]
    fwd = doc["forward_times_s"]
    lines = [
        f"# dflash-mlx benchmark — {cfg['model']} + draft {cfg['draft']}",
        "",
        f"{env['date']} · MLX {env['mlx_version']} ({env['backend']}) · BLAS {env.get('blas') or '?'} · "
        f"{env['cpu']}" + (f" · GPU {env['gpu']}" if env.get("gpu") else "") + f" · dtype {env['dtype']}",
        "",
        _load_line(doc),
        "",
        f"Suites {', '.join(cfg['suites'])}; {cfg['limit']} prompts each (seed {cfg['seed']}), "
        f"max {cfg['max_tokens']} tokens, temperature {cfg['temperature']}"
        + (" (greedy)" if cfg["greedy"] else f", draft proposals: {cfg.get('draft_sampling', 'argmax')}")
        + f", block sizes {', '.join(blocks)}.",
        (f"Command: `{cfg['command']}`" if cfg.get("command") else ""),
        "",
        "Baseline: mlx-lm `stream_generate` with the same target. tok/s exclude prefill. "
        "tau = tokens committed per target forward; efficiency = speed-up / tau; "
        "limit = tau · t(1-token forward) / t(B-token forward).",
        "",
        "Target forward times, median (min–max) of the samples taken before the first "
        "and after every prompt (context "
        f"{doc['forward_context_tokens']} tokens): "
        + ", ".join(f"{n} tok {t * 1e3:.1f} ms" + _spread(doc, n) for n, t in
                    sorted(fwd.items(), key=lambda kv: int(kv[0]))),
        "",
    ]
    for b in blocks:
        per = doc["summary"][b]
        lines += [
            f"## Block size {b}",
            "",
            "| suite | prompts | tau | baseline tok/s | DFlash tok/s | speed-up | efficiency | limit "
            "| draft ms | verify ms | rollback ms | other ms | mismatches |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for suite, s in per.items():
            split = s.get("cycle_split_s")
            name = f"**{suite}**" if suite == "all" else suite
            lines.append(
                f"| {name} | {s['prompts']} | {s['tau']:.2f} | {s['baseline_tps']:.1f} | "
                f"{s['dflash_tps']:.1f} | {s['speedup']:.2f}x | {s['efficiency']:.2f} | "
                f"{_x(s['limit'])} | {_ms(split, 'draft')} | {_ms(split, 'verify')} | "
                f"{_ms(split, 'rollback')} | {_ms(split, 'other')} | {s['mismatches']} |"
            )
        hist = per["all"]["accept_hist"]
        lines += ["", "Accept-length histogram (all suites): "
                  + ", ".join(f"{a}: {c}" for a, c in enumerate(hist) if c), ""]
        kinds = sorted({k for s in per.values() for k in (s.get("proposals") or {})})
        if kinds:
            lines += ["What the cycles verified (cycles / tokens committed): draft = the draft's block, "
                      "tree = a token tree from the draft's top-k, copy = a span copied from the context, "
                      "plain = a one-token step.", "",
                      "| suite | " + " | ".join(kinds) + " |", "|---|" + "---:|" * len(kinds)]
            for suite, s in per.items():
                counts = s.get("proposals") or {}
                lines.append(f"| {suite} | " + " | ".join(
                    "{} / {}".format(*counts[k]) if k in counts else "–" for k in kinds) + " |")
            lines.append("")
    if len(blocks) > 1:
        lines += ["## Block-size sweep (all suites)", "",
                  "| block | tau | DFlash tok/s | speed-up | efficiency | limit |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for b in blocks:
            s = doc["summary"][b]["all"]
            lines.append(f"| {b} | {s['tau']:.2f} | {s['dflash_tps']:.1f} | {s['speedup']:.2f}x | "
                         f"{s['efficiency']:.2f} | {_x(s['limit'])} |")
        lines.append("")
    bad = [(r["id"], b, rec) for r in doc["prompts"] for b, rec in r["dflash"].items()
           if rec.get("tokens_match") is False or rec.get("profiled_tokens_match") is False]
    lines += ["## Greedy token identity", ""]
    if not cfg["greedy"]:
        lines.append("Not checked (temperature > 0).")
    elif not bad:
        lines.append("DFlash tokens identical to the baseline for every prompt and block size.")
    else:
        lines.append("**MISMATCH** — DFlash output differs from plain decoding:")
        lines.append("")
        for pid, b, rec in bad:
            lines.append(f"- {pid}, block {b}: first differing token at index "
                         f"{rec.get('first_mismatch')}"
                         + ("" if rec.get("profiled_tokens_match") is not False
                            else " (profiled pass also differs from timed pass)"))
    lines += ["", "## Per prompt (first block size)", "",
              "| suite | prompt | prompt tok | generated | tau | baseline tok/s | DFlash tok/s "
              "| speed-up | match |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in doc["prompts"]:
        rec = r["dflash"][blocks[0]]
        match = {True: "yes", False: "**NO**", None: "–"}[rec["tokens_match"]]
        lines.append(f"| {r['suite']} | {r['id']} | {r['prompt_tokens']} | {rec['generated']} | "
                     f"{rec['tau']:.2f} | {r['baseline']['tps']:.1f} | {rec['tps']:.1f} | "
                     f"{rec['speedup']:.2f}x | {match} |")
    lines.append("")
    return "\n".join(lines)


# -- plots ---------------------------------------------------------------------


def plots(doc: dict, out_dir: Path) -> List[Path]:
    """PNG figures; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    blocks = [str(b) for b in doc["config"]["block_sizes"]]
    suites = [s for s in doc["summary"][blocks[0]] if s != "all"] + ["all"]
    title = f"{doc['config']['model']} ({doc['environment']['backend']})"
    written = []

    # speed-up and tau per suite, one bar per block size
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(blocks)
    for j, b in enumerate(blocks):
        xs = [i + (j - (len(blocks) - 1) / 2) * width for i in range(len(suites))]
        per = doc["summary"][b]
        axes[0].bar(xs, [per[s]["speedup"] for s in suites], width, label=f"B={b}")
        axes[1].bar(xs, [per[s]["tau"] for s in suites], width, label=f"B={b}")
    axes[0].axhline(1.0, color="k", lw=0.8, ls="--")
    axes[0].set_ylabel("speed-up vs mlx-lm (x)")
    axes[1].set_ylabel("tau (tokens / target forward)")
    for ax in axes:
        ax.set_xticks(range(len(suites)), suites, rotation=20)
        ax.legend()
    fig.suptitle(f"DFlash speed-up and tau per suite — {title}")
    fig.tight_layout()
    written.append(_save(fig, out_dir / "speedup_per_suite.png"))

    # accept-length histograms per suite at the first block size
    b = blocks[0]
    fig, axes = plt.subplots(1, len(suites), figsize=(3.2 * len(suites), 3), squeeze=False)
    for ax, s in zip(axes[0], suites):
        hist = doc["summary"][b][s]["accept_hist"]
        total = sum(hist) or 1
        ax.bar(range(len(hist)), [c / total for c in hist])
        ax.set_title(f"{s} (tau {doc['summary'][b][s]['tau']:.2f})")
        ax.set_xlabel("accepted draft tokens")
    axes[0][0].set_ylabel("fraction of cycles")
    fig.suptitle(f"Accept-length histogram, B={b} — {title}")
    fig.tight_layout()
    written.append(_save(fig, out_dir / "accept_hist.png"))

    # time per cycle, split by phase, per suite; baseline 1-token decode for scale
    if any(doc["summary"][b][s].get("cycle_split_s") for s in suites):
        fig, ax = plt.subplots(figsize=(1.3 * len(suites) + 4.5, 4))
        bottom = [0.0] * len(suites)
        for phase in PHASES:
            vals = [1e3 * ((doc["summary"][b][s].get("cycle_split_s") or {}).get(phase, 0.0))
                    for s in suites]
            ax.bar(suites, vals, bottom=bottom, label=phase)
            bottom = [x + v for x, v in zip(bottom, vals)]
        t1 = doc["forward_times_s"].get("1")
        if t1:
            ax.axhline(t1 * 1e3, color="k", ls="--", lw=0.8, label="1-token forward")
        ax.set_ylabel("ms per cycle")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.set_title(f"Time per DFlash cycle, B={b} — {title}")
        fig.tight_layout()
        written.append(_save(fig, out_dir / "time_split.png"))

    if len(blocks) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        fixed = [b for b in blocks if b.isdigit()]
        xs = [int(x) for x in fixed]
        for key, label in (("tau", "tau"), ("speedup", "speed-up"), ("limit", "limit")):
            ys = [doc["summary"][x]["all"][key] for x in fixed]
            if all(y is not None for y in ys):
                ax.plot(xs, ys, marker="o", label=label)
        if "auto" in blocks:  # one width per cycle, chosen by the engine: a level, not a point
            ax.axhline(doc["summary"]["auto"]["all"]["speedup"], color="C1", ls=":",
                       label="speed-up, auto width")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("block size")
        ax.legend()
        ax.set_title(f"Block-size sweep — {title}")
        fig.tight_layout()
        written.append(_save(fig, out_dir / "block_sweep.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(doc: dict, out_dir, with_plots: bool = True, json_too: bool = True) -> List[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if json_too:
        write_json(doc, out_dir / "results.json")
    (out_dir / "results.md").write_text(markdown(doc))
    paths = ([out_dir / "results.json"] if json_too else []) + [out_dir / "results.md"]
    if with_plots:
        paths += plots(doc, out_dir)
    return paths
