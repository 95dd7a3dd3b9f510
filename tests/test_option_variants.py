"""Config options our tiny configs did not hold, that once made DFlash's greedy output differ
from mlx-lm's own greedy decode (issue 47): each is a named variant in
`dflash_mlx.testing.more_archs.OPTION_VARIANTS`, built as mlx-lm builds it, checked here on
the path that went wrong."""

import random
from functools import lru_cache

import pytest

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)

from dflash_mlx import stream_generate
from dflash_mlx.engine.prompt_cache import make_prompt_cache
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.testing import arch_check
from dflash_mlx.testing.targets import EOS_ID, byte_tokenizer, greedy_reference


@lru_cache(maxsize=None)
def model_for(key):
    return arch_check.build(key)


def _decode(model, draft, prompt, max_tokens, width, cache):
    return [t for r in stream_generate(model, draft, byte_tokenizer(), prompt, max_tokens=max_tokens,
                                       block_size=width, prompt_cache=cache) for t in r.tokens]


@pytest.mark.parametrize("width", [1, 4])
def test_chunked_attention_prompt_cache_reuse(width):
    """Llama 4's chunked layers (`ChunkedKVCache`) drop keys off their front as a decode runs on;
    a later prompt that shares a shorter prefix than the cache holds must not reuse a cache
    trimmed back past what it dropped (the chunked layers would trim less than the full ones,
    and miss keys of their chunk): the same prompt again, and one that branches off it."""
    model = model_for("llama4/chunk4")
    draft = random_draft(model, num_layers=1, block_size=8, seed=3)
    cache = make_prompt_cache(model, draft)
    rng = random.Random(0)
    prompt = [rng.randrange(0, 256) for _ in range(13)]
    branch = prompt[:9] + [rng.randrange(0, 256) for _ in range(6)]
    for p in (prompt, prompt, branch):
        out = _decode(model, draft, p, 20, width, cache)
        assert out == greedy_reference(model, p, 20, stop_ids=[EOS_ID])
