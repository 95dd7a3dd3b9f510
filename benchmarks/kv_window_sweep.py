"""A bounded KV cache (`max_kv_size`) on every architecture of the quick check: exact, or refused in one line.

    python benchmarks/kv_window_sweep.py [--size 8] [--keys qwen3,llama] [--out DIR]

Each architecture of `dflash_mlx.testing.arch_check` (its tiny random model, float32) is decoded greedily by
DFlash with mlx-lm's bounded cache (`--size`: the first 4 tokens and a window; mlx-lm's `make_prompt_cache`
makes one for models that make no caches of their own and ignores the bound for the others, "own caches"
below) against mlx-lm's own `generate_step(max_kv_size=...)`, on a prompt of 3 tokens (the window fills in
the answer) and one of 20 (it fills in the prompt): a random draft at `auto`, a scripted draft right for a
random number of tokens each cycle at its block size, no draft, and deterministic mode. "changed" says
whether the bound changed mlx-lm's answer in some case (where not, a verify's mask could not have shown).
Writes README.md and results.json.
"""

import argparse
import datetime
import random
import sys
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core)
import mlx.core as mx

HERE = Path(__file__).resolve().parent
PROMPT_LENGTHS, MAX_TOKENS, BLOCK = (3, 20), 24, 8


def check(key: str, size: int) -> dict:
    from dflash_mlx import stream_generate
    from dflash_mlx.models.draft.checkpoints import random_draft
    from dflash_mlx.models.target.adapter import Target, UnsupportedTargetError
    from dflash_mlx.testing.arch_sweep import built
    from dflash_mlx.testing.targets import EOS_ID, ScriptedDraft, byte_tokenizer, greedy_reference

    model, outcome = built(key)
    if outcome is not None:
        return outcome
    own = hasattr(model, "make_cache")
    tok, changed = byte_tokenizer(), False
    for length in PROMPT_LENGTHS:
        for s in range(20):
            rng = random.Random(s)
            prompt = [rng.randrange(0, 256) for _ in range(length)]
            ref = greedy_reference(model, prompt, MAX_TOKENS, max_kv_size=size)
            if EOS_ID not in ref:
                break
        changed = changed or ref != greedy_reference(model, prompt, MAX_TOKENS)
        if EOS_ID in ref:  # (no case without one: the engine stops there, as mlx-lm's stream_generate does)
            ref = ref[: ref.index(EOS_ID) + 1]

        def decode(draft, width, **extra):
            out = []
            for r in stream_generate(model, draft, tok, prompt, max_tokens=MAX_TOKENS, block_size=width,
                                     stop_token_ids=[], max_kv_size=size, **extra):
                out += r.tokens
            return out

        rng = random.Random(1)
        right = [rng.randrange(0, BLOCK) for _ in range(100)]

        def scripted():
            return ScriptedDraft(Target(model), prompt + ref, lambda c: right[c], block_size=BLOCK)

        runs = {"random draft, auto": lambda: decode(random_draft(model, num_layers=1, block_size=BLOCK, seed=3),
                                                     "auto"),
                "scripted draft": lambda: decode(scripted(), "draft"),
                "no draft": lambda: decode(None, "auto"),
                "deterministic": lambda: decode(scripted(), "draft", deterministic=True)}
        for name, run in runs.items():
            try:
                out = run()
            except UnsupportedTargetError as e:
                if name == "deterministic" and "deterministic" in str(e):
                    continue  # (a target deterministic mode refuses whatever the cache)
                return dict(status="refused", reason=str(e), changed=changed)
            if out != ref:
                return dict(status="mismatch", reason=f"prompt of {length}, {name}: {out} != mlx-lm's {ref}",
                            changed=changed)
    return dict(status="own caches" if own else "exact", changed=changed)


def main(argv=None):
    from dflash_mlx.testing import arch_check
    from dflash_mlx.testing.arch_sweep import exact_and_changed, sweep, write_report

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=8)
    ap.add_argument("--keys", default=None, help="comma-separated architecture keys (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    keys = args.keys.split(",") if args.keys else list(arch_check.ARCHITECTURES)
    results, counts, seconds = sweep(keys, lambda key: check(key, args.size))
    command = (f"`python benchmarks/kv_window_sweep.py --size {args.size}`: {len(keys)} architectures, max_kv_size "
               f"{args.size}, prompts of {' and '.join(map(str, PROMPT_LENGTHS))} tokens, {MAX_TOKENS} tokens, "
               f"float32, MLX {mx.__version__} ({mx.default_device()}); {seconds:.0f} s.")
    changed = (f"Exact on a bounded cache where the bound changed mlx-lm's answer: {exact_and_changed(results)} of "
               f"{counts.get('exact', 0)}. \"own caches\": the model makes its own (mlx-lm ignores `max_kv_size`; "
               "so does the engine), checked all the same.")
    out = Path(args.out or HERE / "results" / f"{datetime.date.today():%Y%m%d}-kv-window-sweep")
    return write_report(out, f"A bounded KV cache on every architecture ({datetime.date.today()})", command,
                        results, counts, changed, dict(size=args.size))


if __name__ == "__main__":
    sys.exit(main())
