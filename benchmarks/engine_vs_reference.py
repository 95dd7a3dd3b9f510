"""Engine benchmarks, interleaved in one process (the machine may be shared: only ratios count).

    python benchmarks/engine_vs_reference.py reference   # ours vs z-lab's engine, block 16
    python benchmarks/engine_vs_reference.py auto        # block_size="auto" vs plain decoding (ours, mlx-lm's)
    python benchmarks/engine_vs_reference.py widths      # "auto" vs fixed widths, shipped draft
    python benchmarks/engine_vs_reference.py layout      # the CPU weight layout (dflash_mlx.models.layout) on and off
    python benchmarks/engine_vs_reference.py compile     # the draft's MLPs through mx.compile, or not

Every part runs the packaged SmolLM2-135M-Instruct target (float32) on the same
prompts from the benchmark suites, greedy, and checks that every configuration
commits exactly the tokens of the first one. For each prompt the configurations
run back to back in an order that rotates from prompt to prompt, so load drift
on the machine hits all of them alike. Speed is decode speed: tokens after the
first over the time from the first token to the last, summed over prompts, as
wall time and as this process's CPU time (steadier when other jobs share the CPU).

`reference` needs z-lab's engine (`pip install --no-deps dflash==0.1.0`). It has
no reduced draft vocabulary, so ours runs twice: as shipped (reduced vocabulary)
and over the full vocabulary (then both engines propose the same tokens); `ours
auto` is what the CLI runs by default.
Results: JSON and a Markdown table under benchmarks/results/<date>-engine-<part>/.
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
import mlx.core as mx

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.bench.suites import format_prompt, load_suite
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.generate import encode_prompt, tau

SUITES = ("gsm8k", "humaneval", "mtbench")


def prompts_from_suites(tokenizer, per_suite: int):
    out = []
    for suite in SUITES:
        for p in load_suite(suite, limit=per_suite):
            out.append((f"{suite}/{p.id}", encode_prompt(tokenizer, format_prompt(tokenizer, p))))
    return out


def timed(stream):
    """(tokens, (decode wall seconds, decode CPU seconds), accept lengths) of one generation.

    CPU seconds are this process's (all its threads): on a machine shared with other
    jobs they move far less with the load than wall time does."""
    tokens, first_at, accepts = [], None, []
    for r in stream:
        tokens += r.tokens
        if first_at is None and tokens:
            first_at = (time.perf_counter(), time.process_time())
        accepts = getattr(r, "accept_lengths", accepts)
    return tokens, (time.perf_counter() - first_at[0], time.process_time() - first_at[1]), accepts


def ours(model, draft, tokenizer, block_size, baseline=False, split_head=None):
    """`split_head=False`: the verify's LM head over all rows at once (see cycle.HeadRows)."""

    def run(prompt, max_tokens):
        return timed(stream_generate(model, draft, tokenizer, prompt, max_tokens=max_tokens,
                                     block_size=block_size, baseline=baseline, split_head=split_head))
    return run


def mlx_lm_plain(model, tokenizer):
    """mlx-lm's own greedy `stream_generate` (what "plain mlx-lm decoding" means)."""
    from mlx_lm.generate import stream_generate as lm_stream_generate
    from mlx_lm.sample_utils import make_sampler

    class _Tokens:
        def __init__(self, r):
            self.tokens = [r.token]

    def run(prompt, max_tokens):
        stream = lm_stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens,
                                    sampler=make_sampler(0.0))
        return timed(_Tokens(r) for r in stream)

    return run


def reference_engine(tokenizer, draft_dir=None):
    """z-lab's `stream_generate` with its own copy of the target (it wraps the model's
    layers for good) and the shipped draft loaded by its own loader."""
    import dflash.model_mlx as ref

    from dflash_mlx.models import packaged
    from dflash_mlx.models.draft.checkpoints import DRAFT_VOCAB_FILE

    folder = Path(draft_dir) if draft_dir else packaged.packaged_draft_dir("smollm2-135m")
    copy = Path(tempfile.mkdtemp(prefix="dflash-ref-draft-"))
    # its loader reads every *.safetensors as weights: leave our vocabulary file out
    for f in folder.iterdir():
        if f.name == "config.json" or (f.suffix == ".safetensors" and f.name != DRAFT_VOCAB_FILE):
            shutil.copy(f, copy / f.name)
    ref.snapshot_download = lambda repo, **kw: repo  # a local folder, not a hub id
    their_model, _ = load("smollm2-135m", quiet=True)
    theirs = ref.load_draft(str(copy))
    theirs.set_dtype(mx.float32)
    theirs.bind(their_model)

    def run(prompt, max_tokens):
        tokens, seconds, _ = timed(ref.stream_generate(their_model, theirs, tokenizer, prompt,
                                                       block_size=16, max_tokens=max_tokens))
        return tokens, seconds, None  # seconds: (wall, CPU) from timed()

    return run


def standard_layout(module):
    """Undo `dflash_mlx.models.layout.relayout_for_cpu`: every dense Linear weight row-major
    again (what mlx-lm's own loader leaves), the same values."""
    import mlx.nn as nn

    for _, m in module.named_modules():
        if type(m) is nn.Linear:
            m.weight = mx.contiguous(m.weight)
            mx.eval(m.weight)


def compiled_mlps(draft):
    """A copy of `draft` whose layers' MLPs (mlx-lm's SwiGLU) run through `mx.compile`
    (the attention takes the context cache, a Python object, so it stays as it is)."""
    import copy

    twin = copy.copy(draft)
    twin.layers = [copy.copy(layer) for layer in draft.layers]
    for layer in twin.layers:
        layer.mlp = mx.compile(layer.mlp)
    return twin


def compare(configs, prompts, max_tokens, warmup=True):
    names = list(configs)
    if warmup:
        for name in names:
            configs[name](prompts[0][1][:32], 8)
    rows = {n: {"tokens": 0, "seconds": 0.0, "cpu_seconds": 0.0, "accepts": []} for n in names}
    mismatches = []
    for i, (pid, prompt) in enumerate(prompts):
        order = names[i % len(names):] + names[: i % len(names)]
        outputs = {}
        for name in order:
            tokens, (seconds, cpu), accepts = configs[name](prompt, max_tokens)
            outputs[name] = tokens
            rows[name]["tokens"] += len(tokens) - 1
            rows[name]["seconds"] += seconds
            rows[name]["cpu_seconds"] += cpu
            rows[name]["accepts"] += accepts or []
            print(f"  {pid:24s} {name:26s} {(len(tokens) - 1) / seconds:6.2f} tok/s, "
                  f"{(len(tokens) - 1) / cpu:6.2f} per CPU s", flush=True)
        for name in names[1:]:
            if outputs[name] != outputs[names[0]]:
                mismatches.append((pid, name))
    for r in rows.values():
        r["tok_s"] = r["tokens"] / r["seconds"]
        r["tok_cpu_s"] = r["tokens"] / r["cpu_seconds"]
        r["tau"] = tau(r.pop("accepts")) or None
    return rows, mismatches


def speed_table(rows, base: str):
    """`compare`'s rows as a Markdown table's lines, each against the row named `base`."""
    lines = [f"| configuration | decode tok/s | vs {base} | tokens per CPU second | vs {base} (CPU) | tau |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        t = f"{r['tau']:.2f}" if r["tau"] else "-"
        lines.append(f"| {name} | {r['tok_s']:.2f} | {r['tok_s'] / rows[base]['tok_s']:.3f}x | {r['tok_cpu_s']:.2f} | "
                     f"{r['tok_cpu_s'] / rows[base]['tok_cpu_s']:.3f}x | {t} |")
    return lines


def environment():
    from dflash_mlx import blas

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "mlx": mx.__version__,
        "blas": str(blas.active_blas()),
        "load_average": os.getloadavg(),
        "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("part", choices=["reference", "auto", "widths", "layout", "compile"])
    p.add_argument("--per-suite", type=int, default=2, help="prompts per suite (gsm8k, humaneval, mtbench)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    p.add_argument("--draft", default="smollm2-135m", help="draft to compare (default: the shipped one)")
    args = p.parse_args(argv)

    model, tokenizer = load("smollm2-135m", quiet=True)
    shipped = load_draft(args.draft, model, quiet=True)
    prompts = prompts_from_suites(tokenizer, args.per_suite)
    if args.part == "reference":
        full = load_draft(args.draft, model, quiet=True)
        full.set_vocab(None)
        configs = {
            "z-lab block 16": reference_engine(tokenizer, None if args.draft == "smollm2-135m" else args.draft),
            "ours block 16": ours(model, shipped, tokenizer, 16),
            "ours block 16, head in one piece": ours(model, shipped, tokenizer, 16, split_head=False),
            "ours block 16 full vocab": ours(model, full, tokenizer, 16),
            "ours auto": ours(model, shipped, tokenizer, "auto"),
            # plain decoding in the same run, so both ratios come from one set of conditions
            "mlx-lm plain decoding": mlx_lm_plain(model, tokenizer),
        }
        base = "z-lab block 16"
    elif args.part == "auto":
        rand = random_draft(model, num_layers=2, seed=0)
        configs = {
            "plain decoding": ours(model, None, tokenizer, None, baseline=True),
            "mlx-lm plain decoding": mlx_lm_plain(model, tokenizer),
            "auto, shipped draft": ours(model, shipped, tokenizer, "auto"),
            "auto, random draft": ours(model, rand, tokenizer, "auto"),
        }
        base = "plain decoding"
    elif args.part == "layout":
        std_model, _ = load("smollm2-135m", quiet=True)
        std_draft = load_draft(args.draft, std_model, quiet=True)
        standard_layout(std_model)
        standard_layout(std_draft)
        configs = {
            "mlx-lm plain, standard layout": mlx_lm_plain(std_model, tokenizer),
            "mlx-lm plain, CPU layout": mlx_lm_plain(model, tokenizer),
            "ours plain, standard layout": ours(std_model, None, tokenizer, None, baseline=True),
            "ours plain, CPU layout": ours(model, None, tokenizer, None, baseline=True),
            "ours auto, standard layout": ours(std_model, std_draft, tokenizer, "auto"),
            "ours auto, CPU layout": ours(model, shipped, tokenizer, "auto"),
        }
        base = "mlx-lm plain, standard layout"
    elif args.part == "compile":
        twin = compiled_mlps(shipped)
        configs = {
            "block 4": ours(model, shipped, tokenizer, 4),
            "block 4, compiled draft MLPs": ours(model, twin, tokenizer, 4),
            "block 16": ours(model, shipped, tokenizer, 16),
            "block 16, compiled draft MLPs": ours(model, twin, tokenizer, 16),
        }
        base = "block 4"
    else:
        configs = {"auto": ours(model, shipped, tokenizer, "auto")}
        for w in (2, 3, 4, 8, 16):
            configs[f"block {w}"] = ours(model, shipped, tokenizer, w)
        base = "auto"

    t0 = time.perf_counter()
    env = environment()
    rows, mismatches = compare(configs, prompts, args.max_tokens)
    env["load_average_end"] = os.getloadavg()
    env["wall_seconds"] = round(time.perf_counter() - t0, 1)
    for r in rows.values():
        r["vs_base"] = r["tok_s"] / rows[base]["tok_s"]
        r["vs_base_cpu"] = r["tok_cpu_s"] / rows[base]["tok_cpu_s"]

    lines = [f"# Engine benchmark: {args.part}", "",
             f"{len(prompts)} prompts ({', '.join(SUITES)}, {args.per_suite} each), {args.max_tokens} tokens, "
             f"greedy, SmolLM2-135M-Instruct f32, interleaved in one process. Identical tokens: "
             f"{'yes' if not mismatches else 'NO ' + str(mismatches)}.", "",
             *speed_table(rows, base)]
    lines += ["", f"Machine: {env['machine']}, MLX {env['mlx']}, BLAS {env['blas']}, load average "
              f"{env['load_average'][0]:.1f} at start, {env['load_average_end'][0]:.1f} at end, "
              f"{env['wall_seconds']} s."]
    report = "\n".join(lines) + "\n"
    print(report)

    day = datetime.date.today().strftime("%Y%m%d")
    out = Path(args.out or Path(__file__).parent / "results" / f"{day}-engine-{args.part}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"part": args.part, "prompts": [pid for pid, _ in prompts], "max_tokens": args.max_tokens,
         "configs": rows, "identical_tokens": not mismatches, "mismatches": mismatches,
         "environment": env}, indent=2))
    (out / "README.md").write_text(report)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
