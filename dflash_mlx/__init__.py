"""DFlash block-diffusion speculative decoding for MLX."""

__version__ = "0.1.0"

# BLAS routing must run before anything imports mlx.core (see dflash_mlx/blas.py).
from dflash_mlx import blas as _blas

_blas.enable()

try:
    import mlx.core  # noqa: E402,F401
except ImportError as e:  # Linux: the `mlx` package alone, without a backend build
    raise ImportError(
        f"dflash-mlx: MLX cannot load its backend ({e}): on Linux install one, "
        "pip install 'dflash-mlx[cpu]' (CPU) or 'dflash-mlx[cuda]' (NVIDIA GPU, driver >= 580)"
    ) from e

from dflash_mlx import requirements as _requirements  # noqa: E402

_requirements.check()

from dflash_mlx.models.draft.dflash import DFlashDraftModel  # noqa: E402
from dflash_mlx.models.draft.config import DraftConfig, DraftMismatchError  # noqa: E402
from dflash_mlx.generate import (  # noqa: E402
    DFlashResponse,
    PromptCache,
    SuffixIndex,
    generate,
    make_prompt_cache,
    make_suffix_index,
    stream_generate,
)
from dflash_mlx.models.target.adapter import Target  # noqa: E402
from dflash_mlx.engine.prompt_cache_file import load_prompt_cache, save_prompt_cache  # noqa: E402


def load(*args, **kwargs):
    """Load a target model and tokenizer (packaged name, folder, .gguf file or hub id)."""
    from dflash_mlx.models.loading import load as _load

    return _load(*args, **kwargs)


def load_draft(*args, **kwargs):
    """Load a DFlash draft (packaged name, folder or hub id) and bind it to a target model."""
    from dflash_mlx.models.draft.checkpoints import load_draft as _load_draft

    return _load_draft(*args, **kwargs)


def load_draft_model(*args, **kwargs):
    """mlx-lm's `--draft-model`: a small model of the target's tokenizer as the draft, one token a forward
    (`models.draft.autoregressive`; checked against the target `model` and `tokenizer` where given)."""
    from dflash_mlx.models.draft.autoregressive import load_draft_model as _load_draft_model

    return _load_draft_model(*args, **kwargs)
