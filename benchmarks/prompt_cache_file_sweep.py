"""A prompt cache file (`dflash-mlx cache-prompt`, `--prompt-cache-file`) on every architecture of the quick check.

    python benchmarks/prompt_cache_file_sweep.py [--keys qwen3,llama] [--out DIR]

Each architecture of `dflash_mlx.testing.arch_check` (its tiny random model, float32): a prompt of 20 tokens
is run once and its caches saved twice, by the engine (`save_prompt_cache`, with a random draft's context) and
by mlx-lm (`generate_step(max_tokens=0)` + its `save_prompt_cache`, as its `cache_prompt`); after each file,
4 more tokens are answered greedily by DFlash (random draft at `auto`, no draft) and compared with mlx-lm's
`generate_step` after mlx-lm's own loader read the same file, fed the 4 tokens alone (its generate
--prompt-cache-file). "changed": the file's caches changed mlx-lm's answer (against the 4 tokens alone), so a
file read wrong would have shown. Writes README.md and results.json.
"""

import argparse
import datetime
import random
import sys
import tempfile
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core)
import mlx.core as mx

HERE = Path(__file__).resolve().parent
PREFIX, SUFFIX, MAX_TOKENS, BLOCK = 20, 4, 24, 8


def check(key: str) -> dict:
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import load_prompt_cache as mlx_lm_load
    from mlx_lm.models.cache import make_prompt_cache as mlx_lm_cache
    from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save

    from dflash_mlx import make_prompt_cache, stream_generate
    from dflash_mlx.engine.prompt_cache_file import continued, load_prompt_cache, save_prompt_cache
    from dflash_mlx.models.draft.checkpoints import random_draft
    from dflash_mlx.models.target.adapter import UnsupportedTargetError
    from dflash_mlx.testing.arch_sweep import built
    from dflash_mlx.testing.targets import EOS_ID, byte_tokenizer, greedy_reference

    model, outcome = built(key)
    if outcome is not None:
        return outcome
    tok, rng = byte_tokenizer(), random.Random(0)
    prefix = [rng.randrange(0, 256) for _ in range(PREFIX)]
    suffix = [rng.randrange(0, 256) for _ in range(SUFFIX)]
    draft = random_draft(model, num_layers=1, block_size=BLOCK, seed=3)

    def after(path):
        out = []
        for t, _ in generate_step(mx.array(suffix), model, max_tokens=MAX_TOKENS, prompt_cache=mlx_lm_load(str(path)),
                                  sampler=lambda x: mx.argmax(x, axis=-1)):
            out.append(int(t))
            if out[-1] == EOS_ID:
                break
        return out

    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = Path(tmp) / "ours.safetensors", Path(tmp) / "theirs.safetensors"
        try:
            state = make_prompt_cache(model, draft)
            list(stream_generate(model, draft, tok, prefix, max_tokens=1, prompt_cache=state))
            save_prompt_cache(ours, state)
        except (UnsupportedTargetError, ValueError) as e:
            return dict(status="refused", reason=f"(saving) {e}")
        cache = mlx_lm_cache(model)
        for _ in generate_step(mx.array(prefix), model, max_tokens=0, prompt_cache=cache):
            pass
        mlx_lm_save(str(theirs), cache, {"model": key, "tokenizer_config": "{}"})
        changed, notes = False, []
        for name, path in (("our file", ours), ("mlx-lm's file", theirs)):
            ref = after(path)
            changed = changed or ref != greedy_reference(model, suffix, MAX_TOKENS)[: len(ref)]
            for label, with_draft in (("random draft, auto", draft), ("no draft", None)):
                try:
                    loaded, info = load_prompt_cache(path, model, with_draft)
                    out = []
                    for r in stream_generate(model, with_draft, tok, continued(loaded, suffix), max_tokens=len(ref),
                                             prompt_cache=loaded, stop_token_ids=[]):
                        out += r.tokens
                except (UnsupportedTargetError, ValueError) as e:
                    if path == theirs:  # (our file was exact: mlx-lm's alone is refused)
                        notes.append(f"{name} refused: {str(e).split(': ', 1)[-1]}")
                        break
                    return dict(status="refused", reason=f"{name}, {label}: {e}", changed=changed)
                if out != ref:
                    return dict(status="mismatch", reason=f"{name}, {label}: {out} != mlx-lm's {ref}",
                                changed=changed)
    return dict(status="exact", changed=changed, reason="; ".join(notes))


def main(argv=None):
    from dflash_mlx.testing import arch_check
    from dflash_mlx.testing.arch_sweep import exact_and_changed, sweep, write_report

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default=None, help="comma-separated architecture keys (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    keys = args.keys.split(",") if args.keys else list(arch_check.ARCHITECTURES)
    results, counts, seconds = sweep(keys, check)
    command = (f"`python benchmarks/prompt_cache_file_sweep.py`: {len(keys)} architectures, a cached prompt of "
               f"{PREFIX} tokens, then {SUFFIX} more and up to {MAX_TOKENS} answered, float32, MLX {mx.__version__} "
               f"({mx.default_device()}); {seconds:.0f} s.")
    changed = (f"Exact where the file's caches changed mlx-lm's answer: {exact_and_changed(results)} of "
               f"{counts.get('exact', 0)}.")
    out = Path(args.out or HERE / "results" / f"{datetime.date.today():%Y%m%d}-prompt-cache-file-sweep")
    return write_report(out, f"A prompt cache file on every architecture ({datetime.date.today()})", command,
                        results, counts, changed, dict(prefix=PREFIX, suffix=SUFFIX, max_tokens=MAX_TOKENS))


if __name__ == "__main__":
    sys.exit(main())
