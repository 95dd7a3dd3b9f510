"""Token trees: the best-first tree from the draft's top-k, the mask and positions handed to
mlx-lm's models, compaction of the kept path, the per-model check, the policy that picks trees
over chains, and exactness through the engine on every architecture that takes trees."""

import itertools
from functools import lru_cache

import dflash_mlx  # noqa: F401,I001  (before mlx.core: BLAS routing)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx import stream_generate
from dflash_mlx.models import rope_offsets
from dflash_mlx.models.target import tree_attention as ta
from dflash_mlx.policy import trees
from dflash_mlx.speculation import tree as tt
from dflash_mlx.policy.sizer import BlockSizer, forget_sizers
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import (EOS_ID, RankedDraft, byte_tokenizer, clean_case, greedy_reference,
                                tiny_target)
from dflash_mlx.testing.archs import FAMILY_ARCHS, MORE_ARCHS, build

# -- building the tree ------------------------------------------------------------------


def brute_force_best(top_logprobs: np.ndarray, nodes: int):
    """Every path (one rank per depth) scored by summed log-probability, the best `nodes`."""
    positions, k = top_logprobs.shape
    scored = []
    for depth in range(1, positions + 1):
        for ranks in itertools.product(range(k), repeat=depth):
            scored.append((sum(top_logprobs[d, r] for d, r in enumerate(ranks)), ranks))
    scored.sort(key=lambda x: -x[0])
    return {ranks for _, ranks in scored[:nodes]}


def ranks_of(tree: ta.TokenTree, top_ids: np.ndarray):
    """Each node's path as the rank chosen at each depth."""
    out = set()
    for node in range(1, len(tree)):
        path = []
        while node > 0:
            d = tree.depths[node] - 1
            path.append(int(np.where(top_ids[d] == tree.tokens[node])[0][0]))
            node = tree.parents[node]
        out.add(tuple(reversed(path)))
    return out


def test_tree_holds_the_best_nodes_by_summed_log_probability():
    rng = np.random.default_rng(0)
    for trial in range(30):
        positions, k = rng.integers(1, 5), rng.integers(1, 4)
        logits = rng.normal(size=(positions, 16)) * 2
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        top = np.argsort(-logp, axis=-1)[:, :k]
        top_logp = np.take_along_axis(logp, top, axis=-1)
        nodes = int(rng.integers(1, 12))
        tree = tt.build_tree(999, top, top_logp, nodes)
        assert len(tree) == 1 + min(nodes, sum(k ** d for d in range(1, positions + 1)))
        assert tree.tokens[0] == 999 and tree.parents[0] == -1
        # depth order, parents first, each node one deeper than its parent
        assert tree.depths == sorted(tree.depths)
        assert all(0 <= p < i and tree.depths[i] == tree.depths[p] + 1 for i, p in enumerate(tree.parents) if i)
        assert ranks_of(tree, top) == brute_force_best(top_logp, nodes), trial


def test_a_confident_draft_gives_its_chain_and_an_unsure_one_branches():
    ids = np.array([[10, 11], [20, 21], [30, 31]])
    sure = np.log(np.array([[0.99, 0.01], [0.99, 0.01], [0.99, 0.01]]))
    assert tt.build_tree(1, ids, sure, 3).tokens == [1, 10, 20, 30]
    assert tt.build_tree(1, ids, sure, 3).is_chain()
    unsure = np.log(np.array([[0.5, 0.45], [0.9, 0.1], [0.9, 0.1]]))
    tree = tt.build_tree(1, ids, unsure, 3)
    assert tree.tokens == [1, 10, 11, 20] and tree.parents == [-1, 0, 0, 1] and not tree.is_chain()


def test_accept_walks_down_the_targets_own_choices():
    # root -> a(5) -> c(7);  root -> b(6) -> d(8)
    tree = ta.TokenTree([1, 5, 6, 7, 8], [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2])
    assert tt.accept_greedy(tree, [6, 0, 8, 0, 9]) == ([0, 2, 4], 9)  # b then d, bonus 9
    assert tt.accept_greedy(tree, [5, 3, 0, 0, 0]) == ([0, 1], 3)  # a, then no child 3
    assert tt.accept_greedy(tree, [4, 0, 0, 0, 0]) == ([0], 4)  # nothing


def test_mask_sees_the_context_and_the_ancestors_within_the_window():
    tree = ta.TokenTree([1, 5, 6, 7], [-1, 0, 0, 2], [0, 1, 1, 2])
    mask = np.array(ta.tree_mask(tree, 3))
    assert mask[:, :3].all()
    assert mask[:, 3:].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    windowed = np.array(ta.tree_mask(tree, 3, window=2))
    # node 3 sits at position 3 + 2 = 5: with a window of 2 it sees positions 4 (node 2) and 5
    assert windowed[3].tolist() == [0, 0, 0, 0, 0, 1, 1]


@pytest.mark.parametrize("array_offsets", [True, False])
def test_tree_rope_puts_each_node_at_its_depth(array_offsets, monkeypatch):
    rope = nn.RoPE(16, base=10000)
    tree = ta.TokenTree([1, 5, 6, 7, 8], [-1, 0, 0, 1, 3], [0, 1, 1, 2, 3])
    monkeypatch.setitem(rope_offsets._ARRAY_OFFSETS, nn.RoPE, array_offsets)
    x = mx.random.normal((1, 2, 5, 16), key=mx.random.key(1))
    got = ta.TreeRoPE(rope, tree)(x, offset=7)
    want = mx.concatenate([rope(x[:, :, i : i + 1], offset=7 + d) for i, d in enumerate(tree.depths)], axis=2)
    assert mx.allclose(got, want, atol=1e-5).item()


def test_a_rope_that_cannot_take_offset_arrays_is_rotated_in_runs_of_equal_depth():
    class IntOnlyRoPE(nn.RoPE):  # sizes a table from the offset, as some scaled variants do
        def __call__(self, x, offset=0):
            return super().__call__(x, offset=int(offset))

    assert not rope_offsets._check(IntOnlyRoPE(16))
    assert rope_offsets._check(nn.RoPE(16))


# -- models: support, compaction ---------------------------------------------------------

TREE_ARCHS = ["qwen3_moe", "minimax", "kimi_k25", "qwen2", "phi3", "gemma", "gemma2", "olmo2", "granite",
              "cohere", "starcoder2", "internlm3", "smollm3", "mixtral", "olmoe", "qwen2_moe", "granitemoe", "phimoe",
              "deepseek_v3", "glm4_moe",
              "minicpm3", "glm4_moe_lite"]


@lru_cache(maxsize=None)
def model_for(key):
    return build(key)


def test_which_architectures_take_trees():
    for key in TREE_ARCHS:
        assert ta.tree_support(Target(model_for(key))) is None, key
    reasons = {key: ta.tree_support(Target(model_for(key)))
               for key in list(FAMILY_ARCHS) + list(MORE_ARCHS) if key not in TREE_ARCHS}
    assert "RotatingKVCache" in reasons["gpt_oss"] and "ArraysCache" in reasons["qwen3_next"]
    assert "rotary" in reasons["deepseek_v2"]  # its rotary embedding is no module of its own
    assert all(reasons.values()), [k for k, v in reasons.items() if not v]


def test_a_model_that_ignores_the_trees_mask_keeps_chains(monkeypatch):
    model, _ = tiny_target("qwen3", seed=3)
    monkeypatch.setattr(ta.TreeCache, "make_mask", lambda self, n, *a, **k: "causal")
    assert "mask" in ta.tree_support(Target(model))


def test_compacted_cache_is_the_chains_cache():
    model, _ = tiny_target("qwen3", seed=4)
    target = Target(model)
    prefix = [3, 9, 27, 81]
    tree = ta.TokenTree([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 2, 4], [0, 1, 1, 2, 2, 3])
    tree_cache, chain_cache = target.make_cache(), target.make_cache()
    for c in (tree_cache, chain_cache):
        target.forward(mx.array([prefix]), c)
    h_tree, _, _ = target.forward(mx.array([tree.tokens]), tree_cache, tree=tree)
    path = [0, 2, 4, 5]
    h_chain, _, _ = target.forward(mx.array([[tree.tokens[i] for i in path]]), chain_cache)
    assert mx.allclose(h_tree[:, path], h_chain, atol=1e-4).item()
    ta.compact_cache(tree_cache, len(prefix), path, len(tree))
    for a, b in zip(tree_cache, chain_cache):
        assert a.offset == b.offset == len(prefix) + len(path)
        n = a.offset  # rows past the offset are free space (a tree's leftovers there are overwritten)
        assert mx.allclose(a.keys[..., :n, :], b.keys[..., :n, :], atol=1e-5).item()
        assert mx.allclose(a.values[..., :n, :], b.values[..., :n, :], atol=1e-5).item()
    # the rotary embeddings are back: a plain forward after the tree matches
    assert all(not isinstance(parent[key], ta.TreeRoPE) for parent, key in target.rope_slots)


# -- the policy ---------------------------------------------------------------------------


def test_policy_tries_trees_then_keeps_the_better_of_tree_and_chain():
    policy = trees.TreePolicy(tries=2)
    assert not policy.choose(2, 1.5)  # width 2: a tree is the chain
    assert policy.choose(8, 1.5)  # untried: try it
    for _ in range(2):
        policy.update(8, accept_length=2)  # trees commit 3 per cycle
    assert policy.expected_tokens(8) == pytest.approx(3.0)
    assert policy.choose(8, 2.0) and not policy.choose(8, 3.0)
    sizer = BlockSizer(16)
    sizer.trees = policy
    assert sizer.expected_tokens(8) == sizer.chain_tokens(8)  # a call without trees counts on chains
    sizer.trees_on = True
    assert sizer.expected_tokens(8) == pytest.approx(max(3.0, sizer.chain_tokens(8)))


def test_policy_explores_tree_widths_rarely_and_ever_more_rarely():
    policy = trees.TreePolicy(explore_every=8)
    assert policy.explore(1, 16) is None  # drafting does not pay: no trees either
    tried = [(i, policy.explore(3, 16)) for i in range(200)]
    tried = [(i, w) for i, w in tried if w is not None]
    assert tried and all(w in trees.TREE_WIDTHS for _, w in tried)
    gaps = np.diff([i for i, _ in tried])
    assert (gaps >= 8).all() and len(tried) < 200 / 8
    later = [w for i, w in tried if i >= 100]
    assert len(later) < len(tried) - len(later)  # back-off: fewer tries later


# -- the engine ----------------------------------------------------------------------------


def decode(model, draft, prompt, **kw):
    tokens, responses = [], []
    for r in stream_generate(model, draft, byte_tokenizer(), prompt, **kw):
        tokens += r.tokens
        responses.append(r)
    return tokens, responses


def ranked_schedule(cycle, i):
    """The right token's rank: varied in the first positions, the argmax deeper down."""
    return (cycle + 2 * i) % 5 if i < 6 else 0


@pytest.mark.parametrize("key", TREE_ARCHS)
def test_greedy_with_trees_is_the_targets_own_greedy(key):
    forget_sizers()
    model = model_for(key)
    prompt, ref = clean_case(model, 40, 24, seed=11)
    draft = RankedDraft(Target(model), prompt + ref, ranked_schedule, block_size=8)
    tokens, responses = decode(model, draft, prompt, max_tokens=24, copy_proposals=False)
    assert tokens == ref
    counts = responses[-1].proposal_counts
    assert counts.get("tree", [0])[0] > 0
    # somewhere a tree committed past a runner-up (the right token was not the argmax)
    assert any(r.proposal == "tree" and r.accept_length > 0 for r in responses)


@pytest.mark.parametrize("block_size,length,max_tokens", [(4, 5, 30), (8, 70, 17), (16, 23, 40)])
def test_trees_at_block_sizes_prompt_lengths_and_budgets(block_size, length, max_tokens):
    forget_sizers()
    model, _ = tiny_target("qwen3", seed=5)
    prompt, ref = clean_case(model, length, max_tokens, seed=2)
    draft = RankedDraft(Target(model), prompt + ref, ranked_schedule, block_size=block_size)
    tokens, responses = decode(model, draft, prompt, max_tokens=max_tokens, copy_proposals=False)
    assert tokens == ref and len(tokens) == max_tokens  # max_tokens may fall inside a branch
    assert responses[-1].finish_reason == "length"
    assert responses[-1].proposal_counts.get("tree", [0])[0] > 0


def test_a_stop_id_inside_an_accepted_branch_ends_there():
    forget_sizers()
    model, _ = tiny_target("qwen3", seed=6)
    prompt, ref = clean_case(model, 20, 40, seed=3)
    full = prompt + ref
    for stop_at in (7, 13, 22):
        stop = ref[stop_at]
        want = greedy_reference(model, prompt, 40, stop_ids={stop, EOS_ID})
        draft = RankedDraft(Target(model), full, lambda c, i: 1 if i < 3 else 0, block_size=8)
        tokens, responses = decode(model, draft, prompt, max_tokens=40, stop_token_ids=[stop],
                                   copy_proposals=False)
        assert tokens == want and responses[-1].finish_reason == "stop"


def test_logprobs_from_a_tree_are_the_chains():
    forget_sizers()
    model, _ = tiny_target("qwen3", seed=7)
    prompt, ref = clean_case(model, 16, 20, seed=5)
    draft = RankedDraft(Target(model), prompt + ref, ranked_schedule, block_size=8)
    tokens, with_trees = decode(model, draft, prompt, max_tokens=20, logprobs=2, copy_proposals=False)
    assert tokens == ref and any(r.proposal == "tree" for r in with_trees)
    _, plain = decode(model, None, prompt, max_tokens=20, logprobs=2)
    a = [lp for r in with_trees for lp in r.logprobs]
    b = [lp for r in plain for lp in r.logprobs]
    assert [x.token for x in a] == [x.token for x in b] == ref
    assert np.allclose([x.logprob for x in a], [x.logprob for x in b], atol=1e-4)
    assert [[t for t, _ in x.top] for x in a] == [[t for t, _ in x.top] for x in b]


# -- sampling down a tree -----------------------------------------------------------------

V_MARKOV = 5
W_MARKOV = (np.random.default_rng(3).normal(size=(V_MARKOV, V_MARKOV)) * 1.5).astype(np.float32)
# root 0; its children 2, 1, 4 (best first); under 2: 3, 0; under 1: 1; under 3: 2
MARKOV_TREE = ta.TokenTree([0, 2, 1, 4, 3, 0, 1, 2], [-1, 0, 0, 0, 1, 1, 2, 4], [0, 1, 1, 1, 2, 2, 2, 3])


def markov_probs(prev, temperature):
    w = W_MARKOV[prev] / temperature
    e = np.exp(w - w.max())
    return e / e.sum()


def sample_walks(walk, n, temperature, seed=0):
    """First two committed tokens of `n` walks down MARKOV_TREE on a Markov target (each
    node's logits: W at its token); when a walk commits one token, the second is drawn
    from the target after it, as the next cycle would."""
    from dflash_mlx.speculation.accept import SamplingAcceptor

    logprobs = SamplingAcceptor(temperature).logprobs(mx.array(W_MARKOV[MARKOV_TREE.tokens]))
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        path, bonus = walk(MARKOV_TREE, logprobs)
        tokens = [MARKOV_TREE.tokens[i] for i in path[1:]] + [bonus]
        if len(tokens) == 1:
            tokens.append(int(rng.choice(V_MARKOV, p=markov_probs(tokens[0], temperature))))
        out.append(tokens[:2])
    return np.array(out)


def exact_pairs(temperature):
    first = markov_probs(0, temperature)
    return np.concatenate([first[a] * markov_probs(a, temperature) for a in range(V_MARKOV)])


def test_sampling_down_a_tree_keeps_the_targets_distribution():
    """Siblings tried in turn against what is left of p: the first two committed tokens
    follow the target's joint distribution (chi-square), and the walk goes deep."""
    from test_sampling import chi_square

    pairs = sample_walks(tt.accept_sampled, 3000, temperature=1.0)
    _, pval = chi_square(pairs[:, 0] * V_MARKOV + pairs[:, 1], exact_pairs(1.0))
    assert pval > 1e-3
    # and the same test is not vacuous: trying each sibling with its plain p(x) fails it
    def unnormalized(tree, logprobs):
        children = tree.children()
        path = [0]
        p = np.exp(np.array(logprobs))
        while True:
            for token, child in children[path[-1]].items():
                if mx.random.uniform().item() < p[path[-1], token]:
                    path.append(child)
                    break
            else:
                return path, int(mx.random.categorical(logprobs[path[-1]]).item())

    pairs = sample_walks(unnormalized, 3000, temperature=1.0)
    _, pval = chi_square(pairs[:, 0] * V_MARKOV + pairs[:, 1], exact_pairs(1.0))
    assert pval < 1e-6


def test_sampling_down_a_tree_at_a_tiny_temperature_is_the_greedy_walk():
    logits = mx.array(W_MARKOV[MARKOV_TREE.tokens])
    from dflash_mlx.speculation.accept import SamplingAcceptor

    greedy = tt.accept_greedy(MARKOV_TREE, mx.argmax(logits, axis=-1).tolist())
    for seed in range(5):
        mx.random.seed(seed)
        assert tt.accept_sampled(MARKOV_TREE, SamplingAcceptor(1e-4).logprobs(logits)) == greedy


def test_trees_at_temperature_above_zero_through_the_engine():
    """Sampling with trees on: tree cycles run, and a seed reproduces the answer."""
    forget_sizers()
    model, _ = tiny_target("qwen3", seed=8)
    prompt, ref = clean_case(model, 16, 40, seed=1)
    draft = RankedDraft(Target(model), prompt + ref, ranked_schedule, block_size=8)
    a, sampled = decode(model, draft, prompt, max_tokens=40, temperature=0.3, seed=0, copy_proposals=False)
    assert "tree" in sampled[-1].proposal_counts
    forget_sizers()
    b, _ = decode(model, draft, prompt, max_tokens=40, temperature=0.3, seed=0, copy_proposals=False)
    assert a == b


def test_no_trees_on_recurrent_targets_or_when_turned_off():
    forget_sizers()
    model, _ = tiny_target("qwen3", seed=8)
    prompt, ref = clean_case(model, 16, 24, seed=1)
    draft = RankedDraft(Target(model), prompt + ref, ranked_schedule, block_size=8)
    tokens, off = decode(model, draft, prompt, max_tokens=24, token_trees=False, copy_proposals=False)
    assert tokens == ref and "tree" not in off[-1].proposal_counts
    hybrid = model_for("qwen3_next")
    prompt, ref = clean_case(hybrid, 16, 20, seed=1)
    draft = RankedDraft(Target(hybrid), prompt + ref, ranked_schedule, block_size=8)
    tokens, responses = decode(hybrid, draft, prompt, max_tokens=20, copy_proposals=False)
    assert tokens == ref and "tree" not in responses[-1].proposal_counts


def test_trees_and_copies_together_stay_exact_over_chat_turns():
    from dflash_mlx.generate import make_prompt_cache

    forget_sizers()
    model, _ = tiny_target("qwen3", seed=9)
    prompt, ref = clean_case(model, 30, 30, seed=4)
    draft = RankedDraft(Target(model), prompt + ref + ref, ranked_schedule, block_size=8)
    cache = make_prompt_cache(model, draft)
    first, _ = decode(model, draft, prompt, max_tokens=30, prompt_cache=cache)
    assert first == ref
    # second turn: the first answer and more of the conversation, from the cached prefix
    turn2 = prompt + ref + prompt[:10]
    want = greedy_reference(model, turn2, 20, stop_ids={EOS_ID})
    draft.reference = turn2 + want
    second, responses = decode(model, draft, turn2, max_tokens=20, prompt_cache=cache)
    assert second == want
    assert responses[-1].prefill_tokens < len(turn2)  # the first turn's caches were reused


def test_compaction_passes_over_caches_that_hold_nothing():
    """A pipeline rank's caches include the layers other ranks hold, never filled: compacting a tree
    moves the rows of the others (it raised on them, and the tree probe of a split Kimi-VL then
    stopped on one rank only, leaving the other waiting in its forward)."""
    from mlx_lm.models.cache import KVCache

    held, elsewhere = KVCache(), KVCache()
    keys = mx.arange(2 * 6 * 4, dtype=mx.float32).reshape(1, 2, 6, 4)
    held.update_and_fetch(keys, keys + 100)
    ta.compact_cache([elsewhere, held], 2, [0, 2, 3], 4)  # rows 2, 4, 5 of the six kept at 2, 3, 4
    assert elsewhere.keys is None and held.offset == 5
    assert mx.array_equal(held.keys[..., : held.offset, :], keys[..., [0, 1, 2, 4, 5], :]).item()
