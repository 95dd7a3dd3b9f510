"""PromptCache.reuse: KV trim, and snapshots for caches that cannot be trimmed (Gated DeltaNet)."""

import pytest

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.testing.targets import EOS_ID, greedy_reference, tiny_target


def run(model, draft, tok, prompt, cache, max_tokens=8, snapshot_after_prompt=False):
    """(tokens, prefill_tokens) of one engine call on `cache`."""
    out, prefill = [], None
    for r in stream_generate(model, draft, tok, prompt, max_tokens=max_tokens, prompt_cache=cache, block_size="draft"):
        if prefill is None:
            prefill = r.prefill_tokens
            if snapshot_after_prompt:
                assert cache.snapshot()
        out.extend(r.tokens)
    return out, prefill


def exact(model, prompt, out, max_tokens=8):
    assert out == greedy_reference(model, prompt, max_tokens, stop_ids=[EOS_ID])[: len(out)]
    assert len(out) == max_tokens or out[-1] == EOS_ID


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_interleaved_conversations_come_back_to_their_snapshot(arch):
    model, tok = tiny_target(arch, seed=6)
    draft = random_draft(model, block_size=4)
    cache = make_prompt_cache(model, draft, max_snapshots=4)
    a1, b1 = list(range(30, 60)), list(range(120, 150))
    out_a1, _ = run(model, draft, tok, a1, cache)
    out_b1, _ = run(model, draft, tok, b1, cache)  # a different conversation replaces the live caches
    a2 = a1 + out_a1 + list(range(200, 210))
    out_a2, prefill = run(model, draft, tok, a2, cache)
    # everything conversation A's caches held comes back: the last answer token + the new turn run
    assert prefill == 1 + 10
    exact(model, a2, out_a2)
    b2 = b1 + out_b1 + list(range(210, 216))
    out_b2, prefill = run(model, draft, tok, b2, cache)  # B was put aside when A came back
    assert prefill == 1 + 6
    exact(model, b2, out_b2)


def test_without_snapshots_an_interleaved_hybrid_conversation_prefills_again():
    model, tok = tiny_target("qwen3_5", seed=6)
    draft = random_draft(model, block_size=4)
    cache = make_prompt_cache(model, draft)  # max_snapshots=0: the plain multi-turn cache
    a1 = list(range(30, 60))
    out_a1, _ = run(model, draft, tok, a1, cache)
    run(model, draft, tok, list(range(120, 150)), cache)
    a2 = a1 + out_a1 + list(range(200, 210))
    out_a2, prefill = run(model, draft, tok, a2, cache)
    assert prefill == len(a2)
    exact(model, a2, out_a2)


def test_hybrid_target_restores_the_end_of_prompt_snapshot_when_the_answer_was_edited():
    # A chat front end may send back a different answer (cut at a stop string,
    # re-rendered by the template): recurrent state cannot be trimmed back into
    # the answer, but the snapshot taken at the end of the prompt still serves.
    model, tok = tiny_target("qwen3_5", seed=7)
    draft = random_draft(model, block_size=4)
    cache = make_prompt_cache(model, draft, max_snapshots=2)
    p1 = list(range(40, 80))
    run(model, draft, tok, p1, cache, snapshot_after_prompt=True)
    p2 = p1 + [65, 66, 67] + list(range(90, 100))
    out, prefill = run(model, draft, tok, p2, cache)
    assert prefill == len(p2) - len(p1)
    exact(model, p2, out)
    # the snapshot was copied, not consumed: another continuation of p1 reuses it too
    p3 = p1 + list(range(150, 160))
    out3, prefill3 = run(model, draft, tok, p3, cache)
    assert prefill3 == 10
    exact(model, p3, out3)


def test_attention_cache_trims_to_the_shared_prefix_and_keeps_the_tail_as_a_snapshot():
    model, tok = tiny_target("qwen3", seed=8)
    draft = random_draft(model, block_size=4)
    cache = make_prompt_cache(model, draft, max_snapshots=2)
    a1 = list(range(30, 70))
    out_a1, _ = run(model, draft, tok, a1, cache)
    edited = a1[:25] + [1, 2, 3]
    out_e, prefill = run(model, draft, tok, edited, cache)
    assert prefill == 3
    exact(model, edited, out_e)
    a2 = a1 + out_a1 + [5, 6]
    out_a2, prefill2 = run(model, draft, tok, a2, cache)
    assert prefill2 == 1 + 2  # the untrimmed tail came back from the snapshot taken before the trim
    exact(model, a2, out_a2)


def test_snapshots_are_bounded_least_recently_used_first():
    model, tok = tiny_target("qwen3_5", seed=9)
    draft = random_draft(model, block_size=4)
    cache = make_prompt_cache(model, draft, max_snapshots=2)
    prompts = [list(range(s, s + 20)) for s in (10, 50, 90, 130)]
    for p in prompts:
        run(model, draft, tok, p, cache, max_tokens=3)
    assert len(cache.snapshots) == 2
    kept = [k[:20] for k in cache.snapshots]
    assert kept == [tuple(prompts[1]), tuple(prompts[2])]  # the oldest went first; the live one is not a snapshot
    _, prefill = run(model, draft, tok, prompts[0] + [7], cache, max_tokens=3)
    assert prefill == 21  # evicted: nothing to reuse


def test_snapshots_are_bounded_in_bytes_least_recently_used_first():
    from dflash_mlx.engine.prompt_cache import nbytes

    model, tok = tiny_target("qwen3_5", seed=9)
    draft = random_draft(model, block_size=4)
    probe = make_prompt_cache(model, draft, max_snapshots=8)
    prompts = [list(range(s, s + 20)) for s in (10, 50, 90, 130)]
    run(model, draft, tok, prompts[0], probe, max_tokens=3)
    run(model, draft, tok, prompts[1], probe, max_tokens=3)  # the first conversation is now a snapshot
    (one,) = probe.snapshots.values()
    # what a snapshot holds: the target's caches (KV buffers, recurrent state), the draft's context, pending features
    assert one.nbytes == nbytes(one.target_cache) + nbytes(one.draft_cache) + nbytes(one.pending) > 0
    assert nbytes(one.target_cache) == sum(c.nbytes for c in one.target_cache)  # mlx-lm's own count
    cache = make_prompt_cache(model, draft, max_snapshots=8, max_bytes=int(2.5 * one.nbytes))
    for p in prompts:
        run(model, draft, tok, p, cache, max_tokens=3)
    assert [k[:20] for k in cache.snapshots] == [tuple(prompts[1]), tuple(prompts[2])]  # two fit, the oldest went
    assert cache.snapshot_bytes <= cache.max_bytes and cache.stats()["snapshot_bytes"] == cache.snapshot_bytes
    tiny = make_prompt_cache(model, draft, max_snapshots=8, max_bytes=one.nbytes - 1)
    for p in prompts[:2]:
        run(model, draft, tok, p, tiny, max_tokens=3)
    assert not tiny.snapshots  # larger than the bound: not kept


def test_snapshot_is_refused_while_the_caches_are_mid_cycle():
    model, _ = tiny_target("qwen3_5", seed=9)
    cache = make_prompt_cache(model, None, max_snapshots=2)
    assert not cache.snapshot()  # empty: nothing worth keeping
    cache.tokens, cache.valid = [1, 2, 3], False
    assert not cache.snapshot()
