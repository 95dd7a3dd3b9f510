"""Serving benchmark: many clients at once against OpenAI-compatible servers.

    nice -n 10 python benchmarks/serve_bench.py [--clients 1,2,4,8] [--max-tokens 64] [--rounds 1]
        [--servers dflash,mlx-lm] [--model smollm2-135m] [--work-dir DIR] [--out DIR]

Starts each server as its own process on a free loopback port (`dflash-mlx serve`, and
mlx-lm's own `mlx_lm.server` with continuous batching and no draft, on the same weights
exported by `dflash-mlx export` in float32), waits for /health, and for every client count C
sends C concurrent streamed, greedy chat completions with distinct prompts (each client
`--rounds` of them, one after another), waves of the servers interleaved. Then the same
prompts one at a time to our server (the baseline of serving them in a row). Reports per
server and C: aggregate tok/s (all completion tokens / the wave's wall time), per-request
tok/s (tokens / send-to-last-byte time; mean and min), time to first token p50/p95, and what
our /health says about widths or rows. Greedy answers are compared per prompt: ours at every
C must equal ours alone exactly; mlx-lm's differences are recorded (near-ties between two
engines can differ). Writes `results.json`, `README.md`, `throughput.png` and `ttft.png` to
`--out`, the servers' logs to `--out/logs/`.

mlx-lm's server is started through `python -c "import dflash_mlx; runpy.run_module('mlx_lm.server')"`
so that it gets the same BLAS as ours (`import dflash_mlx` routes MLX's CPU matmuls to
OpenBLAS; `python -m mlx_lm.server` alone gets MLX's reference BLAS: server `mlx-lm-refblas`).
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import httpx

SCHEMA = "dflash-mlx-serve-bench/1"
SUITES = ("mtbench", "gsm8k", "humaneval")
SERVER_KINDS = ("dflash", "dflash-baseline", "mlx-lm", "mlx-lm-refblas")
# untimed: the first requests build graphs (and let `auto` learn); one between waves replaces
# the server's live cache, so a prompt repeated from an earlier wave is not served from its cache
WARMUP_PROMPTS = ("Name three primary colours.", "Write a haiku about the sea.",
                  "What is the capital of France? Answer in one sentence.")
FALLBACK_PROMPTS = ("Explain what a hash table is in two sentences.", "Write a Python function that reverses a string.",
                    "List three tips for a good night's sleep.", "What is 17 * 23? Show your steps.",
                    "Summarise the plot of Romeo and Juliet.", "Describe photosynthesis to a child.",
                    "Give me a short packing list for a weekend hike.", "Why is the sky blue?")
MLX_LM_WRAPPER = (
    "import sys, runpy; import dflash_mlx; from dflash_mlx.blas import active_blas; "
    "print(f'serve_bench: BLAS {active_blas()}', file=sys.stderr, flush=True); "
    "sys.argv = ['mlx_lm.server'] + sys.argv[1:]; runpy.run_module('mlx_lm.server', run_name='__main__', alter_sys=True)"
)


# -- servers --------------------------------------------------------------------


@dataclass
class ServerSpec:
    name: str
    argv: List[str]  # the command, less the port (`port_flag` PORT is appended)
    port_flag: str = "--port"
    ready_path: str = "/health"
    env: Dict[str, str] = field(default_factory=dict)


@dataclass
class Running:
    spec: ServerSpec
    proc: subprocess.Popen
    url: str
    model: Optional[str]  # the id /v1/models reports, sent with every request (None: not sent)
    startup_s: float


def display_command(argv: Sequence[str]) -> str:
    """`argv` as a reader wants it: `python` for this interpreter, the mlx-lm wrapper by name."""
    shown = ["python" if a == sys.executable else "'<MLX_LM_WRAPPER>'" if a == MLX_LM_WRAPPER else a for a in argv]
    return " ".join(shown)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, path: str, timeout: float) -> None:
    """Until GET `path` answers 200; an error when the process exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready after {timeout:.0f} s")
        time.sleep(0.2)


def served_model(url: str) -> Optional[str]:
    """The first model id of GET /v1/models; None when it fails (mlx-lm's scans the hub cache)."""
    try:
        return (httpx.get(url + "/v1/models", timeout=10).json().get("data") or [{}])[0].get("id")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def stop_process(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM to the process group, SIGKILL after `timeout`; returns once it is gone."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)  # start_new_session: the group is the server and its children
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def serve(spec: ServerSpec, log_path: Optional[Path] = None, ready_timeout: float = 600.0,
          stop_timeout: float = 15.0) -> Iterator[Running]:
    """The server running on a free port until the block ends (also on an error or Ctrl-C)."""
    port = free_port()
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    t0 = time.perf_counter()
    # its own session: a Ctrl-C in the terminal reaches us only, and we stop the server
    proc = subprocess.Popen(spec.argv + [spec.port_flag, str(port)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env={**os.environ, **spec.env}, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, spec.ready_path, ready_timeout)
        yield Running(spec, proc, url, served_model(url), time.perf_counter() - t0)
    finally:
        stop_process(proc, stop_timeout)
        if log_path:
            log.close()


def dflash_spec(model: str, draft: Optional[str], dtype: str, extra: Sequence[str] = ()) -> ServerSpec:
    argv = [sys.executable, "-m", "dflash_mlx.cli.main", "serve", "--model", model, "--dtype", dtype,
            "--snapshots", "0", *extra]  # no snapshots: a repeated prompt is not served from an old one
    return ServerSpec("dflash", argv + (["--draft", draft] if draft else []))


def mlx_lm_spec(folder: Path, fast_blas: bool = True) -> ServerSpec:
    launch = [sys.executable, "-c", MLX_LM_WRAPPER] if fast_blas else [sys.executable, "-m", "mlx_lm.server"]
    # continuous batching is its default (--decode-concurrency 32); one cached prompt: see WARMUP_PROMPTS
    return ServerSpec("mlx-lm" if fast_blas else "mlx-lm-refblas",
                      launch + ["--model", str(folder), "--prompt-cache-size", "1", "--log-level", "WARNING"])


def export_folder(model: str, folder: Path, dtype: str) -> Path:
    """`dflash-mlx export` of `model` into `folder` (kept when it already holds an export)."""
    if (folder / "config.json").exists():
        return folder
    subprocess.run([sys.executable, "-m", "dflash_mlx.cli.main", "export", model, str(folder), "--dtype", dtype,
                    "--overwrite"], check=True, stdout=subprocess.DEVNULL)
    return folder


# -- load -----------------------------------------------------------------------


@dataclass
class RequestResult:
    prompt: int  # index into the prompt list
    client: int
    round: int
    sent: float  # seconds from the wave's start
    first: Optional[float] = None  # first content
    done: float = 0.0
    text: str = ""
    tokens: int = 0
    tokens_from: str = "chunks"  # "usage" when the server's usage counted them
    usage: Optional[dict] = None
    error: Optional[str] = None

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first is None else self.first - self.sent

    @property
    def seconds(self) -> float:
        return self.done - self.sent

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Wave:
    server: str
    mode: str  # "concurrent" | "one at a time"
    clients: int
    wall: float
    requests: List[RequestResult]
    health: Optional[dict] = None  # /health after the wave
    health_seen: dict = field(default_factory=dict)  # polled during the wave
    load: tuple = ()  # load average before and after


def sse_events(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON objects of a server-sent event stream, until `data: [DONE]`."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        if data:
            yield json.loads(data)


def chat_body(model: Optional[str], messages: List[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    return body if model is None else {"model": model, **body}


def stream_chat(http: httpx.Client, url: str, body: dict, result: RequestResult, t0: float) -> RequestResult:
    """One streamed chat completion into `result` (times relative to `t0`); errors are recorded, not raised."""
    chunks = 0
    try:
        with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            for event in sse_events(r.iter_lines()):
                if "error" in event:
                    raise RuntimeError(f"error event: {json.dumps(event['error'])[:200]}")
                if event.get("usage"):
                    result.usage = event["usage"]
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        if result.first is None:
                            result.first = time.perf_counter() - t0
                        result.text += piece
                        chunks += 1
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
    result.done = time.perf_counter() - t0
    if result.usage and result.usage.get("completion_tokens") is not None:
        result.tokens, result.tokens_from = result.usage["completion_tokens"], "usage"
    else:
        result.tokens = chunks
    return result


class HealthPoller:
    """GET /health every `every` seconds in a thread while a wave runs: the most requests seen
    queued, how often the server was busy, and the last answer."""

    def __init__(self, url: str, every: float = 0.5):
        self.url, self.every = url, every
        self.seen = {"polls": 0, "max_queued": None, "busy_polls": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=5) as http:
            while not self._stop.wait(self.every):
                try:
                    h = http.get(self.url + "/health").json()
                except (httpx.HTTPError, ValueError):
                    continue
                self.seen["polls"] += 1
                if isinstance(h.get("queued"), int):
                    self.seen["max_queued"] = max(self.seen["max_queued"] or 0, h["queued"])
                self.seen["busy_polls"] += bool(h.get("busy"))
                self.seen["last"] = h

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


def run_wave(url: str, model: Optional[str], prompts: Sequence[List[dict]], clients: int, rounds: int = 1,
             max_tokens: int = 64, concurrent: bool = True,
             on_done: Optional[Callable[[RequestResult], None]] = None, timeout: float = 1800.0) -> tuple:
    """Client c sends prompts c, c + C, c + 2C, ... (`rounds` of them) one after another; with
    `concurrent` the C clients run at once (released together), else every request waits for
    the one before. Returns (wall seconds from the first send to the last byte, results)."""
    n = clients * rounds
    if n > len(prompts):
        raise ValueError(f"{n} requests need {n} distinct prompts; there are {len(prompts)}")
    results = [RequestResult(prompt=r * clients + c, client=c, round=r, sent=0.0)
               for r in range(rounds) for c in range(clients)]
    lock = threading.Lock()
    t0 = time.perf_counter()

    def send(http: httpx.Client, res: RequestResult):
        res.sent = time.perf_counter() - t0
        stream_chat(http, url, chat_body(model, prompts[res.prompt], max_tokens), res, t0)
        if on_done:
            with lock:
                on_done(res)

    if not concurrent:
        with httpx.Client(timeout=timeout) as http:
            for res in results:
                send(http, res)
    else:
        barrier = threading.Barrier(clients)

        def client(c: int):
            with httpx.Client(timeout=timeout) as http:
                barrier.wait()
                for res in results[c::clients]:
                    send(http, res)

        threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall = max(r.done for r in results) - min(r.sent for r in results)
    return wall, results


# -- statistics -----------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def health_widths(health: Optional[dict]) -> dict:
    """What /health says about verify widths or batch rows (keys naming them, at any depth)."""
    found = {}

    def walk(obj, prefix=""):
        if isinstance(obj, dict):
            for k, v in obj.items():
                name = f"{prefix}{k}"
                if re.search(r"width|rows?\b|rows_|batch", k, re.I):
                    found[name] = v
                else:
                    walk(v, name + ".")

    walk(health or {})
    return found


def verify_widths(requests: Sequence[RequestResult]) -> Dict[str, int]:
    """Cycles per verify width over the requests (our usage's `dflash.verify_widths`)."""
    total: Dict[str, int] = {}
    for r in requests:
        for w, n in (((r.usage or {}).get("dflash") or {}).get("verify_widths") or {}).items():
            total[w] = total.get(w, 0) + n
    return dict(sorted(total.items(), key=lambda kv: int(kv[0])))


def summarize(wave: Wave) -> dict:
    ok = [r for r in wave.requests if r.error is None]
    tokens = sum(r.tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tps = [r.tps for r in ok]
    widths = verify_widths(ok)
    cycles = sum(widths.values())
    return {
        "requests": len(wave.requests), "errors": len(wave.requests) - len(ok), "tokens": tokens,
        "tokens_from_usage": all(r.tokens_from == "usage" for r in ok),
        "wall_s": wave.wall, "aggregate_tps": tokens / wave.wall if wave.wall > 0 else 0.0,
        "request_tps_mean": sum(tps) / len(tps) if tps else None, "request_tps_min": min(tps) if tps else None,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
        "verify_widths": widths,
        "mean_verify_width": sum(int(w) * n for w, n in widths.items()) / cycles if cycles else None,
        "health_widths": health_widths(wave.health),
        "max_queued": wave.health_seen.get("max_queued"),
    }


def first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def alone_answers(waves: Sequence[Wave], server: str) -> Dict[int, tuple]:
    """prompt -> (answer, its wave) from the waves in which `server` served one request at a time
    (one client, or the prompts sent in a row); the first answer of each prompt."""
    found: Dict[int, tuple] = {}
    for w in waves:
        if w.server == server and (w.clients == 1 or w.mode == "one at a time"):
            for r in w.requests:
                if r.error is None:
                    found.setdefault(r.prompt, (r.text, w))
    return found


def compare_answers(waves: Sequence[Wave], reference: str = "dflash") -> dict:
    """Every answer against the same prompt's answer from the reference server alone, which
    the reference server must match exactly (`exact_required`: under load, and in a row);
    another server's answers also against its own alone (recorded: two engines can differ on
    near-ties)."""
    alone = {s: alone_answers(waves, s) for s in {w.server for w in waves}}
    mismatches, checked = [], 0
    for w in waves:
        bases = [(reference, alone.get(reference, {}))] + ([(w.server, alone[w.server])] if w.server != reference else [])
        for r in w.requests:
            for against, base in bases:
                if r.error is not None or r.prompt not in base or base[r.prompt][1] is w:
                    continue
                checked += 1
                expected = base[r.prompt][0]
                if r.text != expected:
                    i = first_difference(r.text, expected)
                    mismatches.append({
                        "server": w.server, "mode": w.mode, "clients": w.clients, "prompt": r.prompt,
                        "against": f"{against} alone", "exact_required": w.server == reference,
                        "first_difference": i, "got": r.text[max(0, i - 20):i + 40],
                        "expected": expected[max(0, i - 20):i + 40],
                    })
    return {"reference": f"{reference} alone", "checked": checked, "mismatches": mismatches,
            "own_mismatches": sum(m["exact_required"] for m in mismatches)}


# -- prompts --------------------------------------------------------------------


def load_prompts(n: int, suites: Sequence[str] = SUITES, data_dir: Optional[str] = None) -> List[dict]:
    """`n` chat prompts taken in turn from the suites (first turns), else from a fixed list."""
    try:
        from dflash_mlx.bench.suites import load_suite

        per = [load_suite(s, -(-n // len(suites)), root=data_dir) for s in suites]
        picked = [p for group in zip(*per) for p in group][:n]
        return [{"suite": p.suite, "id": p.id, "messages": p.messages} for p in picked]
    except FileNotFoundError:
        if n > len(FALLBACK_PROMPTS):
            raise
        return [{"suite": "fixed", "id": str(i), "messages": [{"role": "user", "content": t}]}
                for i, t in enumerate(FALLBACK_PROMPTS[:n])]


def warm(run: Running, max_tokens: int, prompts: Sequence[str]) -> None:
    with httpx.Client(timeout=1800) as http:
        for text in prompts:
            res = stream_chat(http, run.url, chat_body(run.model, [{"role": "user", "content": text}], max_tokens),
                              RequestResult(-1, 0, 0, 0.0), time.perf_counter())
            if res.error:
                raise RuntimeError(f"{run.spec.name}: warm-up request failed: {res.error}")


# -- report ---------------------------------------------------------------------


def _fmt(x, spec="{:.1f}"):
    return "" if x is None else spec.format(x)


def markdown(doc: dict) -> str:
    cfg, m = doc["config"], doc["machine"]
    lines = [f"# Serving benchmark ({doc['date']})", "",
             f"`{doc['command']}`", "",
             f"{cfg['model']} (draft {cfg['draft'] or 'packaged'}), {cfg['dtype']}, greedy, {cfg['max_tokens']} tokens "
             f"per request, {cfg['rounds']} request(s) per client; prompts from {', '.join(cfg['suites'])}. "
             f"Machine: {m['cpu']} ({m['cpu_count']} cores), {m['backend']}, BLAS {m['blas']}, "
             f"OPENBLAS_NUM_THREADS={doc['thread_env'].get('OPENBLAS_NUM_THREADS')}; load average "
             f"{doc['load_average']['start'][0]:.2f} at start, {doc['load_average']['end'][0]:.2f} at end.", ""]
    src = doc.get("source") or {}
    if src.get("commit"):
        dirty = src["uncommitted"]
        lines += [f"dflash_mlx at commit {src['commit'][:12]} ({src['dflash_mlx']})"
                        + (f", with uncommitted changes to {', '.join(dirty)}." if dirty else ", no uncommitted changes."), ""]
    for name, s in doc["servers"].items():
        lines.append(f"- **{name}**: `{display_command(s['argv'])}`; ready after {s['startup_s']:.1f} s"
                     + (f"; {s['blas']}" if s.get("blas") else ""))
    if any(s["argv"][1:2] == ["-c"] for s in doc["servers"].values()):
        lines.append(f"- `<MLX_LM_WRAPPER>`: `{MLX_LM_WRAPPER}`")
    lines += ["", "Aggregate tok/s = all completion tokens of a wave / its wall time (first send to last byte); "
              "per-request tok/s = a request's tokens / its send-to-last-byte time (queueing included); "
              "TTFT = send to first content. *one at a time*: the same prompts sent in a row to our server, the "
              "baseline of the x column (at one client: its concurrent wave).", "",
              "| server | clients | mode | tokens | aggregate tok/s | x ours one at a time | per-request tok/s mean | min | "
              "TTFT p50 (s) | TTFT p95 (s) | max queued | /health widths/rows | mean verify width (usage) |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    in_a_row = {w["clients"]: w["summary"]["aggregate_tps"] for w in doc["waves"]
                if w["server"] == "dflash" and (w["mode"] == "one at a time" or w["clients"] == 1)}
    for w in doc["waves"]:
        s = w["summary"]
        base = in_a_row.get(w["clients"])
        ratio = f"{s['aggregate_tps'] / base:.2f}x" if base else ""
        hw = "; ".join(f"{k}: {v}" for k, v in s["health_widths"].items())
        err = f" ({s['errors']} failed)" if s["errors"] else ""
        lines.append(f"| {w['server']} | {w['clients']} | {w['mode']} | {s['tokens']}{err} | {s['aggregate_tps']:.1f} | {ratio} | "
                     f"{_fmt(s['request_tps_mean'])} | {_fmt(s['request_tps_min'])} | {_fmt(s['ttft_p50_s'], '{:.2f}')} | "
                     f"{_fmt(s['ttft_p95_s'], '{:.2f}')} | {_fmt(s['max_queued'], '{}')} | {hw} | "
                     f"{_fmt(s['mean_verify_width'], '{:.2f}')} |")
    a = doc["answers"]
    lines += ["", "## Answers", "",
              f"{a['checked']} answers compared with {a['reference']} (same prompt, greedy): "
              f"{len(a['mismatches'])} differ."]
    if a.get("own_mismatches"):
        lines += ["", f"**WARNING: {a['own_mismatches']} of our server's answers under load differ from its answer "
                  "alone. They must be identical.**"]
    for mm in a["mismatches"]:
        lines.append(f"- {mm['server']} {mm['mode']} C={mm['clients']}, prompt {mm['prompt']} vs {mm['against']}: "
                     f"first difference at character {mm['first_difference']}: {mm['got']!r} vs {mm['expected']!r}")
    return "\n".join(lines) + "\n"


def _line_plot(path: Path, title: str, ylabel: str, series: List[tuple]):
    """One figure: `series` of (label, xs, ys, style kwargs), clients on a log-2 axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs_all = sorted({x for _, xs, _, _ in series for x in xs})
    for label, xs, ys, style in series:
        ax.plot(xs, ys, marker="o", label=label, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs_all, [str(x) for x in xs_all])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plots(doc: dict, out: Path) -> List[Path]:
    by = {}
    for w in doc["waves"]:
        by.setdefault((w["server"], w["mode"]), []).append((w["clients"], w["summary"]))
    title = f"{doc['config']['model']}, {doc['config']['max_tokens']} tokens, {doc['machine']['backend']}"
    thr, ttft = [], []
    for i, ((server, mode), rows) in enumerate(by.items()):
        rows.sort(key=lambda r: r[0])
        xs = [c for c, _ in rows]
        color = f"C{i}"
        label = server if mode == "concurrent" else f"{server}, {mode}"
        thr.append((label, xs, [s["aggregate_tps"] for _, s in rows], {"color": color}))
        ttft.append((f"{label} p50", xs, [s["ttft_p50_s"] for _, s in rows], {"color": color}))
        ttft.append((f"{label} p95", xs, [s["ttft_p95_s"] for _, s in rows], {"color": color, "ls": "--"}))
    _line_plot(out / "throughput.png", f"Aggregate tok/s — {title}", "completion tokens / s (all clients)", thr)
    _line_plot(out / "ttft.png", f"Time to first token — {title}", "seconds", ttft)
    return [out / "throughput.png", out / "ttft.png"]


def write_outputs(doc: dict, out: Path, with_plots: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "README.md").write_text(markdown(doc))
    if with_plots:
        plots(doc, out)


def wave_record(w: Wave) -> dict:
    return {"server": w.server, "mode": w.mode, "clients": w.clients, "summary": summarize(w),
            "health": w.health, "health_seen": {k: v for k, v in w.health_seen.items() if k != "last"},
            "load": list(w.load), "requests": [dict(asdict(r), ttft=r.ttft, tps=r.tps) for r in w.requests]}


# -- main -----------------------------------------------------------------------


def source_state() -> dict:
    """Which dflash_mlx the servers run: its folder, and the git commit and uncommitted files there."""
    import dflash_mlx

    root = Path(dflash_mlx.__file__).resolve().parent
    state = {"dflash_mlx": str(root), "commit": None, "uncommitted": None}
    try:
        git = ["git", "-C", str(root)]
        state["commit"] = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                                         check=True).stdout.strip()
        status = subprocess.run(git + ["status", "--porcelain", "--", "."], capture_output=True, text=True,
                                check=True).stdout
        state["uncommitted"] = [line[3:] for line in status.splitlines() if line.strip()]
    except (OSError, subprocess.CalledProcessError):
        pass
    return state


def parse_clients(text: str) -> List[int]:
    try:
        cs = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        cs = []
    if not cs or min(cs) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of whole numbers >= 1, got {text!r}")
    return sorted(set(cs))


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=parse_clients, default=[1, 2, 4, 8], help="client counts (default: 1,2,4,8)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="requests per client, one after another (default: 1)")
    p.add_argument("--servers", default="dflash,mlx-lm",
                   help="comma list of dflash, dflash-baseline (ours, no draft), mlx-lm, mlx-lm-refblas "
                   "(python -m mlx_lm.server: MLX's reference BLAS) (default: dflash,mlx-lm)")
    p.add_argument("--model", default="smollm2-135m", help="packaged name, folder or hub id (default: smollm2-135m)")
    p.add_argument("--draft", default=None, help="our server's draft (default: the packaged one)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--no-sequential", action="store_true", help="skip sending the prompts one at a time to ours")
    p.add_argument("--suites", default=",".join(SUITES), help=f"prompt suites (default: {','.join(SUITES)})")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--warmup-tokens", type=int, default=64, help="tokens of each of the 2 first warm-up requests")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="where the mlx-lm export goes (kept and reused; default: a temporary folder, removed)")
    p.add_argument("--out", type=Path, default=None,
                   help="result folder (default: benchmarks/results/<YYYYMMDD>-serve)")
    p.add_argument("--no-plots", action="store_true")
    return p


def server_specs(names: Sequence[str], args, export: Callable[[], Path]) -> List[ServerSpec]:
    specs = []
    for name in names:
        if name == "dflash":
            specs.append(dflash_spec(args.model, args.draft, args.dtype))
        elif name == "dflash-baseline":
            spec = dflash_spec(args.model, None, args.dtype, ["--baseline"])
            spec.name = name
            specs.append(spec)
        elif name in ("mlx-lm", "mlx-lm-refblas"):
            specs.append(mlx_lm_spec(export(), fast_blas=name == "mlx-lm"))
        else:
            raise ValueError(f"unknown server {name!r}; known: {', '.join(SERVER_KINDS)}")
    return specs


def blas_line(log: Path) -> Optional[str]:
    text = log.read_text(errors="replace") if log.exists() else ""
    m = re.search(r"serve_bench: (BLAS .*)", text)
    return m.group(1) if m else None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out or Path(__file__).resolve().parent / "results" / f"{time.strftime('%Y%m%d')}-serve"
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = [n for n in names if n not in SERVER_KINDS]
    if unknown or not names:
        build_parser().error(f"--servers: unknown {', '.join(unknown) or 'empty list'}; known: {', '.join(SERVER_KINDS)}")
    import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing, for the machine description)
    from dflash_mlx.cli.doctor import machine
    from dflash_mlx.progress import Progress

    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    n_prompts = max(args.clients) * args.rounds
    prompts = load_prompts(n_prompts, suites, args.data_dir)
    messages = [p["messages"] for p in prompts]

    def interrupted(sig, frame):  # Ctrl-C or a kill of the benchmark: the servers are stopped too
        for s in (signal.SIGINT, signal.SIGTERM):  # once: a second Ctrl-C must not cut the cleanup short
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a background job starts with it ignored
        signal.signal(sig, interrupted)
    tmp = None
    work = args.work_dir
    if work is None:
        tmp = work = Path(tempfile.mkdtemp(prefix="serve-bench-"))

    def export():
        print(f"serve_bench: exporting {args.model} ({args.dtype}) for mlx-lm into {work / 'mlx-lm'}", file=sys.stderr)
        return export_folder(args.model, work / "mlx-lm", args.dtype)

    (out / "logs").mkdir(parents=True, exist_ok=True)
    doc = {"schema": SCHEMA, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python", "benchmarks/serve_bench.py", *(argv if argv is not None else sys.argv[1:])]),
           "config": {"clients": args.clients, "max_tokens": args.max_tokens, "rounds": args.rounds,
                      "servers": names, "model": args.model, "draft": args.draft, "dtype": args.dtype,
                      "suites": suites, "sequential": not args.no_sequential},
           "machine": machine(), "source": source_state(), "thread_env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")},
           "load_average": {"start": os.getloadavg()}, "prompts": prompts, "servers": {}, "waves": []}
    waves: List[Wave] = []
    # client count by client count, servers interleaved: drift in the machine's load hits all alike
    sequential = not args.no_sequential and "dflash" in names
    plan = [(name, c, mode) for c in args.clients
            for name, mode in [(n, "concurrent") for n in names] + ([("dflash", "one at a time")] if sequential and c > 1 else [])]
    progress = Progress(sum(c * args.rounds for _, c, _ in plan), "serve bench", "requests")
    done = [0]
    try:
        with contextlib.ExitStack() as stack:
            running = {}
            for spec in server_specs(names, args, export):
                print(f"serve_bench: starting {spec.name}", file=sys.stderr)
                log = out / "logs" / f"{spec.name}.log"
                run = running[spec.name] = stack.enter_context(serve(spec, log))
                warm(run, args.warmup_tokens, WARMUP_PROMPTS[:2])
                doc["servers"][spec.name] = {"argv": spec.argv, "startup_s": run.startup_s, "model_id": run.model,
                                             "blas": blas_line(log), "health": httpx.get(run.url + "/health").json()}
                if spec.name == "mlx-lm-refblas":
                    doc["servers"][spec.name]["blas"] = "no dflash_mlx import: MLX's bundled reference BLAS"
                elif spec.name.startswith("dflash"):
                    doc["servers"][spec.name]["blas"] = "BLAS as `dflash-mlx serve` (imports dflash_mlx first)"
            for name, clients, mode in plan:
                run = running[name]
                warm(run, 4, WARMUP_PROMPTS[2:])  # replaces the live cache: no prompt of this wave in it

                def tick(res, name=name, clients=clients, mode=mode):
                    done[0] += 1
                    progress.update(done[0], f"| {name} C={clients} {mode}")

                load0 = os.getloadavg()[0]
                with HealthPoller(run.url) as poller:
                    wall, results = run_wave(run.url, run.model, messages, clients, args.rounds, args.max_tokens,
                                             concurrent=mode == "concurrent", on_done=tick)
                health = httpx.get(run.url + "/health", timeout=10).json()
                wave = Wave(name, mode, clients, wall, results, health, poller.seen, (load0, os.getloadavg()[0]))
                waves.append(wave)
                doc["waves"].append(wave_record(wave))
                doc["answers"] = compare_answers(waves)
                doc["load_average"]["end"] = os.getloadavg()
                write_outputs(doc, out, with_plots=False)  # kept after every wave: an interrupted run keeps its data
        progress.close()
    except KeyboardInterrupt:
        progress.close()
        print("serve_bench: interrupted; the servers are stopped and the waves so far are in "
              f"{out}", file=sys.stderr)
        return 130
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    doc["load_average"]["end"] = os.getloadavg()
    write_outputs(doc, out, with_plots=not args.no_plots)
    print(markdown(doc))
    if doc["answers"].get("own_mismatches"):
        print(f"serve_bench: WARNING: {doc['answers']['own_mismatches']} answers of our server under load differ "
              "from its answer alone", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
