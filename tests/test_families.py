"""Every target family z-lab publishes drafts for, and many more of mlx-lm's text
architectures: DFlash greedy equals mlx-lm's own greedy decode token for token.

Tiny random float32 models (`dflash_mlx.testing.archs`): dense, MoE, sliding-window,
latent attention (MLA, with a sparse-attention indexer) and state-space / linear
attention hybrids. For each: `auto` with a random draft, partial
accepts of every length with a scripted draft, a prompt past every sliding window, a
stop id inside an accepted block, and a second chat turn that reuses the first's caches.
"""

import random
from functools import lru_cache

import pytest

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
from dflash_mlx import stream_generate
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.generate import make_prompt_cache
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import EOS_ID, ScriptedDraft, byte_tokenizer, clean_case, greedy_reference
from dflash_mlx.testing.archs import FAMILY_ARCHS, MORE_ARCHS, build

ARCHS = list(FAMILY_ARCHS) + list(MORE_ARCHS)
PROMPT_LEN = 60  # past every sliding window of the tiny configs
MAX_TOKENS = 20


@lru_cache(maxsize=None)
def model_for(key):
    return build(key)


@lru_cache(maxsize=None)
def case_for(key):
    """A random prompt whose greedy continuation is varied (tiny random models, MoE ones
    most, can fall into a constant run on some prompts: such a case tests nothing)."""
    for seed in range(13, 33):
        prompt, ref = clean_case(model_for(key), PROMPT_LEN, MAX_TOKENS, seed=seed)
        if len(set(ref)) >= 8:
            break
    return prompt, ref


def decode(model, draft, prompt, **kw):
    tokens, responses = [], []
    for r in stream_generate(model, draft, byte_tokenizer(), prompt, **kw):
        tokens += r.tokens
        responses.append(r)
    return tokens, responses


def test_the_issue_families_are_all_here():
    assert set(FAMILY_ARCHS) == {"qwen3_moe", "qwen3_next", "qwen3_5_moe", "gemma4_text_moe", "gpt_oss",
                                 "minimax", "kimi_k25", "glm_moe_dsa"}
    assert len(MORE_ARCHS) >= 20
    kinds = {k: set(Target(model_for(k)).rollback_kinds()) for k in ARCHS}
    assert sum("replay" in v for v in kinds.values()) >= 6  # state-space / linear-attention hybrids


@pytest.mark.parametrize("key", ARCHS)
def test_greedy_equals_mlx_lm(key):
    """`auto` with a random draft; then a scripted draft right for a random number of tokens
    each cycle (every rollback length, whole rejections included), at width 16. (Fixed widths
    with a random draft run in tests/test_lossless.py; width 1 on every architecture in
    tests/test_architectures.py.)"""
    model = model_for(key)
    prompt, ref = case_for(key)
    assert len(set(ref)) >= 5, "the tiny model's greedy output is a near-constant run: it tests nothing"
    for width in ("auto",):
        draft = random_draft(model, num_layers=1, block_size=16, seed=3)
        out, _ = decode(model, draft, prompt, max_tokens=MAX_TOKENS, block_size=width, stop_token_ids=[])
        assert out == ref, f"width {width}"
    rng = random.Random(key)
    wrong = [rng.randrange(0, 16) for _ in range(100)]
    scripted = ScriptedDraft(Target(model), prompt + ref, lambda c: wrong[c], block_size=16, layer_ids="every")
    out, responses = decode(model, scripted, prompt, max_tokens=MAX_TOKENS, block_size="draft", stop_token_ids=[])
    assert out == ref
    accepts = responses[-1].accept_lengths
    assert accepts[:-1] == scripted.expected_accepts[: len(accepts) - 1]
    assert len(set(accepts)) >= 2


@pytest.mark.parametrize("key", ARCHS)
def test_stop_inside_a_block_and_a_second_turn(key):
    model = model_for(key)
    prompt, ref = case_for(key)
    # a stop id inside a fully accepted block: nothing past it
    stop_pos = next((i for i in range(3, len(ref)) if ref[i] not in ref[:i]), None)
    if stop_pos is not None:
        oracle = ScriptedDraft(Target(model), prompt + ref, lambda c: 10**9, block_size=16)
        out, responses = decode(model, oracle, prompt, max_tokens=MAX_TOKENS, block_size="draft",
                                stop_token_ids=[ref[stop_pos]])
        assert out == ref[: stop_pos + 1]
        assert responses[-1].finish_reason == "stop"
    # two chat turns: the second prompt extends the first turn's prompt and answer
    draft = random_draft(model, num_layers=1, block_size=16, seed=4)
    cache = make_prompt_cache(model, draft)
    first, _ = decode(model, draft, prompt, max_tokens=8, block_size=4, stop_token_ids=[], prompt_cache=cache)
    assert first == ref[:8]  # (the case's reference has no EOS)
    turn2 = prompt + first + prompt[:10]
    second, responses = decode(model, draft, turn2, max_tokens=12, block_size=4, stop_token_ids=[],
                               prompt_cache=cache)
    assert second == greedy_reference(model, turn2, 12, stop_ids=(EOS_ID,))
    assert responses[0].prefill_tokens <= len(turn2) - len(prompt)  # the first turn's caches were reused


def test_a_cache_without_a_rollback_path_is_refused_naming_it():
    from dflash_mlx.models.target.adapter import UnsupportedTargetError
    from dflash_mlx.testing.targets import tiny_target

    class OpaqueCache:  # neither trimmable nor a recurrent state the engine can restore
        pass

    model, _ = tiny_target("qwen3")
    model.make_cache = lambda: [OpaqueCache() for _ in model.layers]
    with pytest.raises(UnsupportedTargetError, match=r"cache 0 \(OpaqueCache\) cannot be rolled back"):
        Target(model)


def test_a_model_without_decoder_layers_is_refused_naming_what_is_missing():
    import mlx.nn as nn

    from dflash_mlx.models.target.adapter import UnsupportedTargetError

    class NotALanguageModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Linear(4, 4)

    with pytest.raises(UnsupportedTargetError, match="cannot find the decoder layers and token embedding"):
        Target(NotALanguageModel())


@pytest.mark.parametrize("key", ["granite", "cohere", "minicpm3"])
def test_models_with_their_own_output_code_get_their_own_logits(key):
    """Logit scaling (Granite), a logit scale (Cohere), a scaled head input (MiniCPM3):
    the engine's logits are the model's own, computed from the same hidden states."""
    import mlx.core as mx

    model = model_for(key)
    target = Target(model)
    assert target.vocab._own_head  # found by the check: the soft-capped head alone would be wrong here
    prompt, _ = case_for(key)
    h, _, _ = target.forward(mx.array([prompt]), target.make_cache())
    own = model(mx.array([prompt]), cache=target.make_cache())
    assert mx.allclose(target.logits(h), own, atol=1e-5).item()
    assert not mx.allclose(target.logits(h, own_head=False), own, atol=1e-2).item()
