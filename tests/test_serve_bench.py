"""benchmarks/serve_bench.py without models: its load generator, statistics, answer checks,
report and process handling, against a slow fake OpenAI-compatible server in its own process."""

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import httpx
import pytest

_spec = importlib.util.spec_from_file_location(
    "serve_bench", Path(__file__).resolve().parents[1] / "benchmarks" / "serve_bench.py")
sb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sb)

# A streaming chat server: the answer is the user message's words, one per chunk, `--delay`
# seconds apart; /health says how many streams ran at once at most (and the pid of a child it
# started, for the cleanup test).
STUB = r'''
import json, subprocess, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
opt = lambda name: name in argv
delay = float(argv[argv.index("--delay") + 1]) if opt("--delay") else 0.05
port = int(argv[argv.index("--port") + 1])
if opt("--ignore-term"):
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if opt("--exit"):
    sys.exit(3)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) if opt("--child") else None
state = {"active": 0, "max_active": 0}
lock = threading.Lock()

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def send_json(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self.send_json({"status": "ok", "queued": 0, "busy": state["active"] > 0, "max_active": state["max_active"],
                            "child": child.pid if child else None, "widths": {"4": 2}})
        elif self.path == "/v1/models":
            self.send_json({"data": [{"id": "stub"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        words = body["messages"][-1]["content"].split()[: body["max_tokens"]]
        with lock:
            state["active"] += 1
            state["max_active"] = max(state["max_active"], state["active"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        send = lambda obj: (self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode()), self.wfile.flush())
        send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i, w in enumerate(words):
            time.sleep(delay)
            send({"choices": [{"index": 0, "delta": {"content": (" " if i else "") + w}}]})
        if body.get("stream_options", {}).get("include_usage") and not opt("--no-usage"):
            send({"choices": [], "usage": {"completion_tokens": len(words), "prompt_tokens": 1}})
        # Counted out before [DONE] goes: a client that has read it may send its next request
        # at once, and that one must not overlap this one in the count.
        with lock:
            state["active"] -= 1
        self.wfile.write(b"data: [DONE]\n\n")

ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''

WORDS = "alpha beta gamma delta epsilon zeta"


def stub(*flags) -> "sb.ServerSpec":
    return sb.ServerSpec("stub", [sys.executable, "-c", STUB, *flags])


def prompts(n):
    return [[{"role": "user", "content": f"{WORDS} p{i}"}] for i in range(n)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def test_concurrent_clients_really_run_at_once():
    delay, clients = 0.05, 4
    one = 7 * delay  # 7 words each
    with sb.serve(stub("--delay", str(delay)), ready_timeout=20) as run:
        assert run.model == "stub"
        done = []
        wall, results = sb.run_wave(run.url, run.model, prompts(8), clients, rounds=2, max_tokens=64,
                                    on_done=done.append)
        assert httpx.get(run.url + "/health").json()["max_active"] == clients
    assert len(done) == len(results) == 8
    assert [r.prompt for r in results] == list(range(8))
    # 2 rounds of C clients at once take about 2 requests' time, not 8
    assert 2 * one <= wall < 2 * one + 0.6
    first_round = [r for r in results if r.round == 0]
    assert max(r.sent for r in first_round) < min(r.done for r in first_round)  # all in flight together
    for r in results:
        assert r.error is None
        assert r.text == f"{WORDS} p{r.prompt}"
        assert (r.tokens, r.tokens_from) == (7, "usage")
        assert delay * 0.8 <= r.ttft < delay + 0.3
        second = next(x for x in results if x.client == r.client and x.round == 1)
        if r.round == 0:
            assert second.sent >= r.done  # a client's rounds follow each other


def test_one_at_a_time_waits_for_each_answer():
    with sb.serve(stub("--delay", "0.02"), ready_timeout=20) as run:
        wall, results = sb.run_wave(run.url, run.model, prompts(3), 3, concurrent=False)
        assert httpx.get(run.url + "/health").json()["max_active"] == 1
    assert all(b.sent >= a.done for a, b in zip(results, results[1:]))
    assert wall >= 3 * 7 * 0.02


def test_tokens_counted_from_chunks_without_usage_and_max_tokens_sent():
    with sb.serve(stub("--delay", "0", "--no-usage"), ready_timeout=20) as run:
        _, (r,) = sb.run_wave(run.url, None, prompts(1), 1, max_tokens=3)
    assert (r.text, r.tokens, r.tokens_from, r.usage) == ("alpha beta gamma", 3, "chunks", None)


def test_errors_are_recorded_not_raised():
    r = sb.stream_chat(httpx.Client(timeout=2), f"http://127.0.0.1:{sb.free_port()}",
                       sb.chat_body(None, prompts(1)[0], 4), sb.RequestResult(0, 0, 0, 0.0), time.perf_counter())
    assert r.error and r.tokens == 0 and r.ttft is None


def test_server_stopped_on_error_even_when_it_ignores_sigterm(tmp_path):
    log = tmp_path / "stub.log"
    with pytest.raises(KeyError):
        with sb.serve(stub("--ignore-term", "--child"), log_path=log, ready_timeout=20, stop_timeout=0.5) as run:
            child = httpx.get(run.url + "/health").json()["child"]
            assert alive(run.proc.pid) and alive(child)
            raise KeyError("the benchmark failed")
    assert run.proc.poll() is not None  # killed after the 0.5 s grace
    deadline = time.time() + 5
    while alive(child) and time.time() < deadline:  # the server's whole process group goes
        time.sleep(0.05)
    assert not alive(child)
    with pytest.raises(httpx.TransportError):
        httpx.get(run.url + "/health", timeout=1)


def test_server_that_exits_at_start_is_an_error():
    with pytest.raises(RuntimeError, match="exited with status 3"):
        with sb.serve(stub("--exit"), ready_timeout=20):
            pass


def test_sse_events():
    lines = ["", ": comment", "event: x", 'data: {"a": 1}', "", "data:{\"b\": 2}", "data: [DONE]", 'data: {"c": 3}']
    assert list(sb.sse_events(lines)) == [{"a": 1}, {"b": 2}]


def test_percentile_matches_linear_interpolation():
    assert sb.percentile([], 50) is None
    assert sb.percentile([7.0], 95) == 7.0
    assert sb.percentile([4, 1, 3, 2], 50) == 2.5
    assert sb.percentile([1, 2, 3, 4], 95) == pytest.approx(3.85)
    assert sb.percentile(list(range(1, 11)), 0) == 1 and sb.percentile(list(range(1, 11)), 100) == 10
    np = pytest.importorskip("numpy")
    xs = [0.3, 5.1, 2.2, 9.9, 0.01, 4.4, 7.0]
    for q in (5, 50, 95, 99):
        assert sb.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def request(prompt, sent, first, done, tokens, text="x", widths=None, error=None):
    usage = {"completion_tokens": tokens, "dflash": {"verify_widths": widths}} if widths else None
    return sb.RequestResult(prompt, prompt, 0, sent, first, done, text, tokens, "usage", usage, error)


def test_summary_rates_and_latencies():
    reqs = [request(0, 0.0, 0.5, 2.0, 40, widths={"4": 5, "1": 2}), request(1, 0.0, 1.0, 4.0, 40, widths={"4": 3}),
            request(2, 0.5, 2.0, 4.5, 20), request(3, 0.5, None, 0.6, 0, error="HTTP 429")]
    s = sb.summarize(sb.Wave("dflash", "concurrent", 4, 4.5, reqs, health={"status": "ok", "batch": {"rows": 3}},
                             health_seen={"max_queued": 2}))
    assert s["tokens"] == 100 and s["errors"] == 1 and s["requests"] == 4
    assert s["aggregate_tps"] == pytest.approx(100 / 4.5)
    assert s["request_tps_mean"] == pytest.approx((20 + 10 + 5) / 3)
    assert s["request_tps_min"] == pytest.approx(5.0)
    assert s["ttft_p50_s"] == pytest.approx(1.0)
    assert s["ttft_p95_s"] == pytest.approx(1.0 + 0.9 * 0.5)
    assert s["verify_widths"] == {"1": 2, "4": 8}
    assert s["mean_verify_width"] == pytest.approx((2 + 32) / 10)
    assert s["health_widths"] == {"batch": {"rows": 3}}
    assert s["max_queued"] == 2
    assert sb.health_widths({"status": "ok", "block_size": "auto", "queued": 0}) == {}


def test_answers_compared_with_ours_alone():
    def wave(server, clients, texts, mode="concurrent"):
        return sb.Wave(server, mode, clients, 1.0, [request(i, 0, 0.1, 1, 5, t) for i, t in enumerate(texts)])

    waves = [wave("dflash", 1, ["a0"]), wave("mlx-lm", 1, ["a0"]),
             wave("dflash", 2, ["a0", "a1"]), wave("mlx-lm", 2, ["a0", "b1"]),
             wave("dflash", 3, ["a0", "a1", "XX"]), wave("mlx-lm", 3, ["c0", "b1", "a2"]),
             wave("dflash", 3, ["a0", "a1", "a2"], "one at a time")]
    out = sb.compare_answers(waves)
    got = {(m["server"], m["clients"], m["mode"], m["prompt"], m["against"]): m["exact_required"]
           for m in out["mismatches"]}
    assert got == {
        ("dflash", 3, "concurrent", 2, "dflash alone"): True,  # under load vs alone (in a row): must match
        ("mlx-lm", 2, "concurrent", 1, "dflash alone"): False,
        ("mlx-lm", 3, "concurrent", 1, "dflash alone"): False,
        ("mlx-lm", 3, "concurrent", 0, "dflash alone"): False,
        ("mlx-lm", 3, "concurrent", 0, "mlx-lm alone"): False,
    }
    assert out["own_mismatches"] == 1
    # ours: 2 + 3 under load, 1 in a row (its other prompts define "alone"); mlx-lm: 1 + 2 + 3 vs ours,
    # 1 + 1 vs its own alone (prompt 0 only)
    assert out["checked"] == 14
    assert sb.first_difference("abcd", "abXd") == 2 and sb.first_difference("ab", "abc") == 2


def test_report_files(tmp_path):
    reqs = [request(0, 0.0, 0.2, 1.0, 8, widths={"2": 4})]
    waves = [sb.Wave(s, "concurrent", c, 1.0, reqs) for c in (1, 2) for s in ("dflash", "mlx-lm")]
    waves.append(sb.Wave("dflash", "one at a time", 2, 2.0, reqs))
    doc = {"date": "2026-12-03", "command": "python benchmarks/serve_bench.py",
           "config": {"model": "m", "draft": None, "dtype": "float32", "max_tokens": 8, "rounds": 1, "suites": ["x"]},
           "machine": {"cpu": "cpu", "cpu_count": 2, "backend": "cpu", "blas": "openblas"},
           "thread_env": {}, "load_average": {"start": [0.5], "end": [1.0]},
           "servers": {"mlx-lm": {"argv": [sys.executable, "-c", sb.MLX_LM_WRAPPER, "--model", "f"], "startup_s": 1.0}},
           "waves": [sb.wave_record(w) for w in waves], "answers": sb.compare_answers(waves)}
    sb.write_outputs(doc, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", "README.md", "throughput.png", "ttft.png"}
    readme = (tmp_path / "README.md").read_text()
    assert "| dflash | 2 | one at a time | 8 | 4.0 | 1.00x |" in readme
    assert "| mlx-lm | 2 | concurrent | 8 | 8.0 | 2.00x |" in readme
    assert "`python -c '<MLX_LM_WRAPPER>' --model f`" in readme
    assert json.loads((tmp_path / "results.json").read_text())["waves"][0]["summary"]["aggregate_tps"] == 8.0


def test_parse_clients():
    assert sb.parse_clients("8,1,2,2") == [1, 2, 8]
    for bad in ("", "0", "a,b"):
        with pytest.raises(Exception):
            sb.parse_clients(bad)
