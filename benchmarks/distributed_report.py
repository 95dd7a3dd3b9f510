"""README.md and the plot of a `distributed_bench.py` run, from its results.json (rerun with --report-only)."""

import json
from collections import Counter
from pathlib import Path
from statistics import mean
from typing import List, Optional, Tuple

HOPS = {"all_sum": 2, "all_max": 2, "all_min": 2, "sum_scatter": 1, "all_gather": 1, "recv": 1, "recv_like": 1,
        "send": 0}  # one-way trips on rank 0's critical path per op, 2 ranks (ring: all_sum = reduce + gather)

# Published per-operation figures for Macs linked by Thunderbolt (read, not measured here).
PUBLISHED = [
    ("JACCL (RDMA over Thunderbolt 5), M3 Ultra + M5 Max, direct cable", "27-31 µs per op, 6.1-6.5 GB/s",
     "https://github.com/jundot/omlx/pull/3118"),
    ("RDMA over Thunderbolt 5, users' reports when JACCL was announced", "5-9 µs",
     "https://techboards.net/threads/macos-26-2-adds-infiniband-over-thunderbolt-support.5374"),
    ("JACCL vs ring (TCP over Thunderbolt), 4-way all-reduce latency, 4x M3 Ultra", "plot only (RDMA an order of "
     "magnitude below ring for small sizes)", "https://github.com/ml-explore/mlx/pull/2808"),
    ("TCP ping over a direct Thunderbolt 5 cable (min / avg / max)", "0.34 / 0.58 / 0.70 ms round trip",
     "https://github.com/exo-explore/exo/pull/2063"),
    ("TCP ping over a Thunderbolt bridge vs Wi-Fi LAN, 4x M3 Ultra", "0.38-0.95 ms vs 4.9-54 ms round trip; "
     "pipeline x4 decode: JACCL 25.4 tok/s, ring over Wi-Fi 8.7", "https://github.com/exo-explore/exo/issues/2295"),
    ("Ring backends over TCP, per communication op (blog, secondary)", "~300 µs; JACCL single-digit µs",
     "https://wpnews.pro/news/mlx-jaccl-distributed-ai-training-over-thunderbolt-5.txt"),
]


def _f(x, fmt="{:.2f}", none="–"):
    return none if x is None else fmt.format(x)


def _git(g) -> str:
    if isinstance(g, str):
        return f"`{g}`"
    return f"`{g['head']}{'-dirty' if g.get('dirty') else ''}` ({g.get('note', '')})"


def _ratio(a, b):
    return a / b if a and b else None


def pooled(prompts: List[dict], run: str) -> dict:
    """All tokens / all generation time over prompts (a short answer weighs little), tau pooled."""
    recs = [p[run] for p in prompts if run in p]
    gen = sum(r["tokens"] - 1 for r in recs)
    secs = sum(r["gen_s"] for r in recs)
    out = {"tps": gen / secs if secs else None, "identical": all(r.get("check", {}).get("identical", True) for r in recs)}
    accepts = [a for r in recs for a in r.get("accepts", [])]
    out["accepts"] = accepts
    if accepts:
        out["tau"] = sum(a + 1 for a in accepts) / len(accepts)
    widths = [w for r in recs for w in r.get("widths", [])]
    if widths:
        out["widths"] = Counter(widths).most_common(3)
        out["width_1"] = widths.count(1)
    if recs and "collectives" in recs[0]:
        out["ops"] = sum(r["collectives"]["ops"] for r in recs) / gen
        out["bytes"] = sum(r["collectives"]["bytes"] for r in recs) / gen
        calls = Counter()
        for r in recs:
            calls.update(r["collectives"]["calls"])
        out["calls"] = dict(calls)
        out["hops"] = sum(HOPS.get(k, 1) * v for k, v in calls.items()) / gen
        if accepts:
            out["ops_per_cycle"] = sum(calls.values()) / len(accepts)
            out["hops_per_cycle"] = out["hops"] * gen / len(accepts)
    return out


def rank1_ops(result: dict, setting: int, run: str) -> Optional[float]:
    rows = (result.get("rank1") or [[]])[setting]
    recs = [p[run] for p in rows if run in p and p[run].get("collectives")]
    return mean(r["ops_per_token"] for r in recs) if recs else None


def _speedups(r: dict, width: str):
    out = []
    for i, s in enumerate(r["settings"]):
        p, d = pooled(s["prompts"], "plain"), pooled(s["prompts"], width)
        out.append((s, p, d, _ratio(d["tps"], p["tps"])))
    return out


def read_about(out: Path) -> Optional[Tuple[str, str]]:
    """(title line, what changed) of a later round's folder (`about.md`: the title, then
    paragraphs), or None for the round the report's own words describe."""
    path = Path(out) / "about.md"
    if not path.exists():
        return None
    title, _, text = path.read_text().strip().partition("\n")
    return title, text.strip()


def write_report(out: Path):
    res = json.loads((Path(out) / "results.json").read_text())
    cfg = res["config"]
    width = str(cfg["widths"].split(",")[0])
    about = read_about(out)
    notes = Path(out) / "notes.md"  # a later round's reading of its numbers, by hand
    L = [about[0] if about else "# DFlash on a target split over two processes (issue 40)", ""]
    L += [f"`{res['command']}`, {res['machine_start']['date']}, {res['machine_start']['cpu']} "
          f"({res['machine_start']['cpu_count']} cores, shared with other agents' jobs), MLX "
          f"{res['machine_start']['mlx_version']} on its CPU backend, mlx-lm {res['machine_start']['mlx_lm_version']}, "
          f"float32, OPENBLAS_NUM_THREADS={res['machine_start']['thread_env'].get('OPENBLAS_NUM_THREADS')}; "
          f"load average {res['machine_start']['loadavg']} at the start, "
          f"{(res.get('machine_end') or {}).get('loadavg', '?')} at the end; {res.get('seconds', 0):.0f} s in all"
          + (f"; code at {_git(res['git'])}" if res.get("git") else "") + ".", ""]
    L += ["**The split runs use random-weight targets and a scripted draft with SmolLM2's measured acceptance.** "
          "SmolLM2-135M (9 heads, 3 KV heads) does not split over 2 ranks, so part 1 measures SmolLM2 with its "
          "shipped draft in one process; parts 2 and 3 split a llama of SmolLM2's shape with 8 heads / 2 KV heads "
          "(hidden 576, 30 layers, MLP 1536, vocabulary 49152) tensor parallel, and a tiny Qwen3-MoE (hidden 512, "
          "8 layers, 64 experts, top 8) pipeline parallel. Their draft runs a real draft forward of the same shape "
          "(the shipped draft on the llama, a random 2-layer draft on the MoE: its cost is real), then proposes "
          "the target's own greedy answer right for k tokens and wrong after, k drawn each cycle from part 1's "
          "block-16 accept lengths (same seed in every setting). DFlash here is chains only (no copies, no token "
          "trees) at the width shown; plain decoding is mlx-lm's own `stream_generate` on the same (split) model. "
          "Every DFlash answer was compared with plain decoding's, token by token.", ""]
    if about:
        L += [about[1], ""]

    # part 1
    sm = res["smollm2"]
    L += ["## 1. SmolLM2-135M + shipped draft, one process", ""]
    L += ["| prompt | prompt tokens | plain tok/s | block 16 tok/s (tau) | auto tok/s (tau) | speed-up 16 / auto | identical |",
          "|---|---:|---:|---:|---:|---:|---|"]
    for r in sm:
        L.append(f"| {r['suite']} {r['id']} | {r['prompt_tokens']} | {_f(r['plain']['tps'])} | {_f(r['16']['tps'])} "
                 f"({_f(r['16']['tau'])}) | {_f(r['auto']['tps'])} ({_f(r['auto']['tau'])}) | "
                 f"{_f(_ratio(r['16']['tps'], r['plain']['tps']))}x / {_f(_ratio(r['auto']['tps'], r['plain']['tps']))}x | "
                 f"{'yes' if r['16']['check']['identical'] and r['auto']['check']['identical'] else '**no**'} |")
    p, b16, au = pooled(sm, "plain"), pooled(sm, "16"), pooled(sm, "auto")
    L.append(f"| **all** | | {_f(p['tps'])} | {_f(b16['tps'])} ({_f(b16.get('tau'))}) | {_f(au['tps'])} "
             f"({_f(au.get('tau'))}) | {_f(_ratio(b16['tps'], p['tps']))}x / {_f(_ratio(au['tps'], p['tps']))}x | |")
    hist = Counter(res["rights"])
    L += ["", f"Block-16 accept lengths (what the split runs replay), {len(res['rights'])} cycles: " +
          ", ".join(f"{a}: {hist[a]}" for a in sorted(hist)) + f"; tau at block 16 "
          f"{_f(sum(a + 1 for a in res['rights']) / max(1, len(res['rights'])))}.", ""]
    single = _ratio(au["tps"], p["tps"])
    L += ["Single short runs on a loaded 2-core machine: a 48-token answer's tok/s moves by 10-30% from run to "
          "run, and `auto` pays its first exploration on the first prompt. On a quieter machine, 128 tokens, the "
          "same pair's chains-only `auto` measured 1.22-1.28x plain decoding "
          "([proposals, one engine](../20261203-proposals-one-engine/README.md)).", ""]

    # part 2
    L += ["## 2. Split targets: 1 process vs 2 ranks (`mlx.launch -n 2 --backend ring`, localhost)", ""]
    L += [f"DFlash at `{width}`. Collectives per committed token are counted on each rank while the decode's "
          "graphs are built (every `mx.distributed` op wrapped), between the first token and the last; bytes are "
          "what the ring backend sends for those arrays (all_sum: the array, all_gather: the input, send: the array).", ""]
    spread = [sp for parts in res.get("split", {}).values() if parts.get("sweep")
              for _, _, _, sp in _speedups(parts["sweep"], width)[:2] if sp][:2]
    L += ["Speed-ups in this part are single runs on a loaded machine (load average above)"
          + (f"; the first target's 2-rank runs at +0 and +0.1 ms in part 3, minutes apart, measured "
             f"{spread[0]:.2f}x and {spread[1]:.2f}x" if len(spread) == 2 else "")
          + ": treat differences under ~20% as noise. The counts are exact.", ""]
    L += ["| target | processes | plain tok/s | DFlash tok/s | speed-up | tau | widths (cycles) | collectives / token, plain → DFlash (rank 0; rank 1) | ratio | bytes sent / token (rank 0), plain → DFlash | identical |",
          "|---|---:|---:|---:|---:|---:|---|---|---:|---|---|"]
    goals = []
    for kind, parts in res.get("split", {}).items():
        sp = {}
        for label in ("one", "two"):
            r = parts.get(label)
            if not r:
                continue
            s = r["settings"][0]
            pl, df = pooled(s["prompts"], "plain"), pooled(s["prompts"], width)
            sp[label] = _ratio(df["tps"], pl["tps"])
            ops = "–"
            if "ops" in pl:
                r1p, r1d = rank1_ops(r, 0, "plain"), rank1_ops(r, 0, width)
                ops = f"{_f(pl['ops'], '{:.1f}')} → {_f(df['ops'], '{:.1f}')} ({_f(r1p, '{:.1f}')} → {_f(r1d, '{:.1f}')})"
                sp[label + "_ops"] = _ratio(pl["ops"], df["ops"])
                sp["tau"] = df.get("tau")
            L.append(f"| {kind} ({r['mode']}) | {r['processes']} | {_f(pl['tps'])} | {_f(df['tps'])} | "
                     f"{_f(sp[label])}x | {_f(df.get('tau'))} | {', '.join(f'{w} ({c})' for w, c in df.get('widths', []))} | "
                     f"{ops} | {_f(sp.get(label + '_ops'))} | "
                     f"{(_f(pl.get('bytes'), '{:,.0f}') + ' → ' + _f(df.get('bytes'), '{:,.0f}')) if 'bytes' in pl else '–'} | "
                     f"{'yes' if df['identical'] else '**no**'} |")
        goals.append((kind, sp))
    L.append("")
    for kind, parts in res.get("split", {}).items():
        r = parts.get("two")
        if r and r.get("per_forward"):
            pf = r["per_forward"]
            s = r["settings"][0]
            ops_s = s.get("op_seconds", {})
            L.append(f"- {kind}: one forward builds " + ", ".join(
                f"{v['ops']} ops / {v['bytes']:,.0f} bytes at width {w} ({', '.join(f'{k} {n}' for k, n in v['calls'].items()) or 'none on rank 0'})"
                for w, v in pf.items()) + "; measured here per op: " +
                ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in ops_s.items()) +
                f" (load average {s.get('loadavg_start', 0):.1f} → {s.get('loadavg_end', 0):.1f} during the run).")
    L.append("")

    # part 3
    models = link_models(res, width)
    L += ["## 3. A slow link: 2 ranks through a delaying relay", ""]
    L += ["`tc qdisc ... netem` is not in this kernel (`Error: Specified qdisc kind is unknown`, on a veth pair "
          "between two network namespaces made for the check and removed after), so the link is slowed in user "
          "space: each rank's ring hostfile names a TCP relay in the benchmark's process for its peer, and the "
          "relay holds every chunk back by the added one-way delay (set between settings over a control port). "
          "An all_sum between 2 ranks makes two trips (reduce, then gather), a pipeline hand-off one. Per setting "
          f"(one prompt, {cfg['sweep_tokens']} tokens, plain and DFlash alternating first): the cost of one op "
          "measured in that setting, plain and DFlash tok/s, and the model of the next section at the measured "
          "all_sum cost.", ""]
    L += ["| target | added delay | all_sum (measured) | hop | plain tok/s | DFlash tok/s | speed-up | model at that all_sum | tau | trips / token plain → DFlash | load | identical |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    curves = {}
    for kind, parts in res.get("split", {}).items():
        r = parts.get("sweep")
        if not r:
            continue
        f = models.get(kind, {}).get("f")
        for s, pl, df, sp in _speedups(r, width):
            o = s.get("op_seconds", {})
            model = f(o["all_sum"]) if f and "all_sum" in o else None
            L.append(f"| {kind} ({r['mode']}) | {s['delay_ms']:g} ms | {_f(o.get('all_sum', 0) * 1e3)} ms | "
                     f"{_f(o.get('hop', 0) * 1e3)} ms | {_f(pl['tps'])} | {_f(df['tps'])} | {_f(sp)}x | {_f(model)}x | "
                     f"{_f(df.get('tau'))} | {_f(pl.get('hops'), '{:.1f}')} → {_f(df.get('hops'), '{:.1f}')} | "
                     f"{s.get('loadavg_start', 0):.1f} | {'yes' if df['identical'] else '**no**'} |")
            c = curves.setdefault(kind, {"x": [], "y": [], "model": [], "all_sum": [], "hop": [], "mode": r["mode"]})
            c["x"].append(s["delay_ms"])
            c["y"].append(sp)
            c["model"].append(model)
            c["all_sum"].append(o.get("all_sum", 0))
            c["hop"].append(o.get("hop", 0))
        one = parts.get("one")
        if one:
            s1 = one["settings"][0]["prompts"][:len(r["settings"][0]["prompts"])]
            curves[kind]["one"] = _ratio(pooled(s1, width)["tps"], pooled(s1, "plain")["tps"])
    L.append("")
    if curves:
        _plot(curves, single, Path(out) / "speedup_vs_latency.png")
        L += ["![speed-up vs added link delay](speedup_vs_latency.png)", ""]
        if not about:
            L += ["The measured op cost does not follow the added delay: at +0 ms one all_sum already costs "
                  "milliseconds here, and from setting to setting it moves with the machine's load more than with the "
                  "delay (the ranks, the relay's threads and other jobs share 2 cores; the ring backend's socket threads "
                  "poll while they wait). Single 24-token runs on such a machine move by 2x from setting to setting: "
                  "read the measured speed-ups as noise around the model, which the next section builds from the parts "
                  "that are steady (op counts, tau, one-process compute).", ""]
    if models:
        _plot_model(models, Path(out) / "speedup_vs_op_cost.png")
        L += ["### The model: speed-up as a function of what one all_sum costs", "",
              "Per committed token: compute as measured in one process (1 / tok/s, plain and DFlash on the same "
              "prompts: the 1-process rows of part 2) plus the trips counted on 2 ranks (part 2) times half an "
              "all_sum's cost A (an all_sum is two one-way trips, a pipeline hand-off or all_gather one): "
              "speed-up(A) = (1/plain + trips_plain x A/2) / (1/DFlash + trips_DFlash x A/2). With a fast link it "
              "is the one-process speed-up; with a slow one it tends to trips_plain / trips_DFlash. Dots: our "
              "2-rank runs (part 2 and part 3) at their measured all_sum cost; dotted lines: published costs "
              "of one op on real links (table below).", "",
              "| target | 1-process speed-up | trips / token plain → DFlash | A = 0.03 ms (JACCL) | 0.3 ms (ring, TCP) | 0.6 ms (TCP over TB5 RTT) | 5 ms | A → ∞ |",
              "|---|---:|---|---:|---:|---:|---:|---:|"]
        for kind, m in models.items():
            f = m["f"]
            L.append(f"| {kind} | {_f(f(0))}x | {_f(m['T_p'], '{:.1f}')} → {_f(m['T_d'], '{:.1f}')} | {_f(f(3e-5))}x | "
                     f"{_f(f(3e-4))}x | {_f(f(6e-4))}x | {_f(f(5e-3))}x | {_f(m['T_p'] / m['T_d'])}x |")
        L += ["", "![speed-up vs cost of one all_sum](speedup_vs_op_cost.png)", ""]

    # published
    L += ["## Published per-operation figures, beside ours", ""]
    L += ["| link | figure | source |", "|---|---|---|"]
    for link, fig, url in PUBLISHED:
        L.append(f"| {link} | {fig} | [{url.split('//')[1].split('/')[0]}]({url}) |")
    two = [parts["two"]["settings"][0].get("op_seconds", {}) for parts in res.get("split", {}).values() if parts.get("two")]
    if two:
        L.append(f"| ours: ring backend between 2 processes on one 2-core VM (localhost), under load | all_sum "
                 f"{', '.join(_f(o.get('all_sum', 0) * 1e3) for o in two)} ms; one hop "
                 f"{', '.join(_f(o.get('hop', 0) * 1e3) for o in two)} ms | this run |")
    L.append("")

    # goals
    L += ["## Against the issue's goals", ""]
    for kind, sp in goals:
        one, two_, tau = sp.get("one"), sp.get("two"), sp.get("tau")
        met = two_ is not None and one is not None and two_ >= one
        L.append(f"- **{kind}, speed-up**: DFlash over plain sharded decoding on 2 ranks {_f(two_)}x, in one process "
                 f"{_f(one)}x on the same prompts (SmolLM2 with its real draft in one process, `auto` chains: "
                 f"{_f(single)}x): {'met' if met else '**not met**'}"
                 + (" (by less than this machine's ~20% noise)" if not met and two_ and one and two_ > 0.8 * one else "")
                 + (" (both below 1: DFlash loses on this target either way)" if two_ and one and max(two_, one) < 1
                    else "") + ".")
        L.append(f"- **{kind}, collectives**: per committed token they fall {_f(sp.get('two_ops'))}x with tau "
                 f"{_f(tau)}: {'met' if sp.get('two_ops') and tau and sp['two_ops'] >= 0.95 * tau else '**not met**'}.")
    L.append("")
    L += ["## What this shows", ""]
    if notes.exists():
        (Path(out) / "README.md").write_text("\n".join(L + [notes.read_text().strip(), ""]))
        return
    for kind, parts in res.get("split", {}).items():
        two = parts.get("two")
        if not two:
            continue
        s0 = two["settings"][0]["prompts"]
        pl, df = pooled(s0, "plain"), pooled(s0, width)
        if "ops_per_cycle" not in df:
            continue
        fwd = two["per_forward"]["1"]["ops"]
        L.append(f"- **{kind} ({two['mode']})**: a plain step makes {pl['ops']:.0f} collectives ({pl['hops']:.0f} trips); "
                 f"a DFlash cycle {df['ops_per_cycle']:.1f} ({df['hops_per_cycle']:.1f} trips): the verify forward's "
                 f"{fwd}, plus {df['ops_per_cycle'] - fwd:.2f} more (in the first round, 2026-12-03, one all_sum of "
                 "rank 0's cycle time"
                 + (" and one of the draft's features (each rank's taps of its own layers)"
                    if two["mode"] == "pipeline" else "")
                 + "; since then they ride on the forward's own collectives on a pipeline, and a tensor split sends 8 cycle times to an all_sum). "
                 + (f"So collectives per token fall by tau x {fwd}/{fwd + 1}, and DFlash's advantage grows with the "
                    f"link's latency towards tau (limit {pl['hops'] / df['hops']:.2f}x at this tau)."
                    if two["mode"] == "tensor" else
                    f"On a pipeline the forward itself makes only {fwd} collectives, so the two all_sums (4 trips) "
                    f"triple a cycle's trips, on every cycle, width-1 ones included "
                    f"({df.get('width_1', 0)} of {len(df.get('accepts', [])) or '?'} "
                    f"cycles here verified one row): DFlash makes fewer trips per committed token than plain decoding only "
                    f"when tau > {df['hops_per_cycle'] / (pl['hops'] or 1):.0f}, and a slower link makes it worse "
                    f"(limit {pl['hops'] / df['hops']:.2f}x here). Folding the cycle time into the features' all_sum "
                    "(one collective, 4 trips a cycle) would lower that threshold to tau > 2; carrying each rank's taps in the "
                    "pipeline's own hand-off and final all_gather (as vLLM's pipeline-parallel DFlash adds its "
                    "taps to the hand-off) would remove both extra all_sums, so that any tau > 1 saves trips."))
    L += ["- **Bytes grow, trips shrink.** A verify of w rows sends w times a step's bytes per collective (part 2's "
          "bytes column): DFlash trades bandwidth for round trips, right on latency-bound links (Thunderbolt, "
          "Ethernet), less so on a thin one (Wi-Fi).",
          "- **The width policy learns from noisy times.** On 2 ranks here `auto` mostly verified 2-4 rows; on a "
          "latency-bound link a verify's cost hardly depends on its width, so the draft's whole block (16) would "
          "commit the full block-16 tau for the same trips. It learns that only from cycle times steady enough to "
          "show it, which this machine's were not.",
          "- **A hazard met on the way.** mlx-lm's `stream_generate` leaves one forward queued on its own stream after "
          "its last token; on a split target a DFlash call started right after ran its first collectives beside that "
          "forward's and the ranks paired them wrongly (a garbage shared seed, which `mx.random.seed` refused); "
          "it went away once the benchmark waited for mlx-lm's stream (`mx.synchronize(generation_stream)`) "
          "between runs. A program that mixes the two on a split target needs the same wait.", ""]
    (Path(out) / "README.md").write_text("\n".join(L))


def link_models(res: dict, width: str) -> dict:
    """Per target: the model speed-up as a function of one all_sum's cost A (seconds), and the
    measured 2-rank points (A measured in the same run, speed-up measured)."""
    out = {}
    for kind, parts in res.get("split", {}).items():
        one, two = parts.get("one"), parts.get("two")
        if not (one and two):
            continue
        p1, d1 = pooled(one["settings"][0]["prompts"], "plain"), pooled(one["settings"][0]["prompts"], width)
        p2, d2 = pooled(two["settings"][0]["prompts"], "plain"), pooled(two["settings"][0]["prompts"], width)
        if not (p1["tps"] and d1["tps"] and "hops" in p2):
            continue
        tp, td, Tp, Td = 1 / p1["tps"], 1 / d1["tps"], p2["hops"], d2["hops"]
        points = []
        for r in (two, parts.get("sweep")):
            for s, pl, df, sp in (_speedups(r, width) if r else []):
                if s.get("op_seconds") and sp:
                    points.append((s["op_seconds"]["all_sum"], sp, s["label"]))
        out[kind] = {"f": (lambda A, tp=tp, td=td, Tp=Tp, Td=Td: (tp + Tp * A / 2) / (td + Td * A / 2)),
                     "T_p": Tp, "T_d": Td, "points": points, "mode": two["mode"]}
    return out


def _plot_model(models, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4.5))
    A = np.logspace(-2.3, 1.7, 200) / 1e3
    for (kind, m), color in zip(models.items(), ("tab:blue", "tab:orange")):
        ax.plot(A * 1e3, [m["f"](a) for a in A], color=color, label=f"{kind} ({m['mode']}), model")
        if m["points"]:
            xs, ys, _ = zip(*m["points"])
            ax.plot(np.array(xs) * 1e3, ys, "o", color=color, alpha=0.7, label=f"{kind}, measured on 2 ranks here")
    for x, name in ((0.03, "JACCL ~30 µs"), (0.3, "ring/TCP ~300 µs"), (0.58, "TCP over TB5 RTT"), (7.5, "Wi-Fi RTT")):
        ax.axvline(x, color="gray", ls=":", lw=0.8)
        ax.text(x, ax.get_ylim()[1], name, rotation=90, va="top", ha="right", fontsize=7, color="gray")
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("cost of one all_sum of a token's hidden state (ms)")
    ax.set_ylabel("DFlash tok/s ÷ plain sharded tok/s")
    ax.set_title("2 ranks: model from 1-process compute and counted trips, with measured points")
    ax.legend(fontsize=7, loc="center left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot(curves, single, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for (kind, c), color in zip(curves.items(), ("tab:blue", "tab:orange")):
        ax.plot(c["x"], c["y"], "o-", color=color, label=f"{kind} ({c['mode']}), measured")
        if any(m is not None for m in c["model"]):
            ax.plot(c["x"], c["model"], "--", color=color, alpha=0.6, label=f"{kind}, model at the measured all_sum")
        if c.get("one"):
            ax.axhline(c["one"], color=color, ls=":", alpha=0.8, label=f"{kind}, same prompts, 1 process")
        ax2.plot(c["x"], [v * 1e3 for v in c["all_sum"]], "o-", color=color, label=f"all_sum ({kind} run)")
        ax2.plot(c["x"], [v * 1e3 for v in c["hop"]], "s--", color=color, alpha=0.6, label=f"send/recv hop ({kind} run)")
    if single:
        ax.axhline(single, color="gray", ls=":", label="SmolLM2 + real draft, 1 process")
    ax.axhline(1.0, color="black", lw=0.6)
    for a in (ax, ax2):
        a.set_xscale("symlog", linthresh=0.1)
        a.set_xlim(-0.005, max(max(c["x"]) for c in curves.values()) * 1.3)
        a.set_xlabel("added one-way link delay (ms)")
    ax.set_ylabel("DFlash tok/s ÷ plain sharded tok/s")
    ax.set_title("2 ranks, ring backend through a delaying relay")
    ax.legend(fontsize=7)
    ax2.set_ylabel("ms per op (measured)")
    ax2.set_title("cost of one op, same runs")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
