"""Engine behaviour beyond exactness: streamed text, prompt cache reuse, errors."""

import pytest

from dflash_mlx import generate, make_prompt_cache, stream_generate
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import EOS_ID, ScriptedDraft, chain_target, greedy_reference, tiny_target

TEXT = "hé 日✓"  # 1-, 2-, 3- and 3-byte characters, all bytes distinct


@pytest.mark.parametrize("block_size", [1, 2, 3, 16])
def test_streamed_text_handles_split_multibyte_characters(block_size):
    model, tok = chain_target(TEXT)
    ids = tok.encode(TEXT, add_special_tokens=False)
    n = 3 * len(ids) - 1
    ref = greedy_reference(model, ids[:1], n)
    draft = ScriptedDraft(Target(model), ids[:1] + ref, lambda c: 10**9)
    pieces = [r.text for r in stream_generate(model, draft, tok, ids[:1], max_tokens=n, block_size=block_size)]
    assert "".join(pieces) == (TEXT * 3)[1:]
    assert all("\ufffd" not in p for p in pieces)  # never a half character


def test_prompt_cache_reuses_prefix_and_stays_exact():
    for arch in ["qwen3", "qwen3_5", "gemma3_text"]:
        model, tok = tiny_target(arch, seed=4)
        draft = random_draft(model, num_layers=1, block_size=8)
        turn1 = list(range(40, 75))
        cache = make_prompt_cache(model, draft)
        out1 = [t for r in stream_generate(model, draft, tok, turn1, max_tokens=10, prompt_cache=cache, stop_token_ids=[EOS_ID], block_size="draft") for t in r.tokens]
        turn2 = turn1 + out1 + list(range(100, 112))
        responses = list(stream_generate(model, draft, tok, turn2, max_tokens=12, prompt_cache=cache, block_size="draft"))
        out2 = [t for r in responses for t in r.tokens]
        assert responses[0].prefill_tokens == 1 + 12, arch  # last answer token + the new turn
        assert responses[0].prompt_tokens == len(turn2)
        fresh = [t for r in stream_generate(model, draft, tok, turn2, max_tokens=12, block_size="draft") for t in r.tokens]
        assert out2 == fresh == greedy_reference(model, turn2, 12, stop_ids=[EOS_ID])[: len(out2)], arch
        assert len(out2) == 12 or out2[-1] == EOS_ID


def test_prompt_cache_diverging_history_trims_or_resets():
    for arch in ["qwen3", "qwen3_5"]:
        model, tok = tiny_target(arch, seed=5)
        draft = random_draft(model, block_size=4)
        cache = make_prompt_cache(model, draft)
        list(stream_generate(model, draft, tok, list(range(50, 90)), max_tokens=5, prompt_cache=cache, block_size="draft"))
        edited = list(range(50, 70)) + [1, 2, 3]
        responses = list(stream_generate(model, draft, tok, edited, max_tokens=8, prompt_cache=cache, block_size="draft"))
        out = [t for r in responses for t in r.tokens]
        assert out == greedy_reference(model, edited, 8, stop_ids=[EOS_ID])
        # KV caches trim back to the shared prefix; recurrent state cannot, so it re-prefills
        assert responses[0].prefill_tokens == (3 if arch == "qwen3" else len(edited))


def test_generate_returns_whole_text():
    model, tok = chain_target(TEXT)
    ids = tok.encode(TEXT, add_special_tokens=False)
    draft = random_draft(model, block_size=4)
    assert generate(model, draft, tok, ids[:1], max_tokens=len(ids) - 1, block_size="draft") == TEXT[1:]


def test_errors_are_clear():
    model, tok = tiny_target("llama")
    draft = random_draft(model)
    with pytest.raises(ValueError, match="empty"):
        list(stream_generate(model, draft, tok, "", max_tokens=4, block_size="draft"))
    with pytest.raises(ValueError, match=r"100 tokens but .* context window of 64"):
        small, tok2 = tiny_target("llama", max_position_embeddings=64)
        list(stream_generate(small, random_draft(small), tok2, list(range(100)), max_tokens=4, block_size="draft"))
    with pytest.raises(ValueError, match="block size takes 'auto'"):
        list(stream_generate(model, draft, tok, "hi", block_size=0))
    with pytest.raises(ValueError, match="block size takes 'auto'"):
        list(stream_generate(model, draft, tok, "hi", block_size="wide"))


def test_generation_goes_past_the_context_window_as_mlx_lm():
    """mlx-lm decodes on past `max_position_embeddings`, and so does the library (the CLI and the
    server stop there); `tests/test_position_limit.py` checks the tokens at every width."""
    model, tok = tiny_target("qwen3", max_position_embeddings=48)
    prompt = list(range(40))
    out = [t for r in stream_generate(model, random_draft(model), tok, prompt, max_tokens=20, block_size="draft")
           for t in r.tokens]
    ref = greedy_reference(model, prompt, 20, stop_ids=[EOS_ID])
    assert len(ref) > 8 and out == ref


def test_interrupted_generation_leaves_cache_usable():
    """Abandoning a stream mid-answer (Ctrl-C in a client) must not corrupt the next turn."""
    model, tok = tiny_target("qwen3_5", seed=6)
    draft = random_draft(model, block_size=4)
    cache = make_prompt_cache(model, draft)
    stream = stream_generate(model, draft, tok, list(range(60, 90)), max_tokens=30, prompt_cache=cache, block_size="draft")
    next(stream), next(stream)
    stream.close()
    prompt = list(range(60, 90)) + [7, 8]
    out = [t for r in stream_generate(model, draft, tok, prompt, max_tokens=6, prompt_cache=cache, block_size="draft") for t in r.tokens]
    assert out == greedy_reference(model, prompt, 6, stop_ids=[EOS_ID])


def test_profile_times_every_cycle_and_leaves_tokens_alone():
    model, tok = tiny_target("qwen3_5", seed=7)
    draft = random_draft(model, block_size=4, seed=1)
    prompt = list(range(30, 50))
    plain = list(stream_generate(model, draft, tok, prompt, max_tokens=9, stop_token_ids=[], block_size="draft"))
    profiled = list(stream_generate(model, draft, tok, prompt, max_tokens=9, stop_token_ids=[], profile=True, block_size="draft"))
    assert [r.tokens for r in profiled] == [r.tokens for r in plain]
    assert all(r.cycle_times is None for r in plain)
    assert profiled[0].cycle_times is None  # the prefill token
    for r in profiled[1:]:
        assert set(r.cycle_times) == {"draft", "verify", "rollback", "other"}
        assert all(t >= 0 for t in r.cycle_times.values()) and r.cycle_times["verify"] > 0


def test_plain_decoding_runs_no_draft():
    """baseline=True, and draft=None without copies, decode with the target alone, one token per
    cycle (draft=None with copies: tests/test_copies_without_draft.py)."""
    model, tok = tiny_target("llama", seed=2)
    prompt = list(range(10, 25))
    ref = greedy_reference(model, prompt, 8)
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: 10**9)
    for d, kw in ((draft, dict(baseline=True)), (None, dict(baseline=True)), (None, dict(copy_proposals=False))):
        rs = list(stream_generate(model, d, tok, prompt, max_tokens=8, stop_token_ids=[], **kw))
        assert [t for r in rs for t in r.tokens] == ref
        assert [r.verify_width for r in rs[1:]] == [1] * 7 and rs[-1].accept_lengths == [0] * 7
    assert draft.cycle == 0


def test_each_response_keeps_the_statistics_of_its_own_step():
    """A response's accept lengths and proposal counts are those up to its step, whatever comes
    after (a response holds the answer's list and its length then, and reads make new lists)."""
    model, tok = tiny_target("llama", seed=2)
    prompt = list(range(10, 25))
    ref = greedy_reference(model, prompt, 24)
    right = [c % 4 for c in range(40)]  # accept lengths 0, 1, 2, 3, 0, ...
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: right[c], block_size=4)
    rs = list(stream_generate(model, draft, tok, prompt, max_tokens=24, stop_token_ids=[], block_size="draft"))
    assert [t for r in rs for t in r.tokens] == ref
    assert rs[0].accept_lengths == [] and rs[0].proposal_counts == {}
    for i, r in enumerate(rs[1:], 1):
        assert r.accept_lengths == [q.accept_length for q in rs[1 : i + 1]]
        assert r.proposal_counts == {"draft": [i, sum(len(q.tokens) for q in rs[1 : i + 1])]}
        assert r.tau == pytest.approx(sum(a + 1 for a in r.accept_lengths) / i)
    # what a caller does with a response's statistics changes no other response, nor the answer's
    rs, cycles = [], []
    for r in stream_generate(model, draft, tok, prompt, max_tokens=24, stop_token_ids=[], block_size=4):
        cycles.append(r.proposal_counts.get("draft", [0, 0])[0])
        r.accept_lengths.append(99)  # (a new list each read)
        r.proposal_counts.setdefault("draft", [0, 0])[0] = 99
        rs.append(r)
    assert all(99 not in r.accept_lengths for r in rs) and cycles == list(range(len(rs)))


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_cpu_transposed_head_gives_the_models_own_logits(arch):
    """The CPU's transposed copy of a dense head (tied embedding or lm_head, Gemma's
    soft-capping after it): the model's own logits to float32 rounding, the same argmax;
    one copy per weight for every Target of the model, gone with the weight."""
    import gc

    import mlx.core as mx
    import numpy as np

    from dflash_mlx.models import layout

    model, _ = tiny_target(arch, seed=4)
    target = Target(model)
    ids = mx.array([[3, 17, 5, 9, 22, 1]])
    want = model(ids)  # mlx-lm's forward: its own head
    h, _, _ = target.forward(ids, None)
    got = target.logits(h)
    layer = target._lm_head if target._lm_head is not None else target.embed_tokens
    assert target.vocab._transposed_head(layer) is not None  # the tests run on the CPU backend
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    assert mx.array_equal(mx.argmax(got, -1), mx.argmax(want, -1))
    assert Target(model).vocab._transposed_head(layer) is target.vocab._transposed_head(layer)
    n = len(layout._TRANSPOSED)
    del model, target, layer, want, got, h
    gc.collect()
    Target(tiny_target("llama", seed=5)[0]).logits(mx.zeros((1, 1, 64)))  # prunes dead entries
    assert len(layout._TRANSPOSED) <= n


def test_head_follows_a_weight_loaded_after_decoding():
    """The head keeps the product it resolved for a weight (host work a step): weights loaded into the
    model afterwards (new values, a new array) give the new weight's logits, not the old copy's."""
    import mlx.core as mx
    import numpy as np

    model, _ = tiny_target("llama", seed=4)
    target = Target(model)
    layer = target._lm_head if target._lm_head is not None else target.embed_tokens
    h = mx.random.normal((1, 2, target.hidden_size), key=mx.random.key(1))
    before = target.logits(h)
    np.testing.assert_allclose(np.array(before), np.array(h @ layer.weight.T), rtol=1e-5, atol=1e-5)
    assert mx.array_equal(target.logits(h), before)  # (the kept product)
    new_weight = layer.weight[::-1] * 0.5  # other values, same shape
    from mlx.utils import tree_flatten

    name = next(n for n, w in tree_flatten(model.parameters()) if w is layer.weight)
    model.load_weights([(name, new_weight)], strict=False)
    assert layer.weight is not None and mx.array_equal(layer.weight, new_weight)
    np.testing.assert_allclose(np.array(target.logits(h)), np.array(h @ new_weight.T), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.array(target.logits(h)), np.array(before))

def test_default_width_is_auto_in_the_library_as_in_every_front_end():
    """`stream_generate`/`generate` without `block_size` run the adaptive width (the shared
    policy of the model/draft pair learns from the call); "draft" is the draft's own block
    size every cycle and leaves the policy alone."""
    import inspect

    from dflash_mlx.policy.sizer import forget_sizers, sizer_for
    from dflash_mlx.options import GenerationOptions

    assert inspect.signature(stream_generate).parameters["block_size"].default == "auto"
    assert inspect.signature(generate).parameters.get("block_size") is None  # it passes **kwargs on
    assert GenerationOptions().block_size == "auto"
    model, tok = tiny_target("llama", seed=3)
    prompt = list(range(20, 40))
    reference = prompt + greedy_reference(model, prompt, 40, stop_ids=[])
    draft = ScriptedDraft(Target(model), reference, wrong_from=lambda c: 0, block_size=16)

    def widths(**kwargs):
        rs = list(stream_generate(model, draft, tok, prompt, max_tokens=40, stop_token_ids=[], **kwargs))
        assert [t for r in rs for t in r.tokens] == reference[len(prompt):]
        # copy cycles (chains and trees) teach the copy record
        return [r.verify_width for r in rs[1:] if r.proposal not in ("copy", "copy_tree")]

    forget_sizers()
    policy = sizer_for(model, draft)
    default = widths()
    learned = policy.cycle
    assert learned == len(default) and default[0] < 16, default  # the policy's first, exploring width
    assert set(widths(block_size="draft")[:24]) == {16}  # the last cycles are cut by the budget
    assert policy.cycle == learned
    assert generate(model, draft, tok, prompt, max_tokens=40, stop_token_ids=[]) == \
        generate(model, None, tok, prompt, max_tokens=40, stop_token_ids=[])
    assert policy.cycle > learned
