"""Copy proposals: the index over the context, the record and policy that decide when a
cycle verifies a copy instead of the draft's block, and exactness through the engine."""

import random

import numpy as np
import pytest

import dflash_mlx  # noqa: F401
from dflash_mlx import stream_generate
from dflash_mlx.policy.sizer import BlockSizer, forget_sizers
from dflash_mlx.policy.copies import CopyPolicy
from dflash_mlx.policy.copy_trees import CopyTreePolicy
from dflash_mlx.speculation.copies import MAX_NGRAM, ContextIndex, CopyRecord
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.generate import make_prompt_cache
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import EOS_ID, ScriptedDraft, chain_target, greedy_reference, tiny_target
from dflash_mlx.testing.archs import build

# -- the index ---------------------------------------------------------------------


def brute_force_match(seq, max_tokens):
    """The longest suffix (up to MAX_NGRAM) that occurred earlier, its latest earlier end."""
    for n in range(min(MAX_NGRAM, len(seq) - 1), 0, -1):
        suffix = seq[-n:]
        ends = [e for e in range(n - 1, len(seq) - 1) if seq[e - n + 1 : e + 1] == suffix]
        if ends:
            start = ends[-1] + 1
            period = len(seq) - start
            return n, start, [seq[start + j] if start + j < len(seq) else seq[start + j % period]
                              for j in range(max_tokens)]
    return None


def test_index_finds_the_longest_latest_match_as_brute_force_does():
    rng = random.Random(0)
    for trial in range(200):
        seq = [rng.randrange(0, 4 if trial % 2 else 12) for _ in range(rng.randrange(1, 60))]
        index = ContextIndex()
        for i in range(0, len(seq), 7):  # built in pieces, as the engine extends it
            index.extend(seq[i : i + 7])
        m = index.match(6)
        expected = brute_force_match(seq, 6)
        assert (None if m is None else (m.length, m.start, m.continuation)) == expected, seq


def test_a_repeat_continues_with_its_period_past_the_end():
    m = ContextIndex([5, 6, 7, 5, 6, 7, 5]).match(6)
    assert m.length == 4 and m.continuation == [6, 7, 5, 6, 7, 5]
    assert ContextIndex([3]).match(4) is None
    assert ContextIndex([1, 2, 3]).follows([1, 2, 3, 4]) and not ContextIndex([1, 2]).follows([1, 3])


# -- the record and the policy ----------------------------------------------------------


def test_record_learns_per_match_length_and_depth():
    record = CopyRecord(max_depth=8)
    for _ in range(40):
        record.update(length=8, proposed=8, accepted=8)  # long matches: always right
        record.update(length=1, proposed=4, accepted=0)  # one-token matches: never
    assert record.expected_tokens(8, 8) > 6.5
    assert record.expected_tokens(1, 4) < 0.1


def _timed_sizer(verify=lambda w: 1.0 + 0.03 * w, draft=0.2, alpha=0.3):
    """A BlockSizer that has measured width 1 and drafted widths, with a draft that is
    right at each depth with probability `alpha`."""
    sizer = BlockSizer(16)
    rng = random.Random(1)
    for c in range(120):
        w = sizer.choose(10**6)
        a = 0
        while a < w - 1 and rng.random() < alpha:
            a += 1
        sizer.update(w, a, verify(w) + (draft if w > 1 else 0.0))
    return sizer


def test_policy_copies_where_the_record_says_copies_pay_and_not_where_they_fail():
    sizer = _timed_sizer()
    policy = CopyPolicy(sizer, max_length=15)
    good = ContextIndex(list(range(20)) * 2).match(15)  # a long match
    assert good.length == MAX_NGRAM
    for _ in range(10):
        policy.update(good.length, 8, 8, seconds=1.0 + 0.03 * 9)
    assert policy.choose(good, 100, sizer.choose(100)) >= 8
    bad = ContextIndex([1, 2, 3, 4, 9, 9, 4]).match(15)  # a one-token match
    assert bad.length == 1
    for _ in range(10):
        policy.update(bad.length, 4, 0, seconds=1.0 + 0.03 * 5)
    assert policy.choose(bad, 100, sizer.choose(100)) == 0
    assert policy.choose(good, 1, 1) == 0  # one token left: nothing to copy into
    assert policy.choose(None, 100, 4) == 0


def test_a_copy_is_never_priced_above_a_drafted_cycle_of_its_width():
    sizer = _timed_sizer()
    policy = CopyPolicy(sizer)
    for w in (2, 4, 8, 16):
        assert policy.cycle_time(w) <= sizer.cycle_time(w)


def test_copy_times_are_kept_per_context_range_as_the_sizers_are():
    """Copy cycles timed on a short context do not price copies in a long one: there they
    fall back on the sizer's own times for that range (none yet: no copy is priced)."""
    sizer = _timed_sizer()
    policy = CopyPolicy(sizer)
    good = ContextIndex(list(range(20)) * 2).match(15)
    for _ in range(10):
        policy.update(good.length, 8, 8, seconds=0.5)
    assert policy.cycle_time(9) == 0.5
    sizer.at_context(4000)
    assert policy.times == {} and sizer.times == {}
    assert policy.cycle_time(9) is None and policy.choose(good, 100, 1) == 0
    sizer.at_context(100)
    assert policy.cycle_time(9) == 0.5 and policy.choose(good, 100, sizer.choose(100)) >= 8


# -- through the engine -----------------------------------------------------------------


def decode(model, draft, tok, prompt, **kw):
    tokens, responses = [], []
    for r in stream_generate(model, draft, tok, prompt, **kw):
        tokens += r.tokens
        responses.append(r)
    return tokens, responses


def test_copies_commit_repeated_text_exactly_and_many_tokens_per_forward():
    model, tok = chain_target("Quick-brown,fx")  # greedy repeats a 14-token text
    prompt = tok.encode("Quick", add_special_tokens=False)
    ref = greedy_reference(model, prompt, 120)
    draft = random_draft(model, num_layers=1, block_size=16, seed=0)  # never right
    forget_sizers()
    out, responses = decode(model, draft, tok, prompt, max_tokens=120, stop_token_ids=[])
    assert out == ref
    counts = responses[-1].proposal_counts
    assert counts["copy"][1] >= 60  # most of the answer came from copies
    assert responses[-1].tau > 2.0  # (3-5 on a quiet machine; the policy prices copies by measured time)
    forget_sizers()
    out, responses = decode(model, draft, tok, prompt, max_tokens=120, stop_token_ids=[], copy_proposals=False)
    assert out == ref and "copy" not in responses[-1].proposal_counts and responses[-1].tau < 1.2


@pytest.mark.parametrize("max_tokens", [2, 9, 23, 40])
def test_max_tokens_and_a_stop_id_inside_a_copy(always_copy, max_tokens):
    model, tok = chain_target("Quick-brown,fx")
    prompt = tok.encode("Quick-brown,fx", add_special_tokens=False)  # copies from the first cycle on
    ref = greedy_reference(model, prompt, 40)
    draft = random_draft(model, num_layers=1, block_size=16, seed=0)
    out, responses = decode(model, draft, tok, prompt, max_tokens=max_tokens, stop_token_ids=[])
    assert out == ref[:max_tokens] and responses[-1].finish_reason == "length"
    stop = tok.encode(",", add_special_tokens=False)[0]
    out, responses = decode(model, draft, tok, prompt, max_tokens=max_tokens, stop_token_ids=[stop])
    expected = ref[: ref.index(stop) + 1] if stop in ref[:max_tokens] else ref[:max_tokens]
    assert out == expected
    if max_tokens > 2:  # one token left after the first: nothing to copy into
        assert responses[1].proposal == "copy"


@pytest.mark.parametrize("key", ["qwen3_moe", "qwen3_next", "gpt_oss", "kimi_k25", "nemotron_h", "falcon_h1",
                                 "glm_moe_dsa"])
def test_copies_of_every_length_roll_every_cache_kind_back_exactly(monkeypatch, key):
    """Every cycle verifies a copy that is right for a random number of tokens (the index's
    match replaced by the known answer, spoilt after k tokens): every cache kind is rolled
    back after copies of every length; the output is still mlx-lm's own greedy decode."""
    from dflash_mlx.speculation.copies import CopyMatch

    model = build(key)
    rng = random.Random(key)
    prompt = [rng.randrange(0, 256) for _ in range(40)]
    ref = greedy_reference(model, prompt, 30, stop_ids=(EOS_ID,))
    answer = prompt + ref
    right_for = [rng.randrange(0, 8) for _ in range(100)]
    proposed = []

    def match(index, max_tokens):
        start = len(index.tokens)  # the answer's next position
        k = right_for[len(proposed)]
        continuation = [(t if j < k else (t + 1) % 256) for j, t in
                        enumerate((answer + [0] * max_tokens)[start : start + max_tokens])]
        proposed.append(k)
        return CopyMatch(MAX_NGRAM, start, continuation)

    monkeypatch.setattr(ContextIndex, "match", match)
    monkeypatch.setattr(CopyPolicy, "choose", lambda self, m, remaining, w: min(self.max_length, remaining - 1))
    monkeypatch.setattr(CopyTreePolicy, "plan", lambda self, *args: None)
    draft = random_draft(model, num_layers=1, block_size=16, seed=3)
    out, responses = decode(model, draft, _tok(), prompt, max_tokens=30, stop_token_ids=[])
    assert out == ref
    accepts = responses[-1].accept_lengths
    assert responses[-1].proposal_counts["copy"][0] >= len(accepts) - 1  # the last token alone: a plain step
    assert accepts[:-1] == [min(k, 15) for k in proposed[: len(accepts) - 1]]
    assert len(set(accepts)) >= 3


def _tok():
    from dflash_mlx.testing.targets import byte_tokenizer

    return byte_tokenizer()


def test_a_chat_turn_copies_from_the_earlier_turn(always_copy):
    """The index spans the conversation the prompt cache holds: the second turn's answer,
    a repeat of the first's, is copied. (Copies forced wherever a match exists: whether the
    measured-cost policy picks them is timing, tested apart; here, that the matches are there.)"""
    model, tok = chain_target("Quick-brown,fx")
    draft = random_draft(model, num_layers=1, block_size=16, seed=0)
    cache = make_prompt_cache(model, draft)
    prompt = tok.encode("Q", add_special_tokens=False)
    forget_sizers()
    first, _ = decode(model, draft, tok, prompt, max_tokens=30, stop_token_ids=[], prompt_cache=cache)
    index = cache.copy_index
    turn2 = prompt + first + tok.encode("Q", add_special_tokens=False)
    second, responses = decode(model, draft, tok, turn2, max_tokens=30, stop_token_ids=[], prompt_cache=cache)
    assert second == greedy_reference(model, turn2, 30)
    assert cache.copy_index is index  # extended, not rebuilt
    assert responses[-1].proposal_counts.get("copy", [0, 0])[1] >= 20


def test_scripted_draft_and_copies_together_stay_exact():
    """A draft right for a random number of tokens, copies where the policy picks them."""
    model, tok = tiny_target("qwen3_5", seed=1)
    rng = random.Random(2)
    span = [rng.randrange(0, 256) for _ in range(10)]
    prompt = span * 3
    ref = greedy_reference(model, prompt, 40, stop_ids=(EOS_ID,))
    wrong = [rng.randrange(0, 16) for _ in range(100)]
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: wrong[c], block_size=16)
    out, _ = decode(model, draft, tok, prompt, max_tokens=40, stop_token_ids=[])
    assert out == ref


def test_copies_at_temperature_keep_the_targets_distribution(always_copy):
    """A copy is a one-hot proposal: the rejection step keeps the target's distribution
    (chi-square against the exact joint of the first three tokens, vocabulary 4)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_sampling import chi_square, encode, exact_first_tokens

    model, tok = tiny_target("llama", seed=1, vocab_size=4)
    draft = random_draft(model, block_size=4, seed=4)
    prompt = [1, 2, 3, 0, 1, 2, 3, 0, 1]  # the suffix [.., 0, 1] occurred: copies from cycle one
    outs, kinds = [], set()
    for seed in range(200):
        forget_sizers()
        rs = list(stream_generate(model, draft, tok, prompt, max_tokens=3, seed=seed, temperature=0.8,
                                  stop_token_ids=[]))
        outs.append([t for r in rs for t in r.tokens][:3])
        kinds |= {r.proposal for r in rs[1:]}
    assert "copy" in kinds
    exact = exact_first_tokens(model, prompt, 3, temperature=0.8)
    _, pval = chi_square(encode(np.array(outs), 4), exact)
    assert pval > 1e-3
