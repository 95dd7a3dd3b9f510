"""mlx-lm's small-model drafts (`--draft-model`, `models.draft.autoregressive`) in the DFlash engine: greedy
output is the target's own at every width, with trees and copies, alone and batched, over a reused prompt
cache and a prompt cache file; sampling keeps the target's distribution; the draft's context follows the
target's (a draft equal to the target has every chain accepted, sliding windows too); what cannot fit is
refused in one line."""

from functools import lru_cache

import dflash_mlx  # noqa: F401,I001  (before mlx.core: BLAS routing)
import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import load_prompt_cache, make_prompt_cache, save_prompt_cache, stream_generate
from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.engine.rows import BatchRequest
from dflash_mlx.models.draft.autoregressive import AutoregressiveDraft
from dflash_mlx.models.draft.config import DraftMismatchError
from dflash_mlx.options import GenerationOptions
from dflash_mlx.policy.sizer import forget_sizers
from dflash_mlx.testing.serving import serve
from dflash_mlx.testing.targets import byte_tokenizer, greedy_reference, tiny_target

PROMPT = [5, 3, 9, 14, 2, 7, 1]


@lru_cache(maxsize=None)
def models(vocab_size: int = 300):
    """(target, a draft model equal to it, a smaller other one): untied heads, so greedy answers do not
    repeat one token."""
    kw = dict(tie_word_embeddings=False, vocab_size=vocab_size)
    target, _ = tiny_target("qwen3", seed=1, **kw)
    same, _ = tiny_target("qwen3", seed=1, **kw)
    other, _ = tiny_target("qwen3", seed=4, num_hidden_layers=1, **kw)
    return target, same, other


def answer(model, draft, prompt, max_tokens, **kw):
    tokens, last = [], None
    for last in stream_generate(model, draft, byte_tokenizer(), prompt, max_tokens=max_tokens, **kw):
        tokens += last.tokens
    return tokens, last


@pytest.mark.parametrize("which", ["same", "other"])
@pytest.mark.parametrize("num_draft_tokens,width", [(1, 2), (3, 4), (7, 8), (7, 3), (7, "auto")])
@pytest.mark.parametrize("trees", [False, True])
def test_greedy_is_the_targets_own(which, num_draft_tokens, width, trees):
    """Every width (fixed, and sized by the policy), token trees on and off, a short and a long prompt run in
    chunks, a stop token and a length stop: the target's own greedy tokens."""
    forget_sizers()
    target, same, other = models()
    draft = AutoregressiveDraft(same if which == "same" else other, num_draft_tokens=num_draft_tokens)
    long_prompt = [(7 * i + 3) % 251 for i in range(70)]
    for prompt in (PROMPT, long_prompt):
        ref = greedy_reference(target, prompt, 40, stop_ids=[])
        out, last = answer(target, draft, prompt, 40, block_size=width, token_trees=trees, stop_token_ids=[],
                           prefill_step_size=16)
        assert out == ref and last.finish_reason == "length"
        stop = ref[25]
        out, last = answer(target, draft, prompt, 40, block_size=width, token_trees=trees, stop_token_ids=[stop],
                           prefill_step_size=16)
        assert out == ref[: ref.index(stop) + 1] and last.finish_reason == "stop"


@pytest.mark.parametrize("width", [2, 5, 8])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma3_text"])
def test_a_draft_equal_to_the_target_has_its_chains_accepted(width, arch):
    """The draft's cache holds the target's tokens and no more (kept as the target's entries are kept, its
    proposals trimmed back): a draft equal to the target proposes the target's own tokens, so every chain is
    accepted whole. A cache one token off (a proposal left in it, a kept token missing) would fail this. With
    sliding-window layers (Llama's, window 24; Gemma 3's, 16) the draft's keep every entry, and the window is
    their mask: far past the window, its chains are still the target's."""
    if arch == "qwen3":
        target, same, _ = models()
        prompt = PROMPT
    else:
        target, same = tiny_target(arch, seed=1)[0], tiny_target(arch, seed=1)[0]
        prompt = [(7 * i + 3) % 251 for i in range(70)]
    draft = AutoregressiveDraft(same, num_draft_tokens=7)
    out, last = answer(target, draft, prompt, 48, block_size=width, stop_token_ids=[], copy_proposals=False,
                       prefill_step_size=16)
    assert out == greedy_reference(target, prompt, 48, stop_ids=[])
    accepts = last.accept_lengths[:-1]  # (the last cycle is cut by the length)
    assert accepts and all(a == width - 1 for a in accepts), accepts


def test_batched_rows_are_each_their_own_greedy():
    """Three requests of different lengths in one batched engine, joining mid-stream: each row's answer is the
    target's greedy answer to it alone (the draft proposes for each row from its own cache)."""
    forget_sizers()
    target, _, other = models()
    draft = AutoregressiveDraft(other, num_draft_tokens=4)
    prompts = [PROMPT, PROMPT[:4] + [11, 12], [(5 * i + 1) % 250 for i in range(23)]]
    refs = [greedy_reference(target, p, 16 + 4 * i, stop_ids=[]) for i, p in enumerate(prompts)]
    engine = BatchEngine(target, draft, byte_tokenizer(), max_batch=3, prefill_chunk=8, block_size=4)
    requests = [BatchRequest(p, GenerationOptions(max_tokens=len(r)), stop_token_ids=()) for p, r in zip(prompts, refs)]
    tokens, _, _ = serve(engine, requests, join_every=2)
    assert [tokens[i] for i in range(3)] == refs


def test_a_reused_prompt_cache_and_a_prompt_cache_file(tmp_path):
    """A second turn over a kept prompt cache, and an answer after a prompt cache file holding the draft's
    context: the target's greedy answers, the draft's context restored from the file."""
    target, same, _ = models()
    draft = AutoregressiveDraft(same, num_draft_tokens=5)
    cache = make_prompt_cache(target, draft)
    first, _ = answer(target, draft, PROMPT, 12, block_size=6, stop_token_ids=[], prompt_cache=cache)
    second_prompt = PROMPT + first + [4, 8]
    second, _ = answer(target, draft, second_prompt, 20, block_size=6, stop_token_ids=[], prompt_cache=cache)
    assert second == greedy_reference(target, second_prompt, 20, stop_ids=[])

    path = tmp_path / "doc.safetensors"
    state = make_prompt_cache(target, draft)
    answer(target, draft, PROMPT, 1, stop_token_ids=[], prompt_cache=state)
    save_prompt_cache(path, state)
    loaded, info = load_prompt_cache(path, target, draft)
    assert info.draft_context == "restored"
    rest = [4, 8, 15]
    out, last = answer(target, draft, PROMPT + rest, 24, block_size=6, stop_token_ids=[], prompt_cache=loaded)
    assert out == greedy_reference(target, PROMPT + rest, 24, stop_ids=[])
    assert max(last.accept_lengths[:-1]) == 5  # (its restored context lines up with the target's)


@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_sampling_keeps_the_targets_distribution(mode):
    """At temperature > 0 the first three tokens over many seeds follow the target's own distribution (exact,
    from the model): the draft proposes along its argmax chain, or draws each token after the ones drawn before
    it (`draft_sampling="sample"`), accepted or resampled as any draft's."""
    from test_sampling import chi_square, encode, exact_first_tokens

    target, _, other = models(vocab_size=4)
    draft = AutoregressiveDraft(other, num_draft_tokens=2)
    prompt, outs, accepts = [1, 2, 3, 0], [], []
    for seed in range(150):
        out, last = answer(target, draft, prompt, 3, seed=seed, temperature=0.7, block_size=3, stop_token_ids=[],
                           draft_sampling=mode)
        outs.append(out)
        accepts += last.accept_lengths
    assert 0 < sum(accepts) < 2 * len(accepts)  # some drafts accepted, some not
    exact = exact_first_tokens(target, prompt, 3, temperature=0.7)
    _, pval = chi_square(encode(np.array(outs), 4), exact)
    assert pval > 1e-3


def test_refusals_in_one_line():
    """A draft model whose caches cannot drop a rejected token (sliding windows), another tokenizer's
    vocabulary or text, a bad number of draft tokens: each a one-line error naming what to do."""
    target, same, _ = models()
    recurrent, _ = tiny_target("qwen3_5", seed=1)
    with pytest.raises(DraftMismatchError, match="keeps ArraysCache caches: an autoregressive draft must be an "
                                                 "attention model"):
        AutoregressiveDraft(recurrent)
    big_vocab, _ = tiny_target("qwen3", seed=2, vocab_size=1400, tie_word_embeddings=False)
    with pytest.raises(DraftMismatchError, match="scores 1400 tokens and the target 300"):
        answer(target, AutoregressiveDraft(big_vocab), PROMPT, 4)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="num_draft_tokens must be a whole number"):
            AutoregressiveDraft(same, num_draft_tokens=bad)

    class Renamed:  # the target's byte vocabulary, with a share of its texts at other ids
        def __init__(self, apart):
            self.vocab = dict(byte_tokenizer().get_vocab())
            texts = sorted(self.vocab)[:apart]
            ids = [self.vocab[t] for t in texts]
            self.vocab.update(zip(texts, ids[1:] + ids[:1]))

        def get_vocab(self):
            return self.vocab

    n = len(byte_tokenizer().get_vocab())
    with pytest.raises(DraftMismatchError, match=f"tokenizer is not the target's: 20 of the target's {n} tokens") as e:
        answer(target, AutoregressiveDraft(same, Renamed(20)), PROMPT, 4)
    assert "\n" not in str(e.value)
    answer(target, AutoregressiveDraft(same, Renamed(2)), PROMPT, 4)  # (two special tokens named apart: taken)
    assert answer(target, AutoregressiveDraft(same, byte_tokenizer()), PROMPT, 4, stop_token_ids=[])[0] == \
        greedy_reference(target, PROMPT, 4, stop_ids=[])


@pytest.mark.parametrize("option", ["deterministic", "kv_bits", "max_kv_size", "repetition_penalty", "logprobs"])
def test_mlx_lm_options_with_a_small_model_draft(option):
    """mlx-lm's decoding options with a small-model draft: the answer is mlx-lm's greedy decode under the same
    option (every row in plain decoding's shapes; a KV cache quantized from token 9, a bounded one of 12
    tokens, a repetition penalty; log-probabilities asked, which read each cycle's logits)."""
    from mlx_lm.sample_utils import make_logits_processors

    model, _ = tiny_target("qwen3", seed=1, head_dim=32, tie_word_embeddings=False)
    other, _ = tiny_target("qwen3", seed=4, head_dim=32, num_hidden_layers=1, tie_word_embeddings=False)
    draft = AutoregressiveDraft(other, num_draft_tokens=4)
    prompt = PROMPT * 3
    ours = {"deterministic": dict(deterministic=True), "max_kv_size": dict(max_kv_size=12),
            "kv_bits": dict(kv_bits=4, kv_group_size=32, quantized_kv_start=9),
            "repetition_penalty": dict(repetition_penalty=1.3), "logprobs": dict(logprobs=2)}[option]
    theirs = {"kv_bits": ours, "max_kv_size": ours,
              "repetition_penalty": dict(logits_processors=make_logits_processors(repetition_penalty=1.3))}
    ref = greedy_reference(model, prompt, 32, stop_ids=[], **theirs.get(option, {}))
    assert option in ("deterministic", "logprobs") or ref != greedy_reference(model, prompt, 32, stop_ids=[])
    out, _ = answer(model, draft, prompt, 32, block_size=5, stop_token_ids=[], **ours)
    assert out == ref


def test_a_dflash_draft_given_as_a_draft_model_is_refused_in_one_line(tmp_path):
    """A DFlash draft's folder passed where a language model is expected: one line saying to load it as a draft
    (mlx-lm's loader would fail on its config in its own words)."""
    from dflash_mlx import load_draft_model
    from dflash_mlx.models.draft.checkpoints import random_draft, save_draft

    target, _, _ = models()
    save_draft(random_draft(target, num_layers=1, block_size=4), tmp_path / "draft")
    with pytest.raises(DraftMismatchError, match="is a DFlash draft, not a language model: load it as one") as e:
        load_draft_model(tmp_path / "draft", target)
    assert "\n" not in str(e.value)


def test_sampled_chains_follow_the_draft_at_temperature():
    """`draft_sampling="sample"`: each drafted token is drawn from the draft's distribution after the ones drawn
    before it, so a draft equal to the target (its q the target's p) has its chains accepted almost whole at
    temperature 1, where argmax proposals are accepted only as often as the target draws its argmax."""
    target, same, _ = models()
    draft = AutoregressiveDraft(same, num_draft_tokens=4)

    def mean_accept(mode):
        accepts = []
        for seed in range(4):
            _, last = answer(target, draft, PROMPT, 40, seed=seed, temperature=1.0, block_size=5, draft_sampling=mode,
                             stop_token_ids=[], copy_proposals=False)
            accepts += last.accept_lengths[:-1]
        return sum(accepts) / len(accepts)

    sampled, argmax = mean_accept("sample"), mean_accept("argmax")
    assert sampled > 3.5 and sampled > argmax + 1, (sampled, argmax)
