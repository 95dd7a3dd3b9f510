"""DFlash on a target split over two processes against plain sharded decoding (issue 40).

Three parts, one command:

1. One process, the real pair: SmolLM2-135M and its shipped draft on a few suite prompts, plain
   decoding (mlx-lm's own `stream_generate`) and DFlash (chains: no copies, no trees) at block 16
   and at `auto`. Block 16's accept lengths are how many tokens the draft gets right in a row:
   the distribution the split runs replay.
2. Split targets, 1 process and 2 ranks (`mlx.launch -n 2 --backend ring` on this machine): a
   dense llama of SmolLM2's shape with even head counts (8 heads, 2 KV heads: SmolLM2's own 9
   and 3 do not split over 2 ranks) tensor parallel, and a tiny Qwen3-MoE pipeline parallel, random
   float32 weights. The draft is scripted: each cycle it is right for k tokens, k drawn from
   part 1's measured accept lengths (same seed, same draws in every setting), wrong after;
   it runs a real draft forward of the same shape first, so its cost is real (the shipped
   draft on the dense target, a random 2-layer draft on the MoE). Plain sharded decoding is
   mlx-lm's `stream_generate` on the same split model. Collectives are counted as the graphs
   are built: every `mx.distributed` op is wrapped, its calls and bytes (from the arrays'
   nbytes, as the ring backend sends them) summed over the decode.
3. A slow link: the kernel here has no netem, so the two ranks talk through a delaying TCP
   relay in this process (each rank's hostfile names the relay for its peer); every chunk is
   held back by the added one-way delay. The measured cost of one all_sum comes with every
   delay. DFlash's speed-up over plain sharded decoding is plotted against the delay.

Tokens are checked identical between DFlash and plain decoding in every run (exit status 1 if not).

    OPENBLAS_NUM_THREADS=1 nice -n 5 python benchmarks/distributed_bench.py --max-tokens 48 \\
        --sweep-tokens 24 --delays 0,0.1,0.5,1,2,5,10 --out benchmarks/results/20261203-distributed
        # 17 min on this project's 2-core machine under load
    python benchmarks/distributed_bench.py --quick --out /tmp/dist-quick   # ~6 min: 16 tokens, 0 and 2 ms
    python benchmarks/distributed_bench.py --parts 3 --out DIR   # the sweep again, on part 1's data in DIR
    python benchmarks/distributed_bench.py --report-only --out DIR          # README + plot again
    # part 2 alone, each prompt 3 times (plain and DFlash interleaved), on part 1's data in DIR:
    python benchmarks/distributed_bench.py --parts 2 --repeats 3 --max-tokens 32 --out DIR
"""

import argparse
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed_carry_report import write_carry_report  # noqa: E402
from distributed_report import write_report  # noqa: E402

DENSE = dict(model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
             num_attention_heads=8, num_key_value_heads=2, vocab_size=49152, rms_norm_eps=1e-5,
             rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192)
MOE = dict(model_type="qwen3_moe", vocab_size=49152, hidden_size=512, num_hidden_layers=8,
           num_attention_heads=8, num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
           max_position_embeddings=4096, tie_word_embeddings=False, intermediate_size=2048,
           moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8, decoder_sparse_step=1,
           mlp_only_layers=[], norm_topk_prob=True)
TARGETS = {"dense": (DENSE, "tensor"), "moe": (MOE, "pipeline")}
SUITES = ("gsm8k", "humaneval", "mtbench")
CHAINS = dict(copy_proposals=False, token_trees=False)  # the draft's chain, nothing else
OPS = ("all_sum", "all_gather", "send", "recv", "recv_like", "all_max", "all_min", "sum_scatter")


# -- counting collectives ------------------------------------------------------------------


class Collectives:
    """Every `mx.distributed` op called while graphs are built: calls and bytes this rank sends.

    mlx-lm's sharded layers, pipelines and the engine look the ops up on `mx.distributed` at call
    time, so wrapping the module's functions sees them all. Bytes sent, as the ring backend
    moves them between n ranks: all_sum 2(n-1)/n of the (at least n-element) array, all_gather
    (n-1) x the input, send the array, recv nothing."""

    def __init__(self, size: int):
        self.size, self.calls, self.sent, self.paused = size, Counter(), Counter(), False

    def install(self):
        self.originals = {name: getattr(mx.distributed, name) for name in OPS if hasattr(mx.distributed, name)}
        for name, fn in self.originals.items():
            setattr(mx.distributed, name, self._wrap(name, fn))
        return self

    def remove(self):
        for name, fn in self.originals.items():
            setattr(mx.distributed, name, fn)

    def _bytes(self, name, x) -> float:
        n = self.size
        if name in ("all_sum", "all_max", "all_min"):
            return 2 * (n - 1) / n * max(x.size, n) * x.itemsize
        if name == "sum_scatter":
            return (n - 1) / n * x.nbytes
        if name == "all_gather":
            return (n - 1) * x.nbytes
        return x.nbytes if name == "send" else 0

    def _wrap(self, name, fn):
        def counted(x, *args, **kwargs):
            if not self.paused:
                self.calls[name] += 1
                self.sent[name] += self._bytes(name, x) if isinstance(x, mx.array) else 0
            return fn(x, *args, **kwargs)
        return counted

    def snapshot(self):
        return Counter(self.calls), Counter(self.sent)

    @staticmethod
    def delta(a, b) -> dict:
        calls = {k: b[0][k] - a[0].get(k, 0) for k in b[0] if b[0][k] - a[0].get(k, 0)}
        return {"calls": calls, "ops": sum(calls.values()), "bytes": sum(b[1].values()) - sum(a[1].values())}


# -- the scripted draft --------------------------------------------------------------------


class MeasuredDraft:
    """A real draft's forward (its cost) with scripted proposals: right for k tokens of the
    reference (the target's own greedy answer), then wrong, k drawn each cycle from `rights`
    (measured accept lengths at the draft's full block). Exact output either way."""

    def __init__(self, inner, rights, vocab: int):
        self.inner, self.rights, self.vocab = inner, list(rights), vocab
        self.config, self.block_size, self.target = inner.config, inner.block_size, inner.target
        self.reference, self.rng, self.drawn = [], random.Random(0), []

    def start(self, reference, seed):
        self.reference, self.rng, self.drawn = list(reference), random.Random(seed), []

    def bind(self, target):
        self.inner.bind(target)
        self.target = target
        return self

    def make_cache(self):
        return self.inner.make_cache()

    def fused_taps(self):
        return self.inner.fused_taps()

    def inject(self, features, cache):
        self.inner.inject(features, cache)

    def propose_logits(self, last_token, features, cache, block_size):
        real = self.inner.propose_logits(last_token, features, cache, block_size)
        p = cache[0].offset  # after the injection: the index of the last committed token
        k = self.rng.choice(self.rights)
        self.drawn.append(k)
        ids = []
        for i in range(block_size - 1):
            j = p + 1 + i
            right = self.reference[j] if j < len(self.reference) else 0
            ids.append(right if i < k else (right + 1) % self.vocab)
        hot = mx.array(ids)[:, None] == mx.arange(self.vocab)[None]
        # + 0 x the real logits: they must be computed (their cost is the point), finite as they are
        return mx.where(hot, 0.0, -1e4)[None] + 0 * real[..., :1]

    def to_target_ids(self, ids):
        return ids


# -- timed generations ---------------------------------------------------------------------


def timed(responses, counter=None, eos=()):
    """(tokens, record): generation tok/s from the first response (the prefill's token) to the
    last, as `dflash-mlx bench` times it; collectives between the same two points."""
    tokens, t_first, n_first, snap, last, widths = [], None, 0, None, None, []
    t0 = time.perf_counter()
    for r in responses:
        tokens.extend(getattr(r, "tokens", None) or [r.token])
        if getattr(r, "verify_width", None):
            widths.append(r.verify_width)
        if t_first is None:
            t_first, n_first = time.perf_counter(), len(tokens)
            snap = counter.snapshot() if counter else None
        last = r
    t_end = time.perf_counter()
    while tokens and tokens[-1] in eos:
        tokens.pop()
    gen = max(0, len(tokens) - n_first)
    rec = {"tokens": len(tokens), "ttft_s": t_first - t0, "gen_s": t_end - t_first,
           "tps": gen / (t_end - t_first) if t_end > t_first and gen else None}
    if counter is not None and counter.size > 1:
        c = Collectives.delta(snap, counter.snapshot())
        rec.update(collectives=c, ops_per_token=c["ops"] / gen if gen else None,
                   bytes_per_token=c["bytes"] / gen if gen else None)
    if widths:
        rec["widths"] = widths
    accepts = getattr(last, "accept_lengths", None)
    if accepts is not None:
        rec.update(accepts=list(accepts), tau=sum(a + 1 for a in accepts) / len(accepts) if accepts else None,
                   cycles=len(accepts))
    return tokens, rec


def plain_run(model, tok, ids, max_tokens, counter=None):
    from mlx_lm.generate import generation_stream, stream_generate

    out = timed(stream_generate(model, tok, mx.array(ids), max_tokens=max_tokens), counter, tok.eos_token_ids)
    # mlx-lm has queued one more forward on its own stream (the token after the last); on a split
    # target its collectives must finish before the next run's start on the default stream, or
    # the ranks pair each other's collectives wrongly (seen here: a garbage shared seed)
    mx.synchronize(generation_stream)
    return out


def dflash_run(model, draft, tok, ids, max_tokens, width, counter=None):
    from dflash_mlx.generate import stream_generate

    return timed(stream_generate(model, draft, tok, ids, max_tokens=max_tokens, block_size=width, **CHAINS),
                 counter, tok.eos_token_ids)


def same(a, b) -> dict:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if n is None and len(a) != len(b):
        n = min(len(a), len(b))
    return {"identical": n is None, "first_difference": n}


# -- part 1: the real pair in one process --------------------------------------------------


def real_pair(prompts, max_tokens, progress):
    from dflash_mlx import load, load_draft
    from dflash_mlx.bench.suites import format_prompt, load_suite

    model, tok = load("smollm2-135m", quiet=True)
    draft = load_draft("smollm2-135m", model)
    chosen = [p for s in SUITES for p in load_suite(s, limit=prompts)]
    ids = [tok.encode(format_prompt(tok, p), add_special_tokens=False) for p in chosen]
    warm = ids[0]
    plain_run(model, tok, warm, 8)
    dflash_run(model, draft, tok, warm, 8, "auto")
    records = []
    for i, (p, x) in enumerate(zip(chosen, ids)):
        runs = ["plain", 16, "auto"] if i % 2 == 0 else ["auto", 16, "plain"]
        rec = {"suite": p.suite, "id": p.id, "prompt_tokens": len(x)}
        toks = {}
        for r in runs:
            toks[r], rec[str(r)] = plain_run(model, tok, x, max_tokens) if r == "plain" else \
                dflash_run(model, draft, tok, x, max_tokens, r)
            progress()
        for r in (16, "auto"):
            rec[str(r)]["check"] = same(toks[r], toks["plain"])
        records.append(rec)
    return records, ids, tok


# -- part 2 and 3: a rank (or the one process) -------------------------------------------


def build_target(kind: str, seed: int = 0):
    import importlib

    from mlx.utils import tree_map_with_path

    from dflash_mlx.models.layout import relayout_for_cpu

    cfg, mode = TARGETS[kind]
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.float32)
    # spread the logits (as dflash_mlx.testing's tiny targets do) so that greedy choices are far
    # from ties: token equality then tests the engine, not float rounding between widths
    model.update(tree_map_with_path(lambda k, p: p * 4.0 if k.endswith("embed_tokens.weight") else p,
                                    model.parameters()))
    mx.eval(model.parameters())
    model.eval()
    relayout_for_cpu(model)  # as dflash_mlx.load does before it splits a loaded model
    return model, mode


def make_draft(kind, model):
    from dflash_mlx import load_draft
    from dflash_mlx.models.draft.checkpoints import random_draft

    if kind == "dense":  # SmolLM2's shape: the shipped draft fits it (its proposals are replaced)
        return load_draft("smollm2-135m", model, quiet=True)
    return random_draft(model, num_layers=2, block_size=16, seed=3)


def op_latency(group, reps: int, hidden: int) -> dict:
    """Seconds per op, measured: an all_sum of one token's hidden state (tensor parallelism's
    op), an all_gather of it, and a one-way send/recv hop (pipeline parallelism's), each on
    its own (evaluated one at a time)."""
    x = mx.ones((1, hidden), mx.float32)
    out = {}
    for name, op in (("all_sum", lambda: mx.distributed.all_sum(x, group=group, stream=mx.cpu)),
                     ("all_gather", lambda: mx.distributed.all_gather(x, group=group, stream=mx.cpu))):
        mx.eval(op())
        t = time.perf_counter()
        for _ in range(reps):
            mx.eval(op())
        out[name] = (time.perf_counter() - t) / reps
    rank, other = group.rank(), 1 - group.rank()
    t = time.perf_counter()
    for _ in range(reps):  # ping-pong: two hops
        if rank == 0:
            mx.eval(mx.distributed.send(x, other, group=group, stream=mx.cpu))
            mx.eval(mx.distributed.recv_like(x, other, group=group, stream=mx.cpu))
        else:
            mx.eval(mx.distributed.recv_like(x, other, group=group, stream=mx.cpu))
            mx.eval(mx.distributed.send(x, other, group=group, stream=mx.cpu))
    out["hop"] = (time.perf_counter() - t) / reps / 2
    return out


def per_forward(model, counter, widths=(1, 16)) -> dict:
    """Collectives one forward of w rows builds (the graph is built, never evaluated)."""
    from mlx_lm.models.cache import make_prompt_cache

    out = {}
    for w in widths:
        a = counter.snapshot()
        y = model(mx.zeros((1, w), mx.int32), cache=make_prompt_cache(model))
        out[w] = Collectives.delta(a, counter.snapshot())
        del y
    return out


def set_delay(port, ms):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        s.sendto(str(ms).encode(), ("127.0.0.1", port))
        s.recvfrom(64)


def worker(plan_path: str):
    from mlx_lm.utils import load_tokenizer

    from dflash_mlx.models.sharded import split
    from dflash_mlx.policy.sizer import forget_sizers
    from dflash_mlx.progress import Progress

    plan = json.loads(Path(plan_path).read_text())
    group = mx.distributed.init()
    n, rank = group.size(), group.rank()
    counter = Collectives(n).install() if n > 1 else None
    model, mode = build_target(plan["target"])
    if n > 1:
        split(model, mode, group)
    draft = MeasuredDraft(make_draft(plan["target"], model), plan["rights"], TARGETS[plan["target"]][0]["vocab_size"])
    tok = load_tokenizer(Path(plan["tokenizer"]))
    prompts, T, widths = plan["prompts"], plan["max_tokens"], plan["widths"]
    result = {"target": plan["target"], "mode": mode if n > 1 else "whole", "processes": n, "settings": [],
              # how a pipeline's features travel (pipeline_carry): shares of the draft's fc, or its taps
              "features": ("fc" if draft.fused_taps() is not None else "taps") if n > 1 and mode == "pipeline" else None}
    if counter:  # the probe builds graphs only: nothing runs
        result["per_forward"] = per_forward(model, counter)
    total = len(plan["settings"]) * len(prompts) * (1 + len(widths))
    progress = Progress(total, f"[{plan['label']}]", "runs") if rank == 0 else None
    done, refs, failed = 0, {}, False
    for s_i, setting in enumerate(plan["settings"]):
        if plan.get("control") and rank == 0:
            set_delay(plan["control"], setting["delay_ms"])
        if n > 1:
            mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # barrier
        forget_sizers()  # each setting learns its own widths (as a fresh process would)
        rec = dict(setting, prompts=[], loadavg_start=os.getloadavg()[0])
        if n > 1:
            if counter:
                counter.paused = True
            rec["op_seconds"] = op_latency(group, plan["op_reps"], model.args.hidden_size)
            if counter:
                counter.paused = False
        # untimed: first calls, and the width policy's first cycles (with the draft's measured
        # acceptance: the reference is plain decoding's own answer)
        warm, _ = plain_run(model, tok, prompts[0], plan["warmup"])
        draft.start(prompts[0] + warm + [0] * 32, 0)
        for w in widths:
            dflash_run(model, draft, tok, prompts[0], plan["warmup"], w)
        for i, ids in enumerate(prompts):
            p = {"prompt_tokens": len(ids)}
            order = ["plain"] + widths if (i + s_i) % 2 == 0 or i not in refs else widths + ["plain"]
            toks = {}
            for r in order:
                if r == "plain":
                    toks[r], p["plain"] = plain_run(model, tok, ids, T, counter)
                    refs.setdefault(i, ids + toks[r] + [0] * 32)
                else:
                    draft.start(refs[i], seed=1000 + i)
                    toks[r], p[str(r)] = dflash_run(model, draft, tok, ids, T, r, counter)
                done += 1
                if progress:
                    progress.update(done, f"{setting['label']} prompt {i + 1}")
            for w in widths:
                p[str(w)]["check"] = same(toks[w], toks["plain"])
                failed |= not p[str(w)]["check"]["identical"]
            rec["prompts"].append(p)
        rec["loadavg_end"] = os.getloadavg()[0]
        result["settings"].append(rec)
        Path(plan["out"] + (f".rank{rank}" if rank else "")).write_text(json.dumps(result))
    if progress:
        progress.update(done, "done", force=True)
        progress.close()
    return 1 if failed else 0


# -- the delaying relay ----------------------------------------------------------------------


class DelayRelay:
    """TCP relays between the two ranks that hold every chunk back by `delay` seconds (one
    way), set over a UDP control port. Order is kept (one writer per direction)."""

    def __init__(self):
        self.delay = 0.0
        self.control = self._udp()
        self.threads = []

    def _udp(self) -> int:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))

        def serve():
            while True:
                data, addr = s.recvfrom(64)
                self.delay = float(data) / 1000
                s.sendto(b"ok", addr)
        threading.Thread(target=serve, daemon=True).start()
        return s.getsockname()[1]

    def relay(self, upstream_port: int) -> int:
        """A listening port whose one connection is relayed to 127.0.0.1:upstream_port."""
        lst = socket.socket()
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)

        def accept():
            a, _ = lst.accept()
            lst.close()
            for _ in range(600):
                try:
                    b = socket.create_connection(("127.0.0.1", upstream_port))
                    break
                except OSError:
                    time.sleep(0.05)
            for s in (a, b):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pump(a, b)
            self._pump(b, a)
        threading.Thread(target=accept, daemon=True).start()
        return lst.getsockname()[1]

    def _pump(self, src, dst):
        queue, cond = deque(), threading.Condition()

        def read():
            while True:
                data = src.recv(1 << 20)
                with cond:
                    queue.append((time.perf_counter() + self.delay, data))
                    cond.notify()
                if not data:
                    return

        def write():
            while True:
                with cond:
                    while not queue:
                        cond.wait()
                    due, data = queue.popleft()
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                dst.sendall(data)
        for f in (read, write):
            threading.Thread(target=f, daemon=True).start()


def _follow(path: Path, stop: threading.Event):
    """The ranks' progress lines (their log) on this terminal as they come."""
    with open(path, "r", errors="replace") as f:
        while True:
            chunk = f.read()
            if chunk:
                sys.stderr.write(chunk)
                sys.stderr.flush()
            elif stop.is_set():
                return
            time.sleep(0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the orchestrator ----------------------------------------------------------------------


def run_ranks(plan: dict, folder: Path, how: str, relay: DelayRelay = None, timeout: float = 1800) -> dict:
    """The worker under `how`: "one" (one process), "launch" (mlx.launch -n 2, ring backend on
    localhost), "direct" (two ranks started here with the hostfile mlx.launch would write: no
    launcher, whose output threads poll a whole core on this 2-core machine) or "relay" (two
    ranks started here, each hostfile naming the relay for its peer)."""
    plan_path = folder / f"plan-{plan['label']}.json"
    plan["out"] = str(folder / f"result-{plan['label']}.json")
    for stale in (plan["out"], plan["out"] + ".rank1"):
        Path(stale).unlink(missing_ok=True)
    plan_path.write_text(json.dumps(plan))
    me = [sys.executable, str(Path(__file__).resolve()), f"--worker={plan_path}"]
    env = dict(os.environ)
    for k in ("MLX_RANK", "MLX_HOSTFILE"):
        env.pop(k, None)
    log_path = folder / f"log-{plan['label']}.txt"
    log = open(log_path, "w")
    if how == "one":
        procs = [subprocess.Popen(me, env=env, stdout=log, stderr=log)]
    elif how == "launch":
        launch = [str(Path(sys.executable).parent / "mlx.launch"), "-n", "2", "--backend", "ring",
                  "--starting-port", str(free_port()), "--python", sys.executable] + me[1:]
        procs = [subprocess.Popen(launch, env=env, stdout=log, stderr=log, start_new_session=True)]
    else:
        real = [free_port(), free_port()]
        # rank 0 reaches rank 1 through via[0]
        via = [relay.relay(real[1]), relay.relay(real[0])] if how == "relay" else [real[1], real[0]]
        procs = []
        for r in (0, 1):
            hosts = [[f"127.0.0.1:{real[0]}"], [f"127.0.0.1:{via[0]}"]] if r == 0 else \
                [[f"127.0.0.1:{via[1]}"], [f"127.0.0.1:{real[1]}"]]
            hf = folder / f"hosts-{plan['label']}-{r}.json"
            hf.write_text(json.dumps(hosts))
            procs.append(subprocess.Popen(me, env=dict(env, MLX_RANK=str(r), MLX_HOSTFILE=str(hf)),
                                          stdout=log, stderr=log, start_new_session=True))
    stop = threading.Event()
    tail = threading.Thread(target=_follow, args=(log_path, stop), daemon=True)
    tail.start()
    deadline, codes = time.time() + timeout, []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(1, deadline - time.time())))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9) if how != "one" else p.kill()
        log.close()
        stop.set()
        tail.join()
    if any(codes) or not Path(plan["out"]).exists():
        sys.stderr.write(log_path.read_text()[-3000:])
        raise RuntimeError(f"{plan['label']}: exit codes {codes}; log {log_path}")
    result = json.loads(Path(plan["out"]).read_text())
    result["exit_codes"] = codes
    other = Path(plan["out"] + ".rank1")
    if other.exists():  # rank 1's own collectives (a pipeline's ranks differ: rank 1 sends, rank 0 receives)
        r1 = json.loads(other.read_text())
        result["rank1"] = [[{k: {"collectives": v.get("collectives"), "ops_per_token": v.get("ops_per_token"),
                                 "bytes_per_token": v.get("bytes_per_token")}
                             for k, v in p.items() if isinstance(v, dict)} for p in s["prompts"]]
                           for s in r1["settings"]]
    return result


def machine() -> dict:
    from dflash_mlx.bench.environment import environment

    return environment()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=f"benchmarks/results/{time.strftime('%Y%m%d')}-distributed")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per suite (gsm8k, humaneval, mtbench)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--targets", default="dense,moe")
    ap.add_argument("--widths", default="auto", help="DFlash widths on the split targets (comma list)")
    ap.add_argument("--delays", default="0,0.1,0.5,1,2,5", help="added one-way link delays, ms")
    ap.add_argument("--sweep-prompts", type=int, default=1)
    ap.add_argument("--sweep-tokens", type=int, default=32)
    ap.add_argument("--op-reps", type=int, default=30)
    ap.add_argument("--parts", default="1,2,3", help="1: SmolLM2 in one process, 2: split targets 1 vs 2 "
                    "processes, 3: the delay sweep (2-3 alone reuse part 1 from --out's results.json)")
    ap.add_argument("--repeats", type=int, default=1, help="part 2 runs every prompt this many times, plain and "
                    "DFlash interleaved (the order flips each time); more than 1 writes the repeats' report "
                    "(medians and spreads, distributed_carry_report.py)")
    ap.add_argument("--ranks", choices=("launch", "direct"), default="launch",
                    help="part 2's two ranks: under mlx.launch, or started directly with the same hostfile")
    ap.add_argument("--quick", action="store_true", help="1 prompt, 16 tokens, delays 0 and 2 ms")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        sys.exit(worker(args.worker))
    out = Path(args.out)
    if args.report_only:
        repeated = json.loads((out / "results.json").read_text())["config"].get("repeats", 1) > 1
        (write_carry_report if repeated else write_report)(out)
        return
    if args.quick:
        args.max_tokens, args.sweep_tokens, args.delays, args.op_reps = 16, 16, "0,2", 10
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    work.mkdir(exist_ok=True)
    (out / ".gitignore").write_text("work/\n")  # plans, logs and a tokenizer: not results
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    widths = [w if w in ("auto", "draft") else int(w) for w in args.widths.split(",")]
    delays = [float(d) for d in args.delays.split(",")]
    git = subprocess.run(["git", "-C", str(Path(__file__).parent), "describe", "--always", "--dirty"],
                         capture_output=True, text=True).stdout.strip()
    results = {"machine_start": machine(), "command": " ".join(shlex.quote(a) for a in sys.argv), "git": git,
               "config": {k: v for k, v in vars(args).items() if k != "worker"},
               "targets": {k: TARGETS[k][0] for k in targets}}
    t0 = time.perf_counter()

    def save():
        (out / "results.json").write_text(json.dumps(results, indent=1))

    def stage(name):
        print(f"\n== {name} (elapsed {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    from dflash_mlx.progress import Progress

    parts = {int(p) for p in args.parts.split(",")}
    if 1 in parts:
        stage("part 1: SmolLM2-135M + shipped draft, one process")
        bar = Progress(3 * args.prompts * 3, "[smollm2]", "runs")
        count = [0]

        def tick():
            count[0] += 1
            bar.update(count[0], force=True)
        records, ids, tok = real_pair(args.prompts, args.max_tokens, tick)
        bar.close()
        tok.save_pretrained(str(work / "tokenizer"))
        results.update(smollm2=records, rights=[a for r in records for a in r["16"]["accepts"]], prompt_ids=ids)
        del tok
        save()
    else:  # parts 2-3 again on part 1's prompts and accept lengths
        old = json.loads((out / "results.json").read_text())
        results.update({k: old[k] for k in ("smollm2", "rights", "prompt_ids")})
        results["split"] = old.get("split", {})
        if not (work / "tokenizer").exists():  # work/ is not committed with the results
            from dflash_mlx import load

            load("smollm2-135m", quiet=True)[1].save_pretrained(str(work / "tokenizer"))
    ids, rights = results["prompt_ids"], results["rights"]
    base = dict(rights=rights, tokenizer=str(work / "tokenizer"), widths=widths, warmup=8, op_reps=args.op_reps)
    failed = any(not r[k]["check"]["identical"] for r in results["smollm2"] for k in ("16", "auto"))
    results.setdefault("split", {})
    for kind in targets if 2 in parts else []:
        tag = (lambda k: f" #{k + 1}") if args.repeats > 1 else (lambda k: "")
        one = dict(base, label=f"{kind}-1", target=kind, prompts=ids, max_tokens=args.max_tokens,
                   settings=[{"label": "1 process" + tag(k), "delay_ms": None} for k in range(args.repeats)])
        two = dict(one, label=f"{kind}-2",
                   settings=[{"label": "2 ranks" + tag(k), "delay_ms": None} for k in range(args.repeats)])
        stage(f"part 2: {kind}, 1 process")
        r1 = run_ranks(one, work, "one")
        stage(f"part 2: {kind}, 2 ranks ({'mlx.launch' if args.ranks == 'launch' else 'started directly'})")
        r2 = run_ranks(two, work, args.ranks)
        results["split"][kind] = {"one": r1, "two": r2}
        save()
    relay = DelayRelay()
    for kind in targets if 3 in parts else []:
        sweep = dict(base, label=f"{kind}-sweep", target=kind, prompts=ids[:args.sweep_prompts],
                     max_tokens=args.sweep_tokens, control=relay.control,
                     settings=[{"label": f"+{d:g} ms", "delay_ms": d} for d in delays])
        stage(f"part 3: {kind}, 2 ranks through the delaying relay, delays {delays} ms")
        results["split"].setdefault(kind, {})["sweep"] = run_ranks(sweep, work, "relay", relay)
        save()
    for kind in targets:
        for part in results["split"].get(kind, {}).values():
            failed |= any(c != 0 for c in part["exit_codes"])
    results["machine_end"] = machine()
    results["seconds"] = time.perf_counter() - t0
    save()
    (write_carry_report if args.repeats > 1 else write_report)(out)
    print(f"\nwrote {out} in {results['seconds']:.0f} s", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
