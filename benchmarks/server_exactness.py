"""Exactness of `dflash-mlx serve` under load: random multi-turn conversations over HTTP, against mlx-lm.

    python benchmarks/server_exactness.py --targets global,window,qwen3_5,gemma3_text --seeds 0:6 \
        --out benchmarks/results/<date>-server-exactness

A tiny random target (`testing.targets.tiny_target`; "global": Llama without sliding windows,
"window": with them) and a random draft are served in this process (uvicorn on a free loopback
port). Per seed, conversations run a few at a time, each on its own client: every turn's prompt is
the last prompt, its answer and a few new characters (so the prompt cache pool reuses prefixes),
some turns are streamed and some of those hung up after two chunks, and some conversations decode
under penalties and a logit bias. mlx-lm's references decode in the clients' threads on the served
model object itself (`--reference-on served`), while the engine verifies on it. Each worker set-up
(`--workers`: the batched engine, one row at a time, deterministic mode) serves every seed. Every answer not hung up must be mlx-lm's greedy decode
of the turn's prompt under the same processors; text compares with U+FFFD removed (a random model
emits invalid UTF-8, whose replacement characters depend on how a naive detokenizer's groups fall).
"""

import argparse
import contextlib
import datetime
import json
import random
import sys
import threading
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
import httpx

from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.options import GenerationOptions
from dflash_mlx.progress import Progress
from dflash_mlx.serve.worker import Worker
from dflash_mlx.testing.serving import http_server
from dflash_mlx.testing.targets import EOS_ID, greedy_reference, tiny_target

WORKERS = {"batched": {}, "one-row": {"max_batch": 1}, "deterministic": {"max_batch": 1, "deterministic": True}}


def target(kind: str):
    if kind == "global":
        return tiny_target("llama", seed=0, layer_types=None, sliding_window=None)
    return tiny_target("llama" if kind == "window" else kind, seed=0)


@contextlib.contextmanager
def served(model, draft, tok, **worker_args):
    worker = Worker(model, draft, tok, model_name="tiny", draft_name="random", **worker_args)
    with http_server(worker) as url:
        yield worker, url


def penalties(rng: random.Random) -> dict:
    if rng.random() >= 0.4:
        return {}
    drawn = dict(repetition_penalty=rng.choice([1.2, 2.0]), presence_penalty=rng.choice([0.0, 1.0]),
                 frequency_penalty=rng.choice([0.0, 0.5]))
    if rng.random() < 0.5:
        drawn["logit_bias"] = {str(rng.randrange(3, 250)): rng.choice([-5.0, 5.0])}
    return drawn


def complete(http: httpx.Client, body: dict, hang_up: bool) -> str:
    if not body["stream"]:
        r = http.post("/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]
    text, chunks = "", 0
    with http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices")
                if choices:
                    text += choices[0]["text"]
                    chunks += 1
            if hang_up and chunks >= 2:
                break
    return text


def conversation(worker, url, model, tok, seed: int, lock, answers: list):
    rng = random.Random(seed)
    http = httpx.Client(base_url=url, timeout=300)
    prompt = "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randrange(3, 60)))
    drawn = penalties(rng)
    bias = {int(k): v for k, v in drawn.get("logit_bias", {}).items()} or None
    processors = GenerationOptions(**{k: v for k, v in drawn.items() if k != "logit_bias"},
                                   logit_bias=bias).processors() or None
    for turn in range(rng.choice([1, 2, 3])):
        max_tokens, stream = rng.choice([4, 12, 30]), rng.random() < 0.5
        hang_up = stream and rng.random() < 0.3
        ids = worker.encode_text(prompt)
        text = complete(http, {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
                               **drawn}, hang_up)
        if not hang_up:
            with lock:  # (mlx-lm's decode beside the server's engine thread: one at a time here)
                want = greedy_reference(model, ids, max_tokens, stop_ids=[EOS_ID], logits_processors=processors)
            want_text = tok.decode([t for t in want if t != EOS_ID])
            exact = text.replace("\ufffd", "") == want_text.replace("\ufffd", "")
            answers.append(dict(seed=seed, turn=turn, prompt_tokens=len(ids), stream=stream, penalties=drawn,
                                exact=exact, **({} if exact else {"text": text, "want": want_text})))
        prompt += text + "".join(rng.choice("qrstuv ") for _ in range(rng.randrange(1, 8)))


def run_seed(kind: str, workers: str, seed: int, conversations: int, at_once: int, reference_on: str) -> list:
    model, tok = target(kind)
    # "served": mlx-lm decodes on the served model object, in the clients' threads, while the engine's thread
    # verifies on it (`models.target.stand_ins` keeps the two apart); "own": on a copy of its own
    reference = model if reference_on == "served" else target(kind)[0]
    answers, lock = [], threading.Lock()
    with served(model, random_draft(model, block_size=8, seed=seed), tok, **WORKERS[workers]) as (worker, url):
        for start in range(0, conversations, at_once):
            threads = [threading.Thread(target=conversation, args=(worker, url, reference, tok, seed * 1000 + c,
                                                                   lock, answers))
                       for c in range(start, min(start + at_once, conversations))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    return [dict(a, target=kind, workers=workers) for a in answers]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--targets", default="global,window,qwen3_5,gemma3_text")
    p.add_argument("--workers", default="batched,one-row,deterministic")
    p.add_argument("--seeds", default="0:4", help="first:last (exclusive)")
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--at-once", type=int, default=4)
    p.add_argument("--reference-on", choices=["served", "own"], default="served",
                   help="the model object mlx-lm's reference decodes run on")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="Python's thread switch interval in seconds (1e-5: threads interleave often, races show)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    first, last = (int(x) for x in args.seeds.split(":"))
    runs = [(k, w, s) for k in args.targets.split(",") for w in args.workers.split(",") for s in range(first, last)]
    progress, answers = Progress(len(runs), "runs"), []
    for done, (kind, workers, seed) in enumerate(runs, 1):
        answers += run_seed(kind, workers, seed, args.conversations, args.at_once, args.reference_on)
        progress.update(done, f"{kind} {workers} seed {seed}: {sum(not a['exact'] for a in answers)} mismatches",
                        force=True)
    progress.close()
    wrong = [a for a in answers if not a["exact"]]
    line = f"{len(answers)} answers, {len(answers) - len(wrong)} exact, {len(wrong)} mismatches"
    print(line)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"command": " ".join(sys.argv), "answers": answers}, indent=1))
        rows = [f"| {k} | {w} | {sum(1 for a in answers if (a['target'], a['workers']) == (k, w))} | "
                f"{sum(1 for a in answers if (a['target'], a['workers']) == (k, w) and not a['exact'])} |"
                for k in args.targets.split(",") for w in args.workers.split(",")]
        (out / "README.md").write_text(
            f"# Server exactness under load ({datetime.date.today()})\n\n`{' '.join(sys.argv)}`\n\n{line}.\n\n"
            "| target | workers | answers | mismatches |\n|---|---|---:|---:|\n" + "\n".join(rows) + "\n")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
