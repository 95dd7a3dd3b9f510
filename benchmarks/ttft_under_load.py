"""Time to first token of a new request while other streams run, against the same request idle.

    python benchmarks/ttft_under_load.py [--background 7] [--probes 8] [--out DIR]

Starts our server (`dflash-mlx serve`, the packaged default and its draft; `--max-batch`
passed through) and, for each probe prompt: sends it alone (idle TTFT), then again while
`--background` streaming requests of `--background-tokens` tokens are decoding (loaded
TTFT). The issue's goal: loaded p95 at most 2x idle p95 plus the prompt's own prefill time
(from the answer's `usage.dflash`: prefill tokens / prompt tokens per second). Writes
`results.json` and `README.md` to `--out`. Server helpers from `serve_bench.py`.
"""

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import (RequestResult, chat_body, dflash_spec, load_prompts, percentile,  # noqa: E402
                         serve, source_state, stream_chat)


def probe(run, http, messages, max_tokens):
    return stream_chat(http, run.url, chat_body(run.model, messages, max_tokens), RequestResult(0, 0, 0, 0.0),
                       time.perf_counter())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--background", type=int, default=7, help="streams decoding while a probe is sent (default: 7)")
    ap.add_argument("--background-tokens", type=int, default=400)
    ap.add_argument("--probes", type=int, default=8)
    ap.add_argument("--probe-tokens", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path(f"benchmarks/results/{time.strftime('%Y%m%d')}-ttft-under-load"))
    args = ap.parse_args(argv)
    import dflash_mlx  # noqa: F401  (BLAS routing, and the machine's description)
    from dflash_mlx.cli.doctor import machine

    prompts = load_prompts(args.probes + args.background)
    probes, background = prompts[: args.probes], prompts[args.probes:]
    spec = dflash_spec(args.model, None, "float32", ["--max-batch", str(args.max_batch)])
    rows = []
    with serve(spec) as run, httpx.Client(timeout=1800) as http:
        probe(run, http, probes[0]["messages"], 16)  # warm-up
        for i, p in enumerate(probes):
            wait_rows(run, 0)
            idle = probe(run, http, p["messages"], args.probe_tokens)
            stop = threading.Event()
            streams = [threading.Thread(target=keep_streaming, args=(run, b["messages"], args.background_tokens, stop))
                       for b in background]
            for t in streams:
                t.start()
            wait_rows(run, len(background))
            loaded = probe(run, http, p["messages"], args.probe_tokens)
            stop.set()
            for t in streams:
                t.join()
            d = (idle.usage or {}).get("dflash", {})
            prefill = d.get("prefill_tokens", 0) / d["prompt_tokens_per_second"] if d.get("prompt_tokens_per_second") else None
            rows.append({"probe": p["id"], "idle_ttft": idle.ttft, "loaded_ttft": loaded.ttft, "prefill_s": prefill,
                         "same_text": idle.text == loaded.text, "errors": [x.error for x in (idle, loaded) if x.error]})
            print(f"probe {i + 1}/{len(probes)}: idle {idle.ttft:.2f}s, with {len(background)} streams "
                  f"{loaded.ttft:.2f}s, prefill {prefill or 0:.2f}s", flush=True)
    idle_p95 = percentile([r["idle_ttft"] for r in rows], 95)
    loaded_p95 = percentile([r["loaded_ttft"] for r in rows], 95)
    prefill_p95 = percentile([r["prefill_s"] or 0.0 for r in rows], 95)
    bound = 2 * idle_p95 + prefill_p95
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine(), "source": source_state(),
           "rows": rows, "idle_p95": idle_p95, "loaded_p95": loaded_p95, "prefill_p95": prefill_p95,
           "bound": bound, "met": loaded_p95 <= bound}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(doc, indent=1))
    lines = [f"# Time to first token under load ({time.strftime('%Y-%m-%d')})", "",
             f"`python benchmarks/ttft_under_load.py --background {args.background} --probes {args.probes}`: "
             f"{args.model} with its draft, `--max-batch {args.max_batch}`, float32, greedy; each probe sent "
             f"alone, then while {args.background} streams of {args.background_tokens} tokens decode.", "",
             "| | p50 (s) | p95 (s) |", "|---|---:|---:|",
             f"| idle | {percentile([r['idle_ttft'] for r in rows], 50):.2f} | {idle_p95:.2f} |",
             f"| with {args.background} streams | {percentile([r['loaded_ttft'] for r in rows], 50):.2f} | "
             f"{loaded_p95:.2f} |", "",
             f"Goal: loaded p95 <= 2 x idle p95 + the prompt's own prefill time (p95 {prefill_p95:.2f} s) = "
             f"{bound:.2f} s: **{'met' if doc['met'] else 'not met'}**. Answers identical idle and loaded: "
             f"{all(r['same_text'] for r in rows)}.", "", f"Machine: {machine()}", ""]
    (args.out / "README.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


def keep_streaming(run, messages, max_tokens, stop: threading.Event):
    """One long streamed request, dropped (cancelled on the server) when `stop` is set."""
    body = chat_body(run.model, messages, max_tokens)
    with httpx.Client(timeout=1800) as http, http.stream("POST", run.url + "/v1/chat/completions", json=body) as r:
        for _ in r.iter_lines():
            if stop.is_set():
                return


def wait_rows(run, n, timeout=120.0):
    """Until the server decodes exactly `n` rows with none joining (its /health): a full batch
    for a loaded probe, an idle server (0) for an idle one."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        batch = httpx.get(run.url + "/health").json().get("batch") or {}
        if batch.get("rows", 0) == n and not batch.get("joining"):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the server never settled at {n} decoding rows")


if __name__ == "__main__":
    sys.exit(main())
