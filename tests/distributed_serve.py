"""`dflash-mlx serve --distributed tensor` under the driver's `mlx.launch -n 2` (tests/distributed_driver.py).

`serve_and_interrupt`: both ranks run the serve command in this process; rank 0 serves HTTP, and
a client thread there sends two requests at once (rows of one batch), then one that starts
with the first's prompt and answer (a cached conversation on every rank), then Ctrl-C to both
ranks: rank 0 stops the run, and every rank ends. `serve_and_lose_rank1`: after an answer, rank 1
ends itself (exit 0, so mlx.launch stops nobody); rank 0 must find it gone on its own and end
with one line within seconds. (A rank lost in mid-forward can leave MLX's ring waiting: there
mlx.launch's SIGTERM ends the others, as docs/distributed.md says.)
"""

import contextlib
import io
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from dflash_mlx.cli.main import main as cli_main

PROMPTS = [("hello there", 24), ("the quick brown fox", 12)]


def _serve(model: str, draft: str, port: int) -> int:
    stdout = sys.stdout
    try:
        return cli_main(["serve", "--distributed", "tensor", "--model", model, "--draft", draft, "--port", str(port),
                         "--max-batch", "4", "--temperature", "0"])
    finally:
        sys.stdout = stdout  # (rank 1's serve sent its standard output to devnull)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _up(url: str) -> str:
    deadline = time.time() + 60
    while True:
        try:
            return httpx.get(url + "/health", timeout=5).json()["model"]
        except httpx.HTTPError:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.1)


def _ask(url, model, prompt, n):
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": n}, timeout=60)
    body = r.json()
    return {"prompt": prompt, "max_tokens": n, "status": r.status_code, "text": body["choices"][0]["text"],
            "usage": body["usage"]} if r.status_code == 200 else {"status": r.status_code, "error": body}


def _pid_of_rank1(folder: str) -> int:
    path = os.path.join(folder, "serve_pid1")
    while not os.path.exists(path):
        time.sleep(0.02)
    return int(open(path).read())


def serve_and_interrupt(folder: str, rank: int, model: str, draft: str) -> dict:
    """Both ranks: the two-client session, ended by Ctrl-C to both. Rank 0: the answers."""
    if rank != 0:
        with open(os.path.join(folder, "serve_pid1.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.path.join(folder, "serve_pid1.tmp"), os.path.join(folder, "serve_pid1"))
        return {"code": _serve(model, draft, 0)}
    port, out = _port(), {}

    def client():
        try:
            url = f"http://127.0.0.1:{port}"
            name = _up(url)
            with ThreadPoolExecutor(2) as pool:
                out["together"] = list(pool.map(lambda pn: _ask(url, name, *pn), PROMPTS))
            first = out["together"][0]
            out["follow_up"] = _ask(url, name, first["prompt"] + first.get("text", "") + " and", 10)
            out["health"] = httpx.get(url + "/health", timeout=5).json()
        finally:  # Ctrl-C on one machine reaches every rank
            os.kill(_pid_of_rank1(folder), signal.SIGINT)
            time.sleep(0.1)
            out["interrupted_at"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    out["code"] = _serve(model, draft, port)
    out["stop_seconds"] = time.monotonic() - out.pop("interrupted_at", time.monotonic())
    thread.join(5)
    return out


def serve_and_lose_rank1(folder: str, rank: int, model: str, draft: str) -> dict:
    """Rank 1 ends itself once rank 0 answered; rank 0's result (rank 1 does not return)."""
    flag = os.path.join(folder, "lose_rank1")
    if rank != 0:
        def die():
            while not os.path.exists(flag):
                time.sleep(0.02)
            os._exit(0)

        threading.Thread(target=die, daemon=True).start()
        _serve(model, draft, 0)
        os._exit(0)
    port, out = _port(), {}

    def client():
        url = f"http://127.0.0.1:{port}"
        out["answer"] = _ask(url, _up(url), "a", 4)
        out["lost_at"] = time.monotonic()
        open(flag, "w").close()  # between requests: rank 0 finds it at its next empty step
        if not finished.wait(30):  # not found: stop it (STOP_S later it ends, the test fails, nothing hangs)
            os.kill(os.getpid(), signal.SIGTERM)

    finished = threading.Event()

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        out["code"] = _serve(model, draft, port)
    finished.set()
    out["seconds"] = time.monotonic() - out.get("lost_at", time.monotonic())
    thread.join(5)
    out["stderr"] = [line for line in err.getvalue().splitlines() if not line.startswith("INFO:")]
    return out
