"""A prompt cache in a file (`engine/prompt_cache_file.py`, `dflash-mlx cache-prompt`, `--prompt-cache-file`):
what follows a cached prompt is mlx-lm's greedy decode after the same file (`generate_step` on mlx-lm's
`load_prompt_cache` of it), token for token, for files we write and files mlx-lm writes, with drafts, without,
under penalties, quantized and bounded caches; a file that does not fit the model is refused in one line.
"""

import json
import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache as mlx_lm_load
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_cache
from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save
from mlx_lm.sample_utils import make_logits_processors

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.engine.prompt_cache_file import (PromptCacheFileError, continued, load_prompt_cache,
                                                 save_prompt_cache)
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.models.target.kv_window import StepsWindowCache
from dflash_mlx.testing.targets import EOS_ID, decoded, tiny_target


def _ids(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def _cached(model, draft, tok, prefix, path, **kwargs):
    """Run `prefix` once with DFlash and save what it left (as `dflash-mlx cache-prompt` does)."""
    state = make_prompt_cache(model, draft, max_kv_size=kwargs.pop("max_kv_size", None))
    list(stream_generate(model, draft, tok, prefix, max_tokens=1, prompt_cache=state, **kwargs))
    save_prompt_cache(path, state, model_name="tiny")
    return path


def _mlx_lm_cached(model, prefix, path, max_kv_size=None, **kv_bits):
    """mlx-lm's `cache_prompt`: its prefill of `prefix`, saved with its `save_prompt_cache`."""
    cache = mlx_lm_cache(model, max_kv_size)
    for _ in generate_step(mx.array(prefix), model, max_tokens=0, prompt_cache=cache, **kv_bits):
        pass
    mlx_lm_save(str(path), cache, {"model": "tiny", "tokenizer_config": "{}"})
    return path


def _after(model, path, suffix, n, **kwargs):
    """mlx-lm's generate --prompt-cache-file: greedy after the file's caches, fed the suffix alone."""
    out = []
    for t, _ in generate_step(mx.array(suffix), model, max_tokens=n, prompt_cache=mlx_lm_load(str(path)),
                              sampler=lambda x: mx.argmax(x, axis=-1), **kwargs):
        out.append(int(t))
        if out[-1] == EOS_ID:
            break
    return out


def _ours(model, draft, tok, path, suffix, n, width="auto", **kwargs):
    state, info = load_prompt_cache(path, model, draft)
    return decoded(model, draft, tok, continued(state, suffix), n, width, prompt_cache=state, **kwargs)[0], info


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma3_text", "qwen3_5", "gemma4_text"])
def test_our_file_answers_as_mlx_lm_does_after_it(arch, tmp_path):
    """Our file, read by mlx-lm's loader and by ours: DFlash's answer (every width) is mlx-lm's greedy decode
    after it; the draft's context comes back whole."""
    model, tok = tiny_target(arch, tie_word_embeddings=False) if arch in ("qwen3", "llama") else tiny_target(arch)
    draft = random_draft(model, block_size=8, num_layers=1)
    prefix, suffix = _ids(1, 40), _ids(2, 5)
    path = _cached(model, draft, tok, prefix, tmp_path / "c.safetensors")
    ref = _after(model, path, suffix, 32)
    assert len(ref) >= 8
    for width in (1, 4, 8, "auto"):
        out, info = _ours(model, draft, tok, path, suffix, 32, width)
        assert out == ref[: len(out)] and len(out) == len(ref), (arch, width)
        assert info.draft_context == "restored" and info.tokens_known
    state, _ = load_prompt_cache(path, model, None)  # no draft: the draft part is left out
    assert decoded(model, None, tok, continued(state, suffix), 32, prompt_cache=state)[0] == ref


def test_the_draft_context_comes_back_as_it_was(tmp_path):
    """The loaded draft context is the saved one: the drafts proposed after it equal those of the caches
    that were saved (a cold draft proposes others)."""
    model, tok = tiny_target("qwen3", tie_word_embeddings=False)
    draft = random_draft(model, block_size=8, num_layers=2)
    prefix = _ids(3, 30)
    state = make_prompt_cache(model, draft)
    list(stream_generate(model, draft, tok, prefix, max_tokens=1, prompt_cache=state))
    save_prompt_cache(tmp_path / "c.safetensors", state, model_name="tiny")
    loaded, info = load_prompt_cache(tmp_path / "c.safetensors", model, draft)
    assert info.draft_context == "restored" and loaded.tokens == state.tokens
    last = mx.array([prefix[-1]])
    saved = draft.propose_logits(last, None, state.draft_cache, 8)
    again = draft.propose_logits(last, None, loaded.draft_cache, 8)
    assert mx.array_equal(saved, again)
    cold = make_prompt_cache(model, draft)
    for c in cold.draft_cache:
        c.offset = len(prefix)
    assert not mx.allclose(draft.propose_logits(last, None, cold.draft_cache, 8), saved)


def test_mlx_lm_s_file_is_read_and_penalties_see_what_follows_it(tmp_path):
    """A file mlx-lm's cache_prompt wrote (no tokens, no draft part): the answer is mlx-lm's after it, the
    draft starts cold; with a repetition penalty, the processors see the suffix and the answer only, as
    mlx-lm's generate --prompt-cache-file feeds them."""
    model, tok = tiny_target("qwen3", tie_word_embeddings=False)
    draft = random_draft(model, block_size=8, num_layers=1)
    prefix, suffix = _ids(4, 40), _ids(5, 5)
    path = _mlx_lm_cached(model, prefix, tmp_path / "m.safetensors")
    for width in (1, 4, "auto"):
        out, info = _ours(model, draft, tok, path, suffix, 32, width)
        assert out == _after(model, path, suffix, 32), width
        assert info.draft_context == "cold" and not info.tokens_known
        penalised = _after(model, path, suffix, 32, logits_processors=make_logits_processors(repetition_penalty=1.5))
        out, _ = _ours(model, draft, tok, path, suffix, 32, width, repetition_penalty=1.5)
        assert out == penalised, width


def test_penalties_after_our_file_see_what_follows_it(tmp_path):
    """Our file, a repetition penalty over 20 tokens and a suffix of 5: the answer is mlx-lm's after the file,
    whose processors never see the cached prompt; seeing it (history from 0) gives other tokens here."""
    model, tok = tiny_target("qwen3", tie_word_embeddings=False)
    draft = random_draft(model, block_size=8, num_layers=1)
    processors = make_logits_processors(repetition_penalty=2.0)
    for seed in range(20):
        prefix, suffix = _ids(100 + seed, 30), _ids(200 + seed, 5)
        path = _cached(model, draft, tok, prefix, tmp_path / f"c{seed}.safetensors")
        ref = _after(model, path, suffix, 24, logits_processors=processors)
        out, _ = _ours(model, draft, tok, path, suffix, 24, repetition_penalty=2.0)
        assert out == ref, seed
        state, _ = load_prompt_cache(path, model, draft)
        state.history_start = 0
        seeing = decoded(model, draft, tok, continued(state, suffix), 24, prompt_cache=state,
                         repetition_penalty=2.0)[0]
        if seeing != ref:
            return
    raise AssertionError("the cached prompt never mattered to the penalty: the test cannot tell")


def test_a_quantized_file_answers_as_mlx_lm_does(tmp_path):
    """mlx-lm's 4-bit KV cache in the file (its cache_prompt --kv-bits 4), and ours: mlx-lm's answer after it,
    with or without --kv-bits given again."""
    model, tok = tiny_target("qwen3", head_dim=64, tie_word_embeddings=False)
    draft = random_draft(model, block_size=8, num_layers=1)
    prefix, suffix = _ids(6, 40), _ids(7, 4)
    kv = dict(kv_bits=4, kv_group_size=64, quantized_kv_start=0)
    theirs = _mlx_lm_cached(model, prefix, tmp_path / "m.safetensors", **kv)
    ours = _cached(model, draft, tok, prefix, tmp_path / "c.safetensors", **kv)
    for path in (theirs, ours):
        ref = _after(model, path, suffix, 24)
        assert ref != _after(model, _mlx_lm_cached(model, prefix, tmp_path / "f.safetensors"), suffix, 24)
        out, info = _ours(model, draft, tok, path, suffix, 24)
        assert out == ref and info.kv_bits == 4 and info.kv_group_size == 64
        assert _ours(model, draft, tok, path, suffix, 24, **kv)[0] == ref


def test_a_bounded_file_answers_as_mlx_lm_does(tmp_path):
    """mlx-lm's --max-kv-size 12 in the file (its bound read off the caches) and ours: the window comes back as
    our verify's window, and the answer is mlx-lm's after the file."""
    model, tok = tiny_target("qwen3", head_dim=32, tie_word_embeddings=False)
    draft = random_draft(model, block_size=8, num_layers=1)
    prefix, suffix = _ids(8, 20), _ids(9, 3)
    theirs = _mlx_lm_cached(model, prefix, tmp_path / "m.safetensors", max_kv_size=12)
    ours = _cached(model, draft, tok, prefix, tmp_path / "c.safetensors", max_kv_size=12)
    for path in (theirs, ours):
        ref = _after(model, path, suffix, 32)
        state, info = load_prompt_cache(path, model, draft)
        assert info.max_kv_size == 12 and all(type(c) is StepsWindowCache for c in state.target_cache)
        for width in (1, 4, "auto"):
            assert _ours(model, draft, tok, path, suffix, 32, width)[0] == ref, width


def test_a_file_that_does_not_fit_is_refused_in_one_line(tmp_path):
    model, tok = tiny_target("qwen3", tie_word_embeddings=False)
    draft = random_draft(model, block_size=8, num_layers=1)
    path = _cached(model, draft, tok, _ids(10, 20), tmp_path / "c.safetensors")
    other, _ = tiny_target("qwen3", seed=1, tie_word_embeddings=False)  # same shapes, other weights
    with pytest.raises(PromptCacheFileError, match="made for another model"):
        load_prompt_cache(path, other, None)
    wider, _ = tiny_target("qwen3", head_dim=32, tie_word_embeddings=False)
    theirs = _mlx_lm_cached(model, _ids(10, 20), tmp_path / "m.safetensors")
    with pytest.raises(PromptCacheFileError, match="holds arrays of shapes .* it was made for another model"):
        load_prompt_cache(theirs, wider, None)
    llama, _ = tiny_target("llama")
    with pytest.raises(PromptCacheFileError, match="it was made for another model"):
        load_prompt_cache(theirs, llama, None)
    with pytest.raises(PromptCacheFileError, match="no prompt cache file at"):
        load_prompt_cache(tmp_path / "missing.safetensors", model, None)
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(PromptCacheFileError, match="is not a prompt cache file of mlx-lm or dflash-mlx"):
        load_prompt_cache(tmp_path / "junk.safetensors", model, None)
    other_draft = random_draft(model, block_size=8, num_layers=2)  # another draft: it starts cold, same tokens
    out, info = _ours(model, other_draft, tok, path, _ids(11, 4), 16)
    assert info.draft_context == "cold" and out == _after(model, path, _ids(11, 4), 16)
    with pytest.raises(ValueError, match="holds no finished prompt"):
        save_prompt_cache(tmp_path / "x.safetensors", make_prompt_cache(model, draft))
    assert not (tmp_path / "x.safetensors").exists()
    state, _ = load_prompt_cache(theirs, model, None)
    list(stream_generate(model, None, tok, continued(state, [5, 6]), max_tokens=2, prompt_cache=state))
    with pytest.raises(ValueError, match="tokens it does not know"):
        save_prompt_cache(tmp_path / "y.safetensors", state)


def test_the_file_is_mlx_lm_s_format(tmp_path):
    """mlx-lm's loader reads our file and makes the target's caches alone (models such as Llama 4 and Gemma 4
    read every cache they are given); the draft's context is one more element of its list of states; mlx-lm's
    metadata keys."""
    model, tok = tiny_target("qwen3", tie_word_embeddings=False)
    draft = random_draft(model, block_size=8, num_layers=2)
    path = _cached(model, draft, tok, _ids(12, 20), tmp_path / "c.safetensors")
    caches, metadata = mlx_lm_load(str(path), return_metadata=True)
    assert len(caches) == len(model.layers) and all(c.offset == 20 for c in caches)
    n = len(model.layers)
    assert {k for k in mx.load(str(path)) if k.startswith(f"{n}.")} == {f"{n}.{i}.{kv}" for i in (0, 1)
                                                                        for kv in ("keys", "values")}
    assert metadata["model"] == "tiny" and json.loads(metadata["tokenizer_config"]) == {}
    ours = json.loads(metadata["dflash_mlx"])
    assert ours["tokens"] == _ids(12, 20) and ours["draft"]["layers"] == 2


def test_the_fingerprint_tells_weights_and_dtypes_apart():
    """The same weights give the same fingerprint; other weights, another dtype another one; a stand-in draft
    without parameters and a model with a 0-d parameter have one too."""
    import mlx.nn as nn

    from dflash_mlx.engine.prompt_cache_file import fingerprint
    from dflash_mlx.models.target.adapter import Target
    from dflash_mlx.testing.targets import ScriptedDraft

    model, _ = tiny_target("qwen3")
    again, _ = tiny_target("qwen3")
    other, _ = tiny_target("qwen3", seed=1)
    assert fingerprint(model) == fingerprint(again) != fingerprint(other)
    again.set_dtype(mx.bfloat16)
    assert fingerprint(again) != fingerprint(model)
    assert len(fingerprint(ScriptedDraft(Target(model), [1, 2, 3], lambda c: 0))) == 32

    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = mx.array(2.0)

    assert len(fingerprint(Scalar())) == 32
