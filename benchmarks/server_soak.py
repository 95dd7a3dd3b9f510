"""Memory soak of `dflash-mlx serve`: many requests with distinct long prompts.

Starts the server as its own process (the embedded default model and its packaged
draft unless told otherwise) with a byte bound on the prompt cache and a count
bound too high to bind, sends N completions whose long prompts share nothing (so
each request leaves the previous conversation as a snapshot), and records the
server's RSS (from /proc) and its /health prompt-cache figures as it goes.

    OPENBLAS_NUM_THREADS=1 nice -n 5 python benchmarks/server_soak.py \
        --requests 200 --prompt-words 450 --prompt-cache-bytes 256M \
        --out benchmarks/results/20261202-server-soak
"""

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force education "
         "river mountain garden window music letter paper table market village doctor bridge island summer winter").split()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def prompt(i: int, words: int) -> str:
    rng = random.Random(1000 + i)
    return f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(words)) + "\n\nSummarize the text above."


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--prompt-words", type=int, default=450)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--prompt-cache-bytes", default="256M")
    p.add_argument("--model", default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "dflash_mlx.cli.main", "serve", "--port", str(port), "--snapshots", "100000",
           "--prompt-cache-bytes", args.prompt_cache_bytes]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, "the server exited"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.5)
        http = httpx.Client(base_url=url, timeout=600)
        health = http.get("/health").json()
        rows = []

        def one(i):
            t0 = time.perf_counter()
            r = http.post("/v1/completions", json={"prompt": prompt(i, args.prompt_words), "max_tokens": args.max_tokens})
            r.raise_for_status()
            usage = r.json()["usage"]
            pc = http.get("/health").json()["prompt_cache"]
            row = {"i": i, "seconds": time.perf_counter() - t0, "prompt_tokens": usage["prompt_tokens"],
                   "reused": usage["prompt_tokens_details"]["cached_tokens"], "rss_mb": rss_mb(proc.pid), **pc}
            rows.append(row)
            return row

        rss_start = rss_mb(proc.pid)
        for i in range(args.warmup):
            one(-1 - i)
        rss_before = rss_mb(proc.pid)
        for i in range(args.requests):
            row = one(i)
            if i % 10 == 0:
                print(f"{i:4d}  {row['prompt_tokens']} tokens  {row['seconds']:.1f} s  RSS {row['rss_mb']:.0f} MB  "
                      f"snapshots {row['snapshots']} = {row['snapshot_bytes'] / 2**20:.0f} MiB "
                      f"(bound {row['max_bytes'] / 2**20:.0f} MiB), live {row['live_bytes'] / 2**20:.0f} MiB",
                      flush=True)
        rss_after = rss_mb(proc.pid)
        soak = rows[args.warmup:]
        result = {
            "model": health["model"], "draft": health["draft"], "requests": args.requests, "warmup": args.warmup,
            "prompt_tokens_mean": sum(r["prompt_tokens"] for r in soak) / len(soak),
            "prompt_tokens_reused_max": max(r["reused"] for r in soak),
            "max_tokens": args.max_tokens, "prompt_cache_bytes": rows[-1]["max_bytes"],
            "rss_mb": {"server_started": rss_start, "before": rss_before, "after": rss_after,
                       "max": max(r["rss_mb"] for r in soak)},
            "snapshot_bytes_max": max(r["snapshot_bytes"] for r in soak),
            "snapshots_max": max(r["snapshots"] for r in soak),
            "live_bytes_max": max(r["live_bytes"] for r in soak),
            "within_bound": all(r["snapshot_bytes"] <= r["max_bytes"] for r in rows),
            "seconds_total": sum(r["seconds"] for r in soak),
            "thread_env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")},
            "load_average": os.getloadavg(),
            "rows": rows,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
        plot(rows, args.out / "soak.png", rows[-1]["max_bytes"])
        print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    finally:
        proc.terminate()
        proc.wait(30)


def plot(rows, path, bound):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    warmup = sum(r["i"] < 0 for r in rows)
    x = [k - warmup for k in range(len(rows))]  # in the order sent; the warm-up below 0
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.axvspan(-warmup, 0, color="0.92", label="warm-up")
    ax.plot(x, [r["rss_mb"] for r in rows], label="server RSS (MB)")
    ax.plot(x, [r["snapshot_bytes"] / 2**20 for r in rows], label="snapshots (MiB)")
    ax.axhline(bound / 2**20, color="grey", ls="--", label="--prompt-cache-bytes")
    ax.set_xlabel("request")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--plot":  # redraw a result's plot: --plot RESULT_DIR
        d = Path(sys.argv[2])
        r = json.loads((d / "results.json").read_text())
        plot(r["rows"], d / "soak.png", r["prompt_cache_bytes"])
    else:
        main()
