"""GGUF file -> mlx-lm model + tokenizer: the entry point (`load_gguf`).

The parts: `reader` parses the header and reads tensors, `convert` builds the
mlx-lm model from them, `tokenizer` converts and caches the tokenizer.

Supported architectures: llama (SmolLM2, Llama, incl. Llama 3.1 `rope_freqs`),
gemma3 (text), qwen2, qwen3 and qwen3moe (Qwen3-MoE: stacked expert tensors map
to mlx-lm's `SwitchGLU`). gpt-oss is refused (MXFP4 experts, attention sinks and
YaRN RoPE are not mapped); any other architecture too. For those, convert the
Hugging Face checkpoint with `mlx_lm.convert` and load the folder.
"""

import sys
from pathlib import Path
from typing import Callable

from dflash_mlx.models.gguf.convert import load_gguf_model, model_config
from dflash_mlx.models.gguf.reader import read_gguf
from dflash_mlx.models.gguf.tokenizer import load_gguf_tokenizer


def stderr_progress(label: str) -> Callable[[int, int], None]:
    """`progress.Progress` on stderr when it is a terminal, else silent."""
    if not sys.stderr.isatty():
        return lambda done, total: None
    from dflash_mlx.progress import Progress

    bar = None

    def show(done, total):
        nonlocal bar
        if bar is None:
            bar = Progress(total, label, "tensors", every=0.1)
        bar.update(done, force=done >= total)
        if done >= total:
            bar.close()

    return show


def load_gguf(path, dtype=None, progress=None):
    """`(model, tokenizer, config)` from a GGUF file."""
    gf = read_gguf(path)
    cfg = model_config(gf)  # fail fast on unsupported files, before the slow parts
    if progress is None:
        progress = stderr_progress(f"Loading {Path(path).name}")
    model, cfg = load_gguf_model(gf, dtype=dtype, progress=progress)
    eos = cfg.get("eos_token_id")
    tokenizer = load_gguf_tokenizer(gf, eos_token_ids=[eos] if eos is not None else None)
    return model, tokenizer, cfg
