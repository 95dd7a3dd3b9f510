"""Run by tests/test_distributed.py under `mlx.launch -n 2`: every case on a target split over the
ranks, each rank writing what it decoded to OUT/rank<r>.json (argv: OUT, then arch keys).

Per architecture and per parallelism mlx-lm gives it: the split model's own greedy decode
(mlx-lm's generate_step on the split model, no DFlash: the reference) and the whole model's (each
rank alone, no collectives), then DFlash on the split model at widths 1, 4, 16 and auto (copies and
trees on) with a random draft tapping layers on both ranks, a scripted draft that is right for a
varying number of tokens (partial accepts: every rollback path), and, on some, a sampled answer;
the collectives the model's own forward builds and those of the width-4 answer (COLLECTIVES).
A family mlx-lm cannot split gives its one-line refusal (REFUSALS). Then, with DRIVER_CLI, the
one-shot CLI and `dflash-mlx serve` (tests/distributed_serve.py).
"""

import json
import os
import random
import sys
import time
import traceback

import dflash_mlx  # noqa: F401  (before mlx.core)
import mlx.core as mx

if hasattr(os, "sched_setscheduler"):  # the launcher runs idle (test_distributed._idle_launcher), the ranks not
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        pass

from dflash_mlx import stream_generate
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.models.sharded import ShardingError, _pipeline_holder, modes_of, split
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.policy.sizer import sizer_for
from dflash_mlx.testing import arch_check, archs, variants
from dflash_mlx.testing.targets import ScriptedDraft, byte_tokenizer, clean_case, greedy_reference, tiny_target
from distributed_serve import serve_and_interrupt, serve_and_lose_rank1

PROMPT_LEN, MAX_TOKENS = 9, 11
COLLECTIVES = {}  # "arch/mode" -> what counted_answer counted
TRANSPORTS = {}  # "arch/pipeline" -> what transports measured
REFERENCES = {}  # "arch/mode" -> {"split": the split model's own greedy decode, "whole": the whole model's}
REFUSALS = {}  # "arch/mode" -> the one line split() refused a family with
AFTER_GENERATE = {}  # "arch/mode" -> what after_generate measured


# GLM's sparse indexer keeps 6 keys, not its tiny config's 16: its sparse paths (the masked top-k of
# a prefill and a verify, the gathered top-k of a one-token step) run from the prompt on.
OVERRIDES = {"glm_moe_dsa": dict(index_topk=6)}
# DeepSeek V4.1 with 4 layers: rank 1 holds the one that compresses and indexes, rank 0 the two that
# read them, so its hop carries compressed KV and index keys that rank 0's receive adds to its cache.
OVERRIDES["deepseek_v41"] = dict(num_hidden_layers=4, compress_ratios=[0, 4, 4, 4], kv_source_layer_ids=[1],
                                 index_source_layer_ids=[1, 3])


def build(key: str):
    """The tiny model of `key`: qwen3_5 and llama of `testing.targets`, the others as the quick check
    of every architecture builds them (`testing.archs`, `testing.more_archs`: qwen3 there decodes
    varied tokens, `testing.targets`' repeats one; gemma4, the multimodal wrapper real checkpoints name)."""
    if key in ("qwen3_5", "llama"):
        return tiny_target(key, seed=1)[0]
    if key in OVERRIDES and key in archs.ALL_ARCHS:
        return archs.build(key, **OVERRIDES[key])
    if key in OVERRIDES:
        return variants.build(key, dict(arch_check.ARCHITECTURES[key], **OVERRIDES[key]), 0)
    return arch_check.build(key)


def taps_of(whole) -> list:
    """Draft taps on the first, middle and last layers of the whole model: a pipeline's two ranks
    each hold one at least, so what the features travel in (taps, or shares of fc) comes from both."""
    n = Target(whole).num_layers
    return sorted({0, n // 2, n - 1})


def draft_for(model, taps):
    return random_draft(model, num_layers=1, block_size=16, seed=3, target_layer_ids=taps)


def run(model, draft, tok, prompt, **kw):
    if os.environ.get("DRIVER_VERBOSE"):
        print(f"rank {mx.distributed.init().rank()}: {type(model).__module__} {kw}", file=sys.stderr, flush=True)
    tokens, last = [], None
    for r in stream_generate(model, draft, tok, prompt, max_tokens=MAX_TOKENS, stop_token_ids=[], **kw):
        tokens += r.tokens
        last = r
    times = sizer_for(model, draft).times if kw.get("block_size") == "auto" else {}
    return {"tokens": tokens, "accepts": list(last.accept_lengths), "times": {str(w): t for w, t in times.items()}}


# Every split runs these widths with the random draft (1: plain steps; it accepts little, so 16
# verifies 16 rows a cycle) and auto with the scripted one; the scripted draft's own width on one.
WIDTHS = (1, 4, 16, "auto")
SCRIPTED_WIDTHS = {"qwen3_5": ("draft", "auto")}
# A sampled answer (the same on every rank) on a few families only: its path is the same everywhere.
SAMPLED = ("qwen3_5", "kimi_k25", "glm_moe_dsa", "gpt_oss")
# Families whose collectives are not all counted: MiniMax's split q/k norm sums inside an mx.compile'd
# function, which builds its all_sum only when it traces a new shape (Collectives sees those calls only).
# Kimi K3's rollback re-runs its delta-attention mixers, whose output projection sums over a tensor
# split's ranks, and DeepSeek V4.1's re-runs its whole text model: a cycle's sums vary with its
# rejected tokens.
UNCOUNTED = ("minimax", "kimi_k3", "deepseek_v41")
# Families run under one of the parallelisms mlx-lm gives them: DeepSeek V4.1's tensor split is
# checked by benchmarks/split_variants.py; its pipeline, whose receive writes its caches, runs here.
MODES = {"deepseek_v41": ("pipeline",)}


class Collectives:
    """Counts the `mx.distributed` ops built while it is on (mlx-lm's pipelines and the engine look
    them up on the module at call time)."""

    OPS = ("all_sum", "all_gather", "send", "recv", "recv_like", "all_max", "all_min", "sum_scatter")

    def __enter__(self):
        self.calls, self.sent = {}, 0  # sent: the bytes of what this rank's sends, gathers and sums took
        self.originals = {n: getattr(mx.distributed, n) for n in self.OPS if hasattr(mx.distributed, n)}
        for name, fn in self.originals.items():
            setattr(mx.distributed, name, self._counted(name, fn))
        return self

    def _counted(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            if name not in ("recv", "recv_like") and args and isinstance(args[0], mx.array):
                self.sent += args[0].nbytes
            return fn(*args, **kwargs)
        return counted

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(mx.distributed, name, fn)


def counted_answer(model, draft, tok, prompt, **kw) -> tuple:
    """(a DFlash answer, the collectives of the model's own forward (built, never run), of that
    answer, and its cycles): on a pipeline a cycle must build exactly the model's own, on a tensor
    split exactly its all_sums."""
    from mlx_lm.models.cache import make_prompt_cache

    with Collectives() as own:
        model(mx.array(prompt)[None], cache=make_prompt_cache(model))
    with Collectives() as dflash:
        answer = run(model, draft, tok, prompt, **kw)
    target = draft.target
    carries = target._carries if target.sharding.kind == "pipeline" else target._ride_slot is not None
    return answer, {"forward": own.calls, "answer": dflash.calls, "cycles": len(answer["accepts"]),
                    "carries": carries}


# Where a forward right after mlx-lm's own decoding is checked (`after_generate`): the family
# (GLM-MoE-DSA), both splits.
AFTER = ("glm_moe_dsa",)


def after_generate(model, target, prompt, taps, whole_features, tries: int = 6) -> list:
    """How far from the whole model's features a Target forward from the default stream lands,
    started right after mlx-lm's `generate_step` on the split model (which returns with its next
    step's forward still running on the generation stream), `tries` times: the two forwards'
    collectives must not be in flight at once (`sharding.split_stream`)."""
    from mlx_lm.generate import generate_step

    diffs = []
    for _ in range(tries):
        for _ in generate_step(mx.array(prompt), model, max_tokens=2, sampler=lambda x: mx.argmax(x, axis=-1)):
            pass
        _, features, _ = target.forward(mx.array(prompt)[None], target.make_cache(), taps)
        diffs.append(mx.abs(features - whole_features).max().item())
    return diffs


def refusals(key: str, model) -> dict:
    """What `split` says for each mode of a family mlx-lm cannot split (nothing runs)."""
    out = {}
    for mode in ("auto", "tensor", "pipeline"):
        try:
            split(model, mode)
            out[f"{key}/{mode}"] = None
        except ShardingError as e:
            out[f"{key}/{mode}"] = str(e)
    return out


# Where nothing can ride on the forward's own collectives (a pipeline whose layers take two states,
# a tensor split with no summed linear), the taps go by all_sum (`gather_features`) and the cycle
# times by one all_sum of EVERY: run on one model with the carry and the ride turned off.
UNRIDDEN = ("qwen3_5",)


def unridden(key: str, mode: str, tok, prompt, taps) -> dict:
    model = build(key)
    split(model, mode)
    draft = draft_for(model, taps)
    target = draft.target
    target._carries, target._ride_slot = False, None
    from mlx_lm.models.cache import make_prompt_cache

    with Collectives() as own:
        model(mx.array(prompt)[None], cache=make_prompt_cache(model))
    with Collectives() as counted:
        answer = run(model, draft, tok, prompt, block_size="auto")
    return dict(answer, collectives=counted.calls, forward_sums=own.calls.get("all_sum", 0))


def transports(draft, prompt, whole_features) -> dict:
    """A pipeline prefill's features sent as taps and as shares of the draft's fc: how far each is
    from the whole model's (features, and fc of them) and the bytes this rank sent for the forward."""
    target, ids = draft.target, draft.config.target_layer_ids
    out = {}
    for name, fuse in (("taps", None), ("fc", draft.fused_taps())):
        with Collectives() as sent:
            _, features, _ = target.forward(mx.array(prompt)[None], target.make_cache(), ids, fuse=fuse)
            mx.eval(features)
        expected = whole_features if fuse is None else draft.fc(whole_features)
        out[name] = {"diff": mx.abs(features - expected).max().item(), "bytes": sent.sent,
                     "shape": list(features.shape)}
    out["taps_count"], out["carried"] = len(ids), target._carries  # (else the taps go in an all_sum)
    return out


# "arch:uneven": a pipeline whose rank 0 holds the last layer alone (of Qwen3-Next: full attention
# only, while rank 1 holds Gated DeltaNet layers too), so the ranks find different things from their
# own layers and must agree (`sharding.on_every_rank`)
UNEVEN = ":uneven"


def split_uneven(model):
    holder = _pipeline_holder(model)  # where `split` finds the model's pipeline
    holder.pipeline(mx.distributed.init(), split=[1, len(holder.layers) - 1])
    mx.eval(model.parameters())


def cases(key: str, tok):
    uneven = key.endswith(UNEVEN)
    key = key[: -len(UNEVEN)] if uneven else key
    whole = build(key)
    tensor, pipeline = modes_of(whole)
    if not (tensor or pipeline):
        REFUSALS.update(refusals(key, whole))
        return {}
    prompt, whole_ref = clean_case(whole, PROMPT_LEN, MAX_TOKENS, seed=5)
    whole_target, taps = Target(whole), taps_of(whole)
    _, whole_features, _ = whole_target.forward(mx.array(prompt)[None], whole_target.make_cache(), taps)
    mx.eval(whole_features)
    del whole, whole_target
    out = {}
    modes = ["pipeline-uneven"] if uneven else [m for m, ok in (("tensor", tensor), ("pipeline", pipeline)) if ok
                                                  and m in MODES.get(key, (m,))]
    for mode in modes:
        model = build(key)
        if uneven:
            split_uneven(model)
        else:
            split(model, mode)
        name = f"{key}/{mode}"
        # the reference: the split model's own greedy decode (a tensor split sums in another order)
        ref = greedy_reference(model, prompt, MAX_TOKENS)
        REFERENCES[name] = {"split": ref, "whole": whole_ref}
        draft = draft_for(model, taps)
        if key in AFTER and not uneven:
            AFTER_GENERATE[name] = after_generate(model, draft.target, prompt, taps, whole_features)
        if mode == "pipeline":
            TRANSPORTS[name] = transports(draft, prompt, whole_features)
        for width in WIDTHS:
            if width == 4 and key not in UNCOUNTED and not uneven:
                answer, COLLECTIVES[name] = counted_answer(model, draft, tok, prompt, block_size=width)
            else:
                answer = run(model, draft, tok, prompt, block_size=width)
            out[f"{name}/random/{width}"] = dict(answer, ref=ref)
        # right for a varying number of tokens: partial accepts, every rollback path
        rng = random.Random(key)
        wrong = [rng.randrange(0, 9) for _ in range(100)]
        scripted = ScriptedDraft(Target(model), prompt + ref, lambda c: wrong[c], block_size=8)
        for width in SCRIPTED_WIDTHS.get(key, ("auto",)):
            out[f"{name}/scripted/{width}"] = dict(run(model, scripted, tok, prompt, block_size=width), ref=ref)
        if key in SAMPLED and not uneven:
            out[f"{name}/sampled/4"] = run(model, draft, tok, prompt, block_size=4, temperature=1.0)
        if key in UNRIDDEN and not uneven:
            out[f"{name}/unridden/auto"] = dict(unridden(key, mode, tok, prompt, taps), ref=ref)
    return out


def run_cli(model: str, draft: str, out_path: str) -> int:
    """`dflash-mlx --distributed tensor ... --json` in this process; its standard output to `out_path`."""
    import contextlib

    from dflash_mlx.cli.main import main as cli_main

    stdout = sys.stdout
    with open(out_path, "w") as f, contextlib.redirect_stdout(f):
        code = cli_main(["--distributed", "tensor", "--model", model, "--draft", draft, "--json", "--max-tokens", "12",
                         "--temperature", "0", "hello there"])
    sys.stdout = stdout  # (rank 1's CLI sent its standard output to devnull)
    return code


def main():
    folder, keys = sys.argv[1], sys.argv[2:]
    rank = mx.distributed.init().rank()
    tok = byte_tokenizer()
    result = {"cases": {}, "errors": {}, "seconds": {}}
    for key in keys:
        t0 = time.perf_counter()
        try:
            result["cases"].update(cases(key, tok))
        except Exception:  # reported per architecture; the other ranks fail alike or hang (the test's timeout)
            result["errors"][key] = traceback.format_exc()
        result["seconds"][key] = time.perf_counter() - t0
    result.update(collectives=COLLECTIVES, transports=TRANSPORTS, references=REFERENCES, refusals=REFUSALS,
                  after_generate=AFTER_GENERATE)
    cli = os.environ.get("DRIVER_CLI")  # "model.gguf draft-folder": the CLI and the server under --distributed
    if cli:
        result["cli"] = run_cli(*cli.split(), os.path.join(folder, f"cli{rank}.out"))
        result["serve"] = serve_and_interrupt(folder, rank, *cli.split())
    write(folder, rank, result)
    if cli:  # last: rank 1 ends in it (its file is written), rank 0 finds it gone
        result["lost_rank"] = serve_and_lose_rank1(folder, rank, *cli.split())
        write(folder, rank, result)


def write(folder: str, rank: int, result: dict):
    path = os.path.join(folder, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
