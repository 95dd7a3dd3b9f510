"""Copy trees: several continuations of the context's suffix (the context's own index and
earlier requests') verified as one token tree, priced apart, exact greedy and at T > 0."""

import random

import numpy as np
import pytest

import dflash_mlx  # noqa: F401
from dflash_mlx import make_suffix_index, stream_generate
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.policy.copies import CopyPolicy
from dflash_mlx.policy.copy_trees import CopyTreePolicy
from dflash_mlx.policy.sizer import BlockSizer, forget_sizers
from dflash_mlx.speculation.copies import MAX_NGRAM, MAX_STEPS, ContextIndex, CopyMatch
from dflash_mlx.speculation.copy_tree import plan_copy_tree, walk_outcome
from dflash_mlx.speculation.suffix_index import SuffixIndex
from dflash_mlx.testing.targets import EOS_ID, byte_tokenizer, chain_target, greedy_reference, tiny_target

# -- the indexes: several continuations -------------------------------------------------------


def brute_force_matches(seq, max_tokens, k):
    """Longest suffix first, its earlier ends most recent first (MAX_STEPS of each), distinct
    continuations (a repeat continues with its period past the end)."""
    out = []
    for n in range(min(MAX_NGRAM, len(seq) - 1), 0, -1):
        ends = [e for e in range(n - 1, len(seq) - 1) if seq[e - n + 1 : e + 1] == seq[-n:]]
        for e in reversed(ends[-MAX_STEPS:]):
            start, period = e + 1, len(seq) - e - 1
            cont = [seq[start + j] if start + j < len(seq) else seq[start + j % period] for j in range(max_tokens)]
            if cont not in [c for _, c in out]:
                out.append((n, cont))
            if len(out) == k:
                return out
    return out


def test_the_context_index_gives_several_continuations_as_brute_force_does():
    rng = random.Random(3)
    for trial in range(150):
        seq = [rng.randrange(0, 3 if trial % 2 else 8) for _ in range(rng.randrange(1, 50))]
        index = ContextIndex()
        for i in range(0, len(seq), 5):
            index.extend(seq[i : i + 5])
        got = [(m.length, m.continuation) for m in index.matches(5, 4)]
        assert got == brute_force_matches(seq, 5, 4), seq
    # the same 2-gram went on with 7, then 9: both, the latest first
    m = ContextIndex([1, 2, 7, 0, 1, 2, 9, 0, 1, 2]).matches(2, 4)
    assert [x.continuation for x in m[:2]] == [[9, 0], [7, 0]]


def test_the_suffix_index_gives_what_followed_in_several_requests_latest_first():
    index = SuffixIndex()
    index.add([5, 1, 2, 3, 4])
    index.add([6, 1, 2, 8, 9])
    index.add([7, 1, 2, 3, 4])  # same as the first: one candidate
    found = index.matches([0, 1, 2], 3, 4)
    assert [m.continuation for m in found][:2] == [[3, 4], [8, 9]] and all(m.shared for m in found)
    assert index.match([0, 1, 2], 3).continuation == [3, 4]
    small = SuffixIndex(60 * 1100)  # the oldest request goes: its continuation with it
    for d in ([5, 1, 2, 3, 4] + list(range(100, 130)), [6, 1, 2, 8, 9] + list(range(200, 230))):
        small.add(d)
    assert [m.continuation for m in small.matches([1, 2], 2, 4)] == [[8, 9]]


# -- the tree --------------------------------------------------------------------------------


def test_a_copy_tree_merges_shared_prefixes_and_takes_the_likeliest_nodes():
    alphas = [[0.5] * 8, [0.9] * 8, [0.9] * 8]
    plan = plan_copy_tree(99, [[1, 2, 3, 4], [1, 2, 5, 6], [7, 8]], alphas, [0.6] * 8, nodes=6)
    tree = plan.tree
    assert tree.tokens[0] == 99 and len(tree) == 7
    assert tree.tokens.count(1) == 1 and tree.tokens.count(2) == 1  # 1, 2 once
    children = tree.children()
    node2 = children[children[0][1]][2]
    assert list(children[node2]) == [3, 5]  # the first candidate's token first, then the other
    assert all(plan.reach[i] <= plan.reach[tree.parents[i]] for i in range(1, len(tree)))
    assert plan.branches() and abs(plan.expected_tokens - sum(plan.reach[1:])) < 1e-9
    # the walk: 1, 2 accepted, 3 rejected, 5 accepted (a try of the other candidate that worked)
    path = [0, children[0][1], node2, children[node2][5]]
    accepted, tried, tries = walk_outcome(plan, path)
    assert (accepted, tried) == (2, 3) and tries == [(2, True)]
    # rejected at the root: 1 tried (the first candidate), 7 tried after it and rejected
    assert walk_outcome(plan, [0]) == (0, 1, [(0, False)])


def test_a_kind_that_keeps_failing_stops_being_proposed_and_chain_copies_go_on():
    """At the prior a tree of two candidates pays against a plain step and the chain copy; once
    the other candidates' tokens keep being rejected (the copy tree's own record) the tree is
    worth no more than the chain it holds and is not proposed, while the chain copy still is."""
    sizer = BlockSizer(1)
    for _ in range(3):
        sizer.update(1, 0, 1.0)
    for w in range(2, 17):
        for _ in range(2):
            sizer.costs.record(w, 1.0 + 0.02 * w)
    copies = CopyPolicy(sizer, max_length=15)
    policy = CopyTreePolicy(copies)
    index = ContextIndex([1, 2, 7, 8, 0, 1, 2, 9, 5, 0, 1, 2])  # "1 2" went on with 7, then with 9
    matches = index.matches(15, 4)
    chosen, n = copies.best([index.match(15)], 100, 1)
    plan = policy.plan(2, matches, chosen, n, 100, 1)
    assert plan is not None and plan.branches() and plan.primary.continuation[0] == 9
    for _ in range(40):
        policy.rescue.update([(0, False)])
        copies.update(chosen.length, 8, 8, 1.0 + 0.02 * 9)  # the latest continuation is right
    assert policy.plan(2, matches, chosen, n, 100, 1) is None
    assert copies.best([index.match(15)], 100, 1)[1] >= 8


def test_copy_tree_cycles_teach_the_chain_record_and_the_rescue_rate():
    copies = CopyPolicy(BlockSizer(1), max_length=15)
    policy = CopyTreePolicy(copies)
    first, second = CopyMatch(2, 0, [1, 2, 3]), CopyMatch(2, 5, [4, 5])
    plan = policy._plan(0, [first, second], 5)
    plan.primary = first
    children = plan.tree.children()
    before = copies.record.alpha(2)[0], policy.rescue.rates()[0]
    policy.update(plan, [0, children[0][4], children[children[0][4]][5]], 0.5)  # down the second
    assert copies.record.alpha(2)[0] < before[0] and policy.rescue.rates()[0] > before[1]
    assert copies.sizer.costs.samples.get(len(plan.tree)) == 1  # timed as a copy of its rows


# -- through the engine ------------------------------------------------------------------------


def decode(model, draft, prompt, tok=None, **kw):
    tokens, responses = [], []
    for r in stream_generate(model, draft, tok or byte_tokenizer(), prompt, stop_token_ids=[], **kw):
        tokens += r.tokens
        responses.append(r)
    return tokens, responses


# the tiny llama's sliding layers (a rotating cache) do not take trees: these are full attention
PLAIN_ATTENTION = {"llama": dict(layer_types=None, sliding_window=None)}


@pytest.fixture
def always_tree(monkeypatch):
    """Every cycle whose candidates branch verifies a copy tree, all of it."""
    monkeypatch.setattr(CopyTreePolicy, "nodes_that_pay", lambda self, full, *args: len(full.tree) - 1)


def test_a_copy_tree_commits_the_earlier_continuation_where_the_latest_is_wrong(always_tree):
    """The context holds "ab" followed by the target's own continuation early and by other
    tokens later: the tree's main branch (the latest) is rejected and the earlier one accepted."""
    text = "abcdefghij"
    model, tok = chain_target(text)  # greedy: the text over and over
    prompt = tok.encode(text + "QRabcXY" + "ab", add_special_tokens=False)
    ref = greedy_reference(model, prompt, 30)
    forget_sizers()
    out, responses = decode(model, None, prompt, tok, max_tokens=30)
    assert out == ref
    trees = [r for r in responses if r.proposal == "copy_tree"]
    assert trees and max(r.accept_length for r in trees) >= 8  # down the earlier branch
    assert responses[-1].proposal_counts["copy_tree"][1] >= 20


def known_candidates(answer, rng):
    """A `gather` that offers the known answer (the prompt and the target's greedy tokens)
    spoilt at random depths, and once in a while unspoilt, in random order."""
    def gather(self, index, shared):
        start = len(index.tokens)
        right = (answer + [0] * 20)[start : start + self.copies.max_length]
        found = []
        for _ in range(rng.randrange(2, 5)):
            k = rng.randrange(0, len(right) + 1)
            found.append(CopyMatch(rng.randrange(1, MAX_NGRAM + 1), start,
                                   [t if j < k else (t + 1 + rng.randrange(3)) % 256 for j, t in enumerate(right)]))
        return found
    return gather


@pytest.mark.parametrize("arch,with_draft", [("llama", False), ("qwen3", True)])
def test_copy_trees_of_every_shape_are_the_targets_greedy_decode(always_tree, monkeypatch, arch, with_draft):
    """Candidates right for a random number of tokens, branching at random depths: every
    cycle is a copy tree whose accepted path runs down any branch; the cache is compacted
    to that path and the answer is still mlx-lm's own greedy decode."""
    model, _ = tiny_target(arch, seed=4, **PLAIN_ATTENTION.get(arch, {}))
    rng = random.Random(arch)
    prompt = [rng.randrange(0, 256) for _ in range(24)]
    ref = greedy_reference(model, prompt, 40, stop_ids=(EOS_ID,))
    monkeypatch.setattr(CopyTreePolicy, "gather", known_candidates(prompt + ref, rng))
    monkeypatch.setattr(CopyPolicy, "choose", lambda self, m, remaining, w: 0)  # only the known candidates
    draft = random_draft(model, num_layers=1, block_size=8, seed=1) if with_draft else None
    forget_sizers()
    out, responses = decode(model, draft, prompt, max_tokens=40)
    assert out == ref
    trees = [r.accept_length for r in responses if r.proposal == "copy_tree"]
    assert len(trees) >= 4 and len(set(trees)) >= 3


def test_a_target_without_trees_copies_chains(always_tree, monkeypatch):
    """A hybrid (Gated DeltaNet) does not take trees: the same candidates are chain copies."""
    model, _ = tiny_target("qwen3_5", seed=4)
    rng = random.Random(5)
    prompt = [rng.randrange(0, 256) for _ in range(24)]
    monkeypatch.setattr(CopyPolicy, "choose", lambda self, m, remaining, w: 0 if m is None else min(4, remaining - 1))
    forget_sizers()
    out, responses = decode(model, None, prompt + prompt[:6], max_tokens=24)
    assert out == greedy_reference(model, prompt + prompt[:6], 24, stop_ids=(EOS_ID,))
    kinds = set(responses[-1].proposal_counts)
    assert "copy_tree" not in kinds and "copy" in kinds


def test_earlier_requests_give_a_tree_with_the_contexts_own_match(always_tree):
    """The context says "ab" goes on one way, an earlier request another: one tree holds both."""
    text = "abcdefghij"
    model, tok = chain_target(text)
    index = make_suffix_index(model)
    index.add(tok.encode("Zabcdefghij", add_special_tokens=False))  # what the target will say
    prompt = tok.encode("QRabcXYab", add_special_tokens=False)  # the context alone: a wrong "ab"
    forget_sizers()
    out, responses = decode(model, None, prompt, tok, max_tokens=12, suffix_index=index)
    assert out == greedy_reference(model, prompt, 12)
    assert "copy_tree" in responses[-1].proposal_counts


def test_copy_trees_at_temperature_keep_the_targets_distribution(always_tree):
    """Every node a fixed token: the walk's rejection step keeps the target's distribution
    (chi-square against the exact joint of the first three tokens, vocabulary 4)."""
    from test_sampling import chi_square, encode, exact_first_tokens

    model, tok = tiny_target("llama", seed=1, vocab_size=4, **PLAIN_ATTENTION["llama"])
    prompt = [1, 2, 3, 0, 1, 2, 0, 0, 1, 2]  # "1 2" went on with 3, then with 0: a tree from cycle one
    forget_sizers()  # the width policy's costs learnt by earlier tests in this process would steer it
    outs, kinds = [], set()
    for seed in range(200):
        rs = list(stream_generate(model, None, tok, prompt, max_tokens=4, seed=seed, temperature=0.8,
                                  stop_token_ids=[]))
        outs.append([t for r in rs for t in r.tokens][:3])
        kinds |= {r.proposal for r in rs[1:]}
    assert "copy_tree" in kinds
    _, pval = chi_square(encode(np.array(outs), 4), exact_first_tokens(model, prompt, 3, temperature=0.8))
    assert pval > 1e-3
