"""The shipped SmolLM2 draft at float32, 8-bit and 4-bit (MLX affine, group size 64): tau, tok/s, draft forward time.

One process, the same prompts (short suites, chat template), greedy; for each prompt plain
decoding once, then every draft at the draft's own width (block 16) and at `auto`, the
drafts' order rotated prompt by prompt. Tokens must equal plain decoding's (the draft only
proposes). Also: the time of one draft forward at each precision (median, interleaved), and
the per-position top-1 agreement of each quantized draft with the float32 one, teacher-forced
on the target's own output (the same context features for every draft). A fourth draft,
4-bit with `fc` left in float32, measures what quantizing `fc` costs (tau at block 16,
agreement, forward time).

    OPENBLAS_NUM_THREADS=1 nice -n 5 python benchmarks/quantized_drafts.py \\
        --out benchmarks/results/20261203-quantized-drafts
"""

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
import mlx.core as mx
import mlx.nn as nn

WIDTHS = ("draft", "auto")


def load_drafts(model, name):
    from dflash_mlx import load_draft

    drafts = {"f32": load_draft(name, model), "8-bit": load_draft(name, model, bits=8),
              "4-bit": load_draft(name, model, bits=4)}
    fc_float = load_draft(name, model)
    nn.quantize(fc_float, 64, 4, class_predicate=lambda p, m: type(m) is nn.Linear and p != "fc")
    mx.eval(fc_float.parameters())
    drafts["4-bit, fc f32"] = fc_float
    return drafts


def weight_bytes(draft) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(draft.parameters()))


def generate(model, draft, tok, ids, max_tokens, width):
    from dflash_mlx.generate import stream_generate

    tokens, last = [], None
    for r in stream_generate(model, draft, tok, ids, max_tokens=max_tokens, block_size=width,
                             baseline=draft is None):
        tokens.extend(r.tokens)
        last = r
    return tokens, last


def agreement(drafts, prompts, outputs, every=6):
    """Teacher-forced proposals: context = the prompt and the target's output up to an anchor
    (every `every` tokens), features from one target forward, the same for every draft. Per
    block position (1..15): how often each quantized draft's argmax equals the float32 draft's;
    and against the target's own next tokens: each draft's top-1 accuracy, its leading run of
    matches (the accept length a block-16 cycle would get there), and how often a quantized
    draft is right where the float32 draft is."""
    ref = drafts["f32"]
    B = ref.block_size
    same = {k: [0] * (B - 1) for k in drafts if k != "f32"}
    right = {k: [0, 0] for k in drafts}  # [right, scored]
    run = {k: [] for k in drafts}
    kept = {k: [0, 0] for k in same}  # [right too, f32 right]
    n = 0
    for ids, out in zip(prompts, outputs):
        seq = ids + out
        target = ref.target
        _, feats, _ = target.forward(mx.array(seq)[None], target.make_cache(), ref.config.target_layer_ids)
        caches = {k: d.make_cache() for k, d in drafts.items()}
        done = 0
        for p in range(len(ids), len(seq) - 1, every):
            new = feats[:, done:p]
            done = p
            picks = {k: d.to_target_ids(mx.argmax(d.propose_logits(mx.array([seq[p]]), new, caches[k], B), axis=-1))[0]
                     for k, d in drafts.items()}
            mx.eval(picks)
            picks = {k: v.tolist() for k, v in picks.items()}
            truth = seq[p + 1:p + B]
            for k, pick in picks.items():
                hit = [a == t for a, t in zip(pick, truth)]
                right[k][0] += sum(hit)
                right[k][1] += len(hit)
                run[k].append(next((i for i, h in enumerate(hit) if not h), len(hit)))
                if k in same:
                    for i, (a, b) in enumerate(zip(pick, picks["f32"])):
                        same[k][i] += a == b
                    for a, b, t in zip(pick, picks["f32"], truth):
                        if b == t:
                            kept[k][1] += 1
                            kept[k][0] += a == t
            n += 1
    return {"anchors": n, "per_position_with_f32": {k: [h / n for h in v] for k, v in same.items()},
            "top1_accuracy": {k: r / s for k, (r, s) in right.items()},
            "teacher_forced_accept": {k: sum(v) / len(v) for k, v in run.items()},
            "right_where_f32_right": {k: r / s for k, (r, s) in kept.items()}}


def forward_times(drafts, ids, reps=20, new_tokens=4):
    """Median seconds of one draft forward (inject `new_tokens` committed tokens' features,
    denoise a block of 16, score it: `propose_logits`) and of the same without the LM head
    (`propose_hidden`, the draft's own layers), on a real context of the prompt, interleaved."""
    ref = drafts["f32"]
    target = ref.target
    _, feats, _ = target.forward(mx.array(ids)[None], target.make_cache(), ref.config.target_layer_ids)
    caches = {}
    for k, d in drafts.items():
        caches[k] = d.make_cache()
        d.inject(feats[:, :-new_tokens], caches[k])
    new, last, B = feats[:, -new_tokens:], mx.array([ids[-1]]), ref.block_size
    times = {k: {"propose_logits": [], "propose_hidden": []} for k in drafts}
    for rep in range(reps + 3):
        for k, d in drafts.items():
            for what in ("propose_logits", "propose_hidden"):
                t0 = time.perf_counter()
                mx.eval(getattr(d, what)(last, new, caches[k], B))
                dt = time.perf_counter() - t0
                for c in caches[k]:
                    c.trim(new_tokens)
                if rep >= 3:
                    times[k][what].append(dt)
    return {k: {w: statistics.median(v) for w, v in t.items()} for k, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--suites", default="gsm8k,humaneval,mtbench")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", required=True)
    p.add_argument("--plot-only", action="store_true", help="redraw the plot from --out's results.json")
    p.add_argument("--agreement-only", action="store_true",
                   help="recompute the teacher-forced agreement (plain decoding again for the target's "
                   "tokens) into --out's results.json")
    args = p.parse_args(argv)
    if args.plot_only:
        return plot(json.loads((Path(args.out) / "results.json").read_text()), Path(args.out) / "quantized_drafts.png")
    from dflash_mlx import load
    from dflash_mlx.bench.suites import format_prompt, load_suite
    from dflash_mlx.cli.doctor import machine
    from dflash_mlx.generate import encode_prompt, tau

    started, load_start = time.perf_counter(), os.getloadavg()
    model, tok = load(args.target, quiet=True)
    drafts = load_drafts(model, args.target)
    main_drafts = [k for k in drafts if k != "4-bit, fc f32"]
    runs = [(k, w) for k in main_drafts for w in WIDTHS] + [("4-bit, fc f32", "draft")]
    prompts = [(s, encode_prompt(tok, format_prompt(tok, q)))
               for s in args.suites.split(",") for q in load_suite(s, limit=args.limit, seed=0)]
    if args.agreement_only:
        path = Path(args.out) / "results.json"
        doc = json.loads(path.read_text())
        outputs = [generate(model, None, tok, ids, args.max_tokens, "draft")[0] for _, ids in prompts]
        assert [len(o) for o in outputs] == [r["tokens"] for r in doc["records"]]
        doc["agreement"] = agreement(drafts, [ids for _, ids in prompts], outputs)
        for old in ("top1_agreement_with_f32", "agreement_anchors"):
            doc.pop(old, None)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps({k: v for k, v in doc["agreement"].items() if k != "per_position_with_f32"}, indent=1))
        return
    generate(model, None, tok, prompts[0][1], 8, "draft")  # warm-up, untimed
    for k, w in runs:
        generate(model, drafts[k], tok, prompts[0][1], 8, w)
    records, outputs = [], []
    for i, (suite, ids) in enumerate(prompts):
        base_tokens, base = generate(model, None, tok, ids, args.max_tokens, "draft")
        outputs.append(base_tokens)
        rec = {"suite": suite, "prompt_tokens": len(ids), "tokens": len(base_tokens),
               "baseline_tps": base.generation_tps, "runs": {}}
        order = runs[i % len(runs):] + runs[:i % len(runs)]
        for k, w in order:
            tokens, last = generate(model, drafts[k], tok, ids, args.max_tokens, w)
            rec["runs"][f"{k} @ {w}"] = {"accept_lengths": list(last.accept_lengths), "tps": last.generation_tps,
                                         "identical": tokens == base_tokens}
        records.append(rec)
        print(f"[{time.perf_counter() - started:.0f}s] {suite} #{i}: base {base.generation_tps:.1f} tok/s; " + "; ".join(
            f"{k} tau {tau(r['accept_lengths']):.2f} {r['tps']:.1f} tok/s"
            + ("" if r["identical"] else " MISMATCH") for k, r in rec["runs"].items()), flush=True)
    agree = agreement(drafts, [ids for _, ids in prompts], outputs)
    fwd = forward_times(drafts, prompts[0][1])
    summary = summarize(records, runs)
    command = shlex.join(["python", "benchmarks/quantized_drafts.py", *(sys.argv[1:] if argv is None else argv)])
    doc = {"command": f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '')} nice -n 5 {command}",
           "target": args.target, "draft": args.target, "quantization": "MLX affine, group size 64",
           "suites": args.suites, "limit": args.limit, "max_tokens": args.max_tokens, "machine": machine(),
           "load_start": load_start, "load_end": os.getloadavg(),
           "elapsed_s": round(time.perf_counter() - started, 1),
           "weight_bytes": {k: weight_bytes(d) for k, d in drafts.items()},
           "summary": summary, "forward_s": fwd, "agreement": agree,
           "records": records}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, out / "quantized_drafts.png")
    print(json.dumps({"summary": summary, "forward_s": fwd,
                      "agreement": {k: v for k, v in agree.items() if k != "per_position_with_f32"}}, indent=1))


def summarize(records, runs):
    """Per run: pooled tau (tokens committed per target forward), mean tok/s, speed-up over plain
    decoding (mean of per-prompt ratios), tokens identical; and tau relative to the f32 draft's."""
    from dflash_mlx.generate import tau

    out = {}
    for k, w in runs:
        key = f"{k} @ {w}"
        out[key] = {"tau": tau([a for r in records for a in r["runs"][key]["accept_lengths"]]),
                    "tps": statistics.mean(r["runs"][key]["tps"] for r in records),
                    "speedup": statistics.mean(r["runs"][key]["tps"] / r["baseline_tps"] for r in records),
                    "identical": all(r["runs"][key]["identical"] for r in records)}
    for key, row in out.items():
        row["tau_vs_f32"] = row["tau"] / out["f32 @ " + key.split(" @ ")[1]]["tau"]
    out["baseline_tps"] = statistics.mean(r["baseline_tps"] for r in records)
    return out


def plot(doc, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = doc["summary"]
    labels = ["f32", "8-bit", "4-bit"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, metric, title in ((axes[0], "tau", "tau (tokens per target forward)"),
                              (axes[1], "speedup", "tok/s vs plain decoding")):
        for off, w in ((-0.2, "draft"), (0.2, "auto")):
            vals = [s[f"{k} @ {w}"][metric] for k in labels]
            bars = ax.bar([i + off for i in range(3)], vals, width=0.4, label=f"block {'16' if w == 'draft' else w}")
            ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_xticks(range(3), labels)
        ax.set_title(title)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.2)
        ax.legend(fontsize=8, loc="upper center", ncol=2)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    fwd = doc["forward_s"]
    keys = list(fwd)
    for off, what in ((-0.2, "propose_logits"), (0.2, "propose_hidden")):
        bars = axes[2].bar([i + off for i in range(len(keys))], [fwd[k][what] * 1e3 for k in keys], width=0.4,
                           label={"propose_logits": "whole forward (with LM head)",
                                  "propose_hidden": "draft layers only"}[what])
        axes[2].bar_label(bars, fmt="%.1f", fontsize=8)
    axes[2].set_xticks(range(len(keys)), [k.replace(", ", ",\n") for k in keys], fontsize=8)
    axes[2].set_title("one draft forward, ms (median)")
    axes[2].set_ylim(top=axes[2].get_ylim()[1] * 1.2)
    axes[2].legend(fontsize=8, loc="upper center", ncol=2)
    fig.suptitle("shipped smollm2-135m draft: float32 vs MLX-quantized (CPU, shared machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
