"""A coding agent's session replayed through `dflash-mlx serve`: copies from earlier requests.

    OPENBLAS_NUM_THREADS=1 nice -n 5 python benchmarks/agent_trace.py [--files 4] [--out DIR]

The agent applies one change to four similar modules (a codemod: the same validation added
to `list_<things>` in `app/users.py`, `app/orders.py`, ...; the modules are generated here,
deterministically). Each module is one task in its own conversation, and every request
resends that conversation whole, grown by the last answer and the next turn:

  1. the task                     -> the agent asks for the file (a read_file tool call)
  2. the file                     -> the agent proposes the edit (an edit_file tool call)
  3. "edit applied"               -> the agent re-emits the edited file
  4. the test run's output        -> the agent summarises it
  5. "commit message?"            -> the agent writes one

Tool calls are JSON in the answer's text (SmolLM2's template has no tool support), tool results
come back as user turns. 5 requests x 4 modules = 20 requests, streamed with the OpenAI client
(greedy, one at a time) to five servers of SmolLM2-135M-Instruct started by this script:
plain decoding (`--baseline`), copies without the draft (`draft=None`) with and without the
index of earlier requests (`--no-global-copies`), and the shipped draft with and without it.
Every request goes to the five servers in an order that rotates from request to request;
all must answer the same text. tok/s is the server's own (usage.dflash.tokens_per_second,
after the first token); the session's rate is its tokens over the seconds they took.
Writes `results.json`, `README.md` and `tok_s.png` to `--out`.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {  # name -> (draft?, global index?, baseline?)
    "plain": (False, False, True),
    "copies": (False, False, False),
    "copies + global": (False, True, False),
    "draft": (True, False, False),
    "draft + global": (True, True, False),
}
MODEL = "smollm2-135m"
ENTITIES = [("user", "email", "str"), ("order", "total", "float"), ("product", "price", "float"),
            ("invoice", "amount", "float"), ("customer", "phone", "str"), ("shipment", "weight", "float")]

SYSTEM = (
    "You are a coding agent. To use a tool, answer with one JSON object and nothing else: "
    '{"name": TOOL, "arguments": {...}}. Tools: read_file(path), edit_file(path, old, new), '
    "run_tests(path). Otherwise answer briefly."
)


def module_source(thing: str, field: str, kind: str) -> str:
    title = thing.capitalize()
    return f'''"""{title} records: create, read, list and delete, kept in memory."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

_STORE: Dict[int, "{title}"] = {{}}
_NEXT_ID = 1


@dataclass
class {title}:
    id: int
    name: str
    {field}: {kind}
    tags: List[str] = field(default_factory=list)


def create_{thing}(name: str, {field}: {kind}) -> {title}:
    global _NEXT_ID
    item = {title}(_NEXT_ID, name, {field})
    _STORE[item.id] = item
    _NEXT_ID += 1
    return item


def get_{thing}({thing}_id: int) -> Optional[{title}]:
    return _STORE.get({thing}_id)


def list_{thing}s(limit: int = 20) -> List[{title}]:
    return list(_STORE.values())[:limit]


def delete_{thing}({thing}_id: int) -> bool:
    return _STORE.pop({thing}_id, None) is not None
'''


def test_output(thing: str) -> str:
    return (f"============================= test session starts ==============================\n"
            f"collected 6 items\n\ntests/test_{thing}s.py ......                                       [100%]\n\n"
            f"============================== 6 passed in 0.04s ===============================")


def turns(thing: str, field: str, kind: str):
    """The user turns of one module's task (the first is the task itself)."""
    path = f"app/{thing}s.py"
    yield (f"In {path}, make list_{thing}s raise ValueError(\"limit must be at least 1\") when limit is "
           "below 1. Start by reading the file.", 60)
    yield f"Tool result (read_file {path}):\n```python\n{module_source(thing, field, kind)}```\nNow make the edit.", 160
    yield "Tool result (edit_file): 1 edit applied.\nShow the whole edited file in one python code block.", 420
    yield (f"Tool result (run_tests {path}):\n```\n{test_output(thing)}\n```\nSummarise the result in two "
           "sentences.", 80)
    yield "Write a one-line commit message for this change.", 40


# -- the servers -----------------------------------------------------------------------------


def serve(name: str, port: int):
    """One server of configuration `name` (this script runs itself in a subprocess per server)."""
    import uvicorn

    import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
    from dflash_mlx import load, load_draft
    from dflash_mlx.serve.app import create_app
    from dflash_mlx.serve.worker import Worker

    use_draft, use_global, baseline = CONFIGS[name]
    model, tok = load(MODEL, quiet=True)
    draft = load_draft(MODEL, model) if use_draft else None
    kwargs = {} if use_global else {"global_copies_bytes": 0}
    worker = Worker(model, draft, tok, model_name=MODEL, draft_name=MODEL if use_draft else None,
                    baseline=baseline, **kwargs)
    uvicorn.run(create_app(worker), host="127.0.0.1", port=port, log_level="warning")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers():
    import httpx

    servers = {}
    for name in CONFIGS:
        port = free_port()
        proc = subprocess.Popen([sys.executable, __file__, "--serve", name, "--port", str(port)])
        servers[name] = (proc, f"http://127.0.0.1:{port}")
    deadline = time.time() + 600
    for name, (proc, url) in servers.items():
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server {name!r} exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise SystemExit(f"server {name!r} did not start")
            time.sleep(1)
    return servers


# -- the client ------------------------------------------------------------------------------


def ask(url: str, messages, max_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)
    text, usage, finish = [], None, None
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    d = usage.dflash
    return {"text": "".join(text), "tokens": usage.completion_tokens, "prompt_tokens": usage.prompt_tokens,
            "tps": d["tokens_per_second"], "seconds": d["seconds"], "wall": time.perf_counter() - t0,
            "proposals": d.get("proposals", {}), "finish": finish, "reused": d["prompt_tokens_reused"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=4, help="modules the agent edits (5 requests each)")
    ap.add_argument("--one-conversation", action="store_true",
                    help="every module's task in one conversation, resent whole (default: one per module)")
    ap.add_argument("--out", default=f"benchmarks/results/{time.strftime('%Y%m%d')}-agent-trace")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve, args.port)

    load_start, started = os.getloadavg(), time.perf_counter()
    servers = start_servers()
    names = list(CONFIGS)
    requests = []
    try:
        warm = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello."}]
        for name in names:  # first graphs and the width policy's first cycles, on a request not measured
            ask(servers[name][1], warm, 24)
        messages = [{"role": "system", "content": SYSTEM}]
        for f, (thing, field, kind) in enumerate(ENTITIES[: args.files]):
            if not args.one_conversation:
                messages = [{"role": "system", "content": SYSTEM}]
            for step, (user, max_tokens) in enumerate(turns(thing, field, kind)):
                messages.append({"role": "user", "content": user})
                k = len(requests)
                order = names[k % len(names):] + names[: k % len(names)]
                answers = {name: ask(servers[name][1], messages, max_tokens) for name in order}
                texts = {a["text"] for a in answers.values()}
                requests.append({"file": thing, "step": step + 1, "max_tokens": max_tokens,
                                 "identical": len(texts) == 1, "answers": answers})
                a = answers["plain"]
                print(f"[{k + 1:2d}] {thing} step {step + 1}: {a['tokens']} tokens ({a['finish']}), "
                      + ", ".join(f"{n} {answers[n]['tps']:.0f}" for n in names) + " tok/s", file=sys.stderr)
                messages.append({"role": "assistant", "content": a["text"]})
        health = {name: __import__("httpx").get(url + "/health", timeout=10).json() for name, (_, url) in servers.items()}
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(30)
    report(requests, health, args, load_start, os.getloadavg(), time.perf_counter() - started)


def session(requests, name):
    """(tokens, seconds generating after each first token, seconds in all) over the session."""
    tokens = sum(r["answers"][name]["tokens"] for r in requests)
    decode = sum((r["answers"][name]["tokens"] - 1) / r["answers"][name]["tps"]
                 for r in requests if r["answers"][name]["tps"] > 0)
    total = sum(r["answers"][name]["seconds"] for r in requests)
    return tokens, decode, total


def report(requests, health, args, load_start, load_end, seconds):
    from dflash_mlx.cli.doctor import machine, results_footer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = list(CONFIGS)
    rates = {n: session(requests, n) for n in names}
    plain = rates["plain"]
    summary = {n: {"tokens": t, "decode_tok_s": (t - len(requests)) / d, "end_to_end_tok_s": t / s,
                   "speedup_decode": ((t - len(requests)) / d) / ((plain[0] - len(requests)) / plain[1]),
                   "speedup_end_to_end": (t / s) / (plain[0] / plain[2]),
                   "tokens_from": {k: sum(r["answers"][n]["proposals"].get(k, [0, 0])[1] for r in requests)
                                   for k in ("draft", "tree", "copy", "global_copy", "plain")}}
               for n, (t, d, s) in rates.items()}
    doc = {"requests": requests, "summary": summary, "health": health, "machine": machine(),
           "load_start": load_start, "load_end": load_end, "seconds": seconds,
           "files": args.files, "one_conversation": args.one_conversation,
           "env": {"OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS")}}
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out / "results.json")
    identical = all(r["identical"] for r in requests)
    lengths = sum(r["answers"]["plain"]["finish"] == "length" for r in requests)
    where = ("all modules in one conversation" if args.one_conversation else "each module a conversation")
    lines = [f"# An agent session through the server ({time.strftime('%Y-%m-%d')})", "",
             f"{len(requests)} requests of a coding agent applying one change to {args.files} similar modules "
             f"(benchmarks/agent_trace.py: {where}, resent whole at every request), "
             "SmolLM2-135M-Instruct, greedy, streamed with the OpenAI client to five servers, the order "
             f"rotating per request. Same text from every server on every request: {identical}. "
             f"{lengths} of {len(requests)} answers ended at their token limit.", "",
             "| server | tok/s after the first token | speed-up | end to end (with prefill) | speed-up | "
             "tokens from draft / copy / global copy / plain |", "|---|---:|---:|---:|---:|---|"]
    for n, s in summary.items():
        f = s["tokens_from"]
        lines.append(f"| {n} | {s['decode_tok_s']:.1f} | **{s['speedup_decode']:.2f}x** | {s['end_to_end_tok_s']:.1f} | "
                     f"{s['speedup_end_to_end']:.2f}x | {f['draft'] + f['tree']} / {f['copy']} / {f['global_copy']} / "
                     f"{f['plain']} |")
    lines += ["", "Per request (tok/s after the first token):", "",
              "| # | module | step | tokens | " + " | ".join(names) + " |", "|---:|---|---:|---:|" + "---:|" * len(names)]
    for k, r in enumerate(requests):
        lines.append(f"| {k + 1} | {r['file']} | {r['step']} | {r['answers']['plain']['tokens']} | "
                     + " | ".join(f"{r['answers'][n]['tps']:.0f}" for n in names) + " |")
    command = ("OPENBLAS_NUM_THREADS=1 nice -n 5 python benchmarks/agent_trace.py"
               + (" --one-conversation" if args.one_conversation else ""))

    lines += ["", f"Command: `{command}`", "",
              *results_footer(load_start, load_end)]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(requests, names, out / "tok_s.png")


def plot(requests, names, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    xs = list(range(1, len(requests) + 1))
    for n in names:
        ax.plot(xs, [r["answers"][n]["tps"] for r in requests], marker="o", ms=3, label=n)
    for k, r in enumerate(requests):
        if r["step"] == 1 and k:
            ax.axvline(k + 0.5, color="grey", lw=0.5)
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"{r['file'][:4]}{r['step']}" for r in requests], rotation=90, fontsize=7)
    ax.set_xlabel("request (module, step)")
    ax.set_ylabel("tok/s after the first token")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
