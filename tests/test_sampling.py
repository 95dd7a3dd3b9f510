"""Speculative sampling at temperature > 0 keeps the target's distribution exactly.

The main check runs the acceptor on a hand-built Markov target (logits depend
on the previous token only, so the exact distribution of every token sequence
is known in closed form) with a deliberately poor draft, batched over many
independent generations. The empirical joint distribution of the first five
tokens must match the exact one by a chi-square test, and the same test must
fail for broken acceptance rules. A smaller end-to-end check goes through
`stream_generate` with a tiny transformer and a real (random) DFlash draft.
"""

import itertools
import math
import sys

import mlx.core as mx
import numpy as np
import pytest

import importlib
from dflash_mlx import stream_generate
from dflash_mlx.speculation import accept
from dflash_mlx.speculation.accept import (GreedyAcceptor, Proposal, SamplingAcceptor, accept_in_pieces, make_acceptor,
                               sampling_logprobs)
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.speculation.xtc import XTC
from dflash_mlx.testing.targets import greedy_reference, tiny_target

# -- reference distribution (independent of dflash_mlx.speculation.accept) -----------------


def ref_probs(logits, temperature, top_p=1.0, top_k=0, min_p=0.0, xtc=None, min_tokens_to_keep=1):
    """mlx-lm's sampling distribution, in numpy: filters on the untempered
    log-probs (nucleus, min-p, XTC, top-k), then temperature over what is left.
    `xtc` (probability, threshold, special tokens): the mixture of the step that
    drops the top choices and the step that does not, by the coin's odds."""
    logits = np.asarray(logits, dtype=np.float64)
    lp = logits - logits.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    keep = np.ones(lp.shape, dtype=bool)
    order = np.argsort(-lp, axis=-1)
    rank = np.argsort(order, axis=-1)
    if 0 < top_p < 1:
        sorted_p = np.take_along_axis(np.exp(lp), order, -1)
        mass_before = np.cumsum(sorted_p, -1) - sorted_p
        keep &= np.take_along_axis(mass_before < top_p, rank, -1)
    if min_p > 0:  # (and the `min_tokens_to_keep` likeliest whatever min-p says)
        keep &= (lp >= lp.max(-1, keepdims=True) + math.log(min_p)) | (rank < min_tokens_to_keep)

    def tempered(kept):
        if top_k > 0:  # the k likeliest of what is left
            kept_rank = np.argsort(np.argsort(-np.where(kept, lp, -np.inf), axis=-1), axis=-1)
            kept = kept & (kept_rank < top_k)
        top = np.where(kept, lp, -np.inf).max(-1, keepdims=True)  # (the likeliest kept: a vanishing T)
        w = np.exp(np.where(kept, lp - top, -np.inf) / temperature)
        return w / w.sum(-1, keepdims=True)

    if xtc is None:
        return tempered(keep)
    probability, threshold, special = xtc
    p = np.where(keep, np.exp(lp), 0.0)
    p = p / p.sum(-1, keepdims=True)
    least_above = np.where(p > threshold, p, np.inf).min(-1, keepdims=True)
    drop = p > least_above
    drop[..., list(special)] = False
    return (1 - probability) * tempered(keep) + probability * tempered(keep & ~drop)


def chi_square(samples, probs):
    """(statistic, p-value) of integer-coded `samples` against exact `probs`.

    Cells expected below 5 are pooled; a sample in a zero-probability cell gives
    p = 0. The p-value uses the Wilson-Hilferty normal approximation."""
    probs = np.asarray(probs, dtype=np.float64).ravel()
    counts = np.bincount(samples, minlength=probs.size).astype(np.float64)
    if counts[probs == 0].sum() > 0:
        return math.inf, 0.0
    n = counts.sum()
    expected = n * probs
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (probs > 0)].sum())
    exp = np.append(expected[big], expected[~big & (probs > 0)].sum())
    if exp[-1] < 5:  # merge a small pool into the smallest big cell
        j = np.argmin(exp[:-1])
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    k = len(obs) - 1
    assert k >= 1, "too few samples for a chi-square test"
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return stat, 0.5 * math.erfc(z / math.sqrt(2))


def encode(tokens, V):
    """[N, K] token rows -> one integer per row (base V)."""
    code = np.zeros(tokens.shape[0], dtype=np.int64)
    for j in range(tokens.shape[1]):
        code = code * V + tokens[:, j]
    return code


# -- a Markov target and a poor draft, batched -----------------------------------

V = 5  # target vocabulary
N_DRAFT = 3  # drafted tokens per block
K = 5  # generated tokens checked: t1 (first_token), then block tokens incl. a bonus
START = 0  # the prompt's last token
rng = np.random.default_rng(0)
W = (rng.normal(size=(V, V)) * 1.5).astype(np.float32)  # target logits by previous token
# The draft is poor: unrelated logits, by last committed token and block position.
Q = (rng.normal(size=(V, N_DRAFT, V)) * 2.0).astype(np.float32)
REDUCED = np.array([0, 2, 3], dtype=np.int32)  # a reduced draft vocabulary (target ids)


class StubDraft:
    """What the acceptor reads from a draft: its vocabulary map."""

    def __init__(self, vocab_ids=None):
        self.vocab_ids = None if vocab_ids is None else mx.array(vocab_ids)

    def to_target_ids(self, ids):
        return ids if self.vocab_ids is None else self.vocab_ids[ids]


def markov_generate(acceptor, n_rows, reduced=False, k=K, w=W, q=Q, draft=None, first_rows=None):
    """The engine's cycle on the Markov target, for `n_rows` independent rows
    (with the target's rows in two pieces when `first_rows` is set).

    Returns the first k tokens of every row [n_rows, k] and all accept lengths."""
    draft = draft or StubDraft(REDUCED if reduced else None)
    Wm = mx.array(w)
    Qm = mx.array(q[:, :, REDUCED] if reduced else q)
    last = acceptor.first_token(Wm[mx.full((n_rows,), START, dtype=mx.int32)])
    out = np.zeros((n_rows, k), dtype=np.int64)
    out[:, 0] = np.array(last)
    count = np.ones(n_rows, dtype=np.int64)
    accepts = []
    rows = np.arange(n_rows)
    while count.min() < k:
        proposal = acceptor.propose(draft, Qm[last])
        fed = mx.concatenate([last[:, None], proposal.tokens.astype(mx.int32)], axis=1)
        if first_rows is None:
            a, committed = acceptor.accept(proposal, Wm[fed], draft)
        else:
            row_logits = lambda start, stop: Wm[fed[:, start:stop]]  # noqa: E731
            a, committed = accept_in_pieces(acceptor, proposal, row_logits, first_rows, draft)
        mx.eval(a, committed)
        a_np, c_np = np.array(a), np.array(committed)
        accepts.append(a_np)
        for j in range(c_np.shape[1]):
            take = (j <= a_np) & (count < k)
            out[rows[take], count[take]] = c_np[take, j]
            count += take
        last = mx.array(c_np[rows, a_np])
    return out, np.concatenate(accepts)


def exact_joint(k=K, w=W, **filters):
    """P(t1..tk) of the Markov target's own sampling, [V]*k."""
    T = ref_probs(w, **filters)  # T[i, j] = P(next j | previous i)
    joint = T[START]
    for _ in range(k - 1):
        joint = joint[..., :, None] * T
    return joint


N_ROWS = 25_000
FILTERS = {
    "plain": dict(temperature=1.0),
    "filtered": dict(temperature=0.7, top_p=0.9, top_k=4, min_p=0.05),
    # (token 2 special: never dropped)
    "xtc": dict(temperature=0.9, top_p=0.97, top_k=4, xtc=(0.6, 0.15, (2,))),
    "min_keep": dict(temperature=0.9, min_p=0.7, min_tokens_to_keep=3),
}


def acceptor_filters(filters: dict) -> dict:
    """A FILTERS entry as `SamplingAcceptor` takes it."""
    f = dict(filters)
    if "xtc" in f:
        f["xtc"] = XTC(*f["xtc"])
    return f


def check(mode, filters, reduced=False, seed=0, first_rows=None):
    mx.random.seed(seed)
    acc = SamplingAcceptor(draft_sampling=mode, **acceptor_filters(FILTERS[filters]))
    out, accepts = markov_generate(acc, N_ROWS, reduced=reduced, first_rows=first_rows)
    stat, pval = chi_square(encode(out, V), exact_joint(**FILTERS[filters]))
    return stat, pval, accepts


@pytest.mark.parametrize(
    "mode,filters,reduced",
    [
        ("argmax", "plain", False),
        ("sample", "plain", False),
        ("argmax", "filtered", False),
        ("sample", "filtered", False),
        ("sample", "filtered", True),
        ("argmax", "xtc", False),
        ("sample", "xtc", True),
        ("sample", "min_keep", False),
    ],
)
def test_first_tokens_follow_target_distribution(mode, filters, reduced):
    """Joint of the first 5 tokens (t1 from first_token, then drafted/accepted,
    residual and bonus tokens) over 5**5 cells matches the exact joint."""
    stat, pval, accepts = check(mode, filters, reduced)
    # The draft is poor but not useless: every accept length occurs, so the
    # rejection, partial and all-accepted paths all contribute samples.
    assert set(np.unique(accepts)) == set(range(N_DRAFT + 1)), np.bincount(accepts)
    assert pval > 1e-3, (stat, pval)


@pytest.mark.parametrize("mode,filters,reduced,first_rows", [
    ("argmax", "plain", False, 2),
    ("sample", "plain", False, 3),
    ("sample", "filtered", True, 2),
])
def test_head_in_pieces_keeps_the_distribution(mode, filters, reduced, first_rows):
    """The target's rows in two pieces (the second only for rows that accepted the
    whole first piece): the same exact joint, through every accept length."""
    stat, pval, accepts = check(mode, filters, reduced, seed=3, first_rows=first_rows)
    assert set(np.unique(accepts)) == set(range(N_DRAFT + 1)), np.bincount(accepts)
    assert pval > 1e-3, (stat, pval)


def skip_one_draft(acceptor, proposal, row_logits, first_rows, draft=None):
    """accept_in_pieces with an off-by-one: the second piece starts a row late, so
    the draft at the seam is taken unchecked."""
    rows = proposal.tokens.shape[1] + 1
    checked = first_rows - 1
    head_length, head = acceptor.accept(proposal.positions(0, checked), row_logits(0, first_rows), draft)
    go_on = head_length == checked
    tail_length, tail = acceptor.accept(proposal.positions(first_rows, rows - 1), row_logits(first_rows, rows), draft)
    accept_length = mx.where(go_on, first_rows + tail_length, head_length)
    seam = mx.concatenate([head[:, :checked], proposal.tokens[:, checked:first_rows], tail], axis=1)
    return accept_length, mx.where(go_on[:, None], seam, mx.pad(head, [(0, 0), (0, rows - first_rows)]))


def test_min_tokens_to_keep_changes_the_distribution():
    """Guards the min_keep case: with min-p 0.7 alone fewer tokens survive than the 3 it keeps."""
    assert np.abs(exact_joint(**FILTERS["min_keep"]) - exact_joint(**dict(FILTERS["min_keep"], min_tokens_to_keep=1))
                  ).max() > 1e-2
    with pytest.raises(ValueError, match="min_tokens_to_keep must be a whole number >= 1"):
        SamplingAcceptor(1.0, min_tokens_to_keep=0)


def test_xtc_changes_the_distribution_and_one_coin_a_verify_fails():
    """Guards the XTC cases: their exact joint is not the one without XTC (the test could tell them apart),
    and a verify whose rows share one coin (mlx-lm's scalar draw, made once for all rows) fails the test."""
    from mlx_lm.sample_utils import apply_xtc

    logprobs = mx.log(mx.softmax(mx.array(W), axis=-1))
    for threshold, special in ((0.15, [2]), (0.05, []), (0.5, [0, 1])):  # the filter is mlx-lm's, coin up
        assert mx.array_equal(XTC(1.0, threshold, tuple(special)).apply(logprobs),
                              apply_xtc(logprobs, 1.0, threshold, special)).item()
    without = dict(FILTERS["xtc"], xtc=None)
    assert np.abs(exact_joint(**FILTERS["xtc"]) - exact_joint(**without)).max() > 1e-2
    real_apply = XTC.apply

    def one_coin(self, logprobs):
        coin = mx.random.uniform() <= self.probability
        dropped = real_apply(XTC(1.0, self.threshold, self.special_tokens), logprobs)
        return mx.where(coin, dropped, logprobs)

    XTC.apply = one_coin
    try:
        stat, pval, _ = check("argmax", "xtc", seed=5)
    finally:
        XTC.apply = real_apply
    assert pval < 1e-12, (stat, pval)


def test_head_in_pieces_off_by_one_fails_the_same_test(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "accept_in_pieces", skip_one_draft)
    stat, pval, _ = check("argmax", "plain", seed=3, first_rows=2)
    assert pval < 1e-12, (stat, pval)


@pytest.mark.parametrize("first_rows", range(2, 10))
def test_greedy_head_in_pieces_equals_one_accept(first_rows):
    """Greedy: the same accept lengths and committed tokens as one `accept` over
    all rows, for accept lengths 0..n in one batch; the rows past the first
    piece are asked for only when some row accepted the whole first piece."""
    rng = np.random.default_rng(first_rows)
    B, n, vocab = 9, 8, 13
    logits = mx.array(rng.normal(size=(B, n + 1, vocab)).astype(np.float32))
    choice = np.array(mx.argmax(logits, axis=-1))
    drafted = choice[:, :-1].copy()
    for b in range(B - 1):  # row b accepts exactly b drafts; the last row accepts all n
        drafted[b, b] = (drafted[b, b] + 1) % vocab
    proposal = Proposal(mx.array(drafted.astype(np.int32)))
    want_a, want_c = GreedyAcceptor().accept(proposal, logits)
    asked = []

    def row_logits(start, stop):
        asked.append((start, stop))
        return logits[:, start:stop]

    a, committed = accept_in_pieces(GreedyAcceptor(), proposal, row_logits, first_rows)
    assert np.array(a).tolist() == np.array(want_a).tolist() == list(range(n)) + [n]
    for b, length in enumerate(np.array(a)):
        assert np.array(committed[b, : length + 1]).tolist() == np.array(want_c[b, : length + 1]).tolist()
    assert asked == ([(0, n + 1)] if first_rows >= n + 1 else [(0, first_rows), (first_rows - 1, n + 1)])
    # A lone row that rejects inside the first piece never asks for the rest.
    asked.clear()
    single = Proposal(proposal.tokens[:1])  # row 0 rejects its first draft
    a, committed = accept_in_pieces(GreedyAcceptor(), single, lambda s, e: row_logits(s, e)[:1], first_rows)
    assert a.item() == 0 and committed[0, 0].item() == choice[0, 0]
    assert asked == [(0, min(first_rows, n + 1))]


class SelectorDraft(StubDraft):
    """A draft with its own candidate selector (DFlash 2's hook): it proposes its
    second choice at every position, never the argmax of its logits."""

    def select_tokens(self, draft_logits):
        return mx.argsort(draft_logits, axis=-1)[..., -2].astype(mx.int32)


@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_selector_proposals_stay_exact(mode):
    """Proposals come from `select_tokens` (not argmax, not sampled) and are treated
    as deterministic (q one-hot): the joint still matches the exact one."""
    draft = SelectorDraft()
    acc = SamplingAcceptor(draft_sampling=mode, **FILTERS["plain"])
    logits = mx.array(Q[np.arange(V) % V])
    proposal = acc.propose(draft, logits)
    assert proposal.logq is None
    assert (np.array(proposal.tokens) == np.argsort(Q, axis=-1)[..., -2]).all()
    assert (np.array(proposal.tokens) != Q.argmax(-1)).any()
    mx.random.seed(11)
    out, accepts = markov_generate(acc, N_ROWS, draft=draft)
    assert set(np.unique(accepts)) == set(range(N_DRAFT + 1)), np.bincount(accepts)
    stat, pval = chi_square(encode(out, V), exact_joint(**FILTERS["plain"]))
    assert pval > 1e-3, (stat, pval)


def _always_accept(u, p, q):
    return u >= 0


def _resample_from_p(p_row, q_row):
    return p_row


def _ignore_q(u, p, q):
    return u < p


@pytest.mark.parametrize(
    "mode,broken,name",
    [
        ("argmax", {"accept_draws": _always_accept}, "always accept"),
        ("sample", {"accept_draws": _always_accept}, "always accept"),
        ("argmax", {"residual_probs": _resample_from_p}, "resample from p on rejection"),
        ("sample", {"residual_probs": _resample_from_p}, "resample from p on rejection"),
        ("sample", {"accept_draws": _ignore_q}, "accept with probability p, ignoring q"),
    ],
)
def test_broken_acceptance_rules_fail_the_same_test(monkeypatch, mode, broken, name):
    for attr, fn in broken.items():
        monkeypatch.setattr(accept, attr, fn)
    stat, pval, _ = check(mode, "plain")
    assert pval < 1e-12, f"{name}: the statistical test did not catch it ({stat}, {pval})"


def test_sampling_logprobs_match_reference():
    logits = mx.array(rng.normal(size=(3, 7, 40)).astype(np.float32) * 3)
    for f in [
        dict(temperature=1.0),
        dict(temperature=0.5, top_p=0.8),
        dict(temperature=1.3, top_k=5),
        dict(temperature=0.7, min_p=0.1),
        dict(temperature=0.7, top_p=0.9, top_k=6, min_p=0.02),
        dict(temperature=1.0, top_k=40),  # top-k = vocabulary: keeps everything
        dict(temperature=1.0, top_k=400),  # above the vocabulary (small draft vocabularies)
        dict(temperature=0.8, min_p=0.5, min_tokens_to_keep=4),
    ]:
        got = np.exp(np.array(sampling_logprobs(logits, **f)))
        np.testing.assert_allclose(got, ref_probs(np.array(logits), **f), atol=1e-5, err_msg=str(f))
    # XTC: with its coin always up, the filter alone (the mixture's other half is the plain filters)
    for f in [dict(temperature=1.0, xtc=(1.0, 0.1, ())),
              dict(temperature=0.6, top_p=0.9, top_k=3, xtc=(1.0, 0.05, (7,)))]:
        got = np.exp(np.array(sampling_logprobs(logits, **acceptor_filters(f))))
        np.testing.assert_allclose(got, ref_probs(np.array(logits), **f), atol=1e-5, err_msg=str(f))


# -- edge cases -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_top_k_one_is_greedy_on_markov(mode):
    mx.random.seed(1)
    out, _ = markov_generate(SamplingAcceptor(1.0, top_k=1, draft_sampling=mode), 200)
    chain = [START]
    for _ in range(K):
        chain.append(int(np.argmax(W[chain[-1]])))
    assert (out == np.array(chain[1:])).all()


def test_p_zero_on_proposed_token_never_accepts():
    """The target's filter removes the drafted token: p(d) = 0 rejects always and
    the replacement follows normalize(max(p - q, 0)) (p itself when q is one-hot on d)."""
    n_rows = 20_000
    row = np.array([3.0, 2.0, 1.0, 0.5, 0.0], np.float32)
    logits = mx.array(np.tile(row, (n_rows, 2, 1)))
    drafted = mx.full((n_rows, 1), 4, dtype=mx.int32)  # outside top-3
    p = ref_probs(row, 1.0, top_k=3)
    q = np.array([0.6, 0.1, 0.1, 0.0, 0.2])
    mx.random.seed(2)
    for proposal, expected in (
        (Proposal(drafted), p),  # argmax mode: q one-hot on d
        (Proposal(drafted, mx.log(mx.array(np.tile(q, (n_rows, 1, 1)).astype(np.float32))), drafted),
         np.maximum(p - q, 0) / np.maximum(p - q, 0).sum()),
    ):
        a, committed = SamplingAcceptor(1.0, top_k=3).accept(proposal, logits, StubDraft())
        assert (np.array(a) == 0).all()
        first = np.array(committed[:, 0])
        assert (first != 4).all()
        _, pval = chi_square(first, expected)
        assert pval > 1e-3


def test_q_zero_on_proposed_token():
    """q(d) = 0 (a token the draft could not sample): min(1, p/0) accepts iff p > 0."""
    n_rows = 100
    logits = mx.array(np.tile(np.array([3.0, 2.0, 1.0, 0.5, 0.0], np.float32), (n_rows, 3, 1)))
    logq = mx.log(mx.array(np.tile(np.array([0.5, 0.5, 0.0, 0.0, 0.0], np.float32), (n_rows, 2, 1))))
    drafted = mx.array(np.tile(np.array([[2, 3]], np.int32), (n_rows, 1)))
    acc = SamplingAcceptor(1.0)
    a, _ = acc.accept(Proposal(drafted, logq, drafted), logits, StubDraft())
    assert (np.array(a) == 2).all()
    # Both zero (top-k removes token 3 from p): rejected at the second position.
    a, committed = SamplingAcceptor(1.0, top_k=3).accept(Proposal(drafted, logq, drafted), logits, StubDraft())
    assert (np.array(a) == 1).all()
    assert (np.array(committed[:, 0]) == 2).all()
    assert (np.array(committed[:, 1]) != 3).all()


@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_all_accepted_block_takes_bonus_from_last_row(mode):
    """q == p on every drafted position (sample) or p one-hot on the draft's
    argmax (argmax): the whole block is accepted, the bonus follows row n."""
    n_rows, n, Vb = 30_000, 3, 6
    draft_logits = rng.normal(size=(1, n, Vb)).astype(np.float32) * 2
    if mode == "argmax":
        drafted_rows = np.zeros((1, n, Vb), np.float32)
        drafted_rows[0, np.arange(n), draft_logits[0].argmax(-1)] = 40.0  # p(d) = 1
    else:
        drafted_rows = draft_logits
    last_row = rng.normal(size=(1, 1, Vb)).astype(np.float32)
    target = np.concatenate([drafted_rows, last_row], axis=1)
    mx.random.seed(3)
    acc = SamplingAcceptor(1.0, draft_sampling=mode)
    proposal = acc.propose(StubDraft(), mx.array(np.repeat(draft_logits, n_rows, 0)))
    a, committed = acc.accept(proposal, mx.array(np.repeat(target, n_rows, 0)), StubDraft())
    assert (np.array(a) == n).all()
    assert (np.array(committed[:, :n]) == np.array(proposal.tokens)).all()
    _, pval = chi_square(np.array(committed[:, n]), ref_probs(last_row[0, 0], 1.0))
    assert pval > 1e-3


def test_no_proposal_samples_the_target():
    """Block size 1 (and baseline decoding): the one row is sampled as is."""
    mx.random.seed(4)
    logits = mx.array(np.tile(W[1], (20_000, 1, 1)))
    a, committed = SamplingAcceptor(0.8, top_p=0.95).accept(None, logits, None)
    assert (np.array(a) == 0).all()
    _, pval = chi_square(np.array(committed[:, 0]), ref_probs(W[1], 0.8, top_p=0.95))
    assert pval > 1e-3


def test_make_acceptor_and_validation():
    assert isinstance(make_acceptor(0.0, draft_sampling="sample"), GreedyAcceptor)
    assert isinstance(make_acceptor(1.0, top_k=1), GreedyAcceptor)
    acc = make_acceptor(0.7, top_p=0.9, top_k=0, min_p=0.0, draft_sampling="sample")
    assert isinstance(acc, SamplingAcceptor) and acc.draft_sampling == "sample"
    with pytest.raises(ValueError, match="draft_sampling"):
        SamplingAcceptor(1.0, draft_sampling="nucleus")
    with pytest.raises(ValueError, match="temperature"):
        SamplingAcceptor(0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingAcceptor(1.0, top_p=0.0)


# -- end to end through stream_generate -------------------------------------------

_TINY = {}


def tiny(arch, **kw):
    key = (arch, tuple(sorted(kw.items())))
    if key not in _TINY:
        _TINY[key] = tiny_target(arch, seed=1, **kw)
    return _TINY[key]


def tokens_of(model, draft, tok, prompt, block_size="draft", **kw):
    """At a fixed width: with sampling, the width decides how the random draws are used."""
    return [t for r in stream_generate(model, draft, tok, prompt, block_size=block_size, **kw) for t in r.tokens]


@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_tiny_temperature_equals_greedy(mode):
    model, tok = tiny("qwen3")
    draft = random_draft(model, block_size=4, seed=2)
    prompt = [5, 17, 99, 3]
    ref = greedy_reference(model, prompt, 16)
    out = tokens_of(model, draft, tok, prompt, max_tokens=16, temperature=1e-6, seed=0,
                    draft_sampling=mode, stop_token_ids=[])
    assert out == ref
    assert tokens_of(model, draft, tok, prompt, max_tokens=16, temperature=0.0, stop_token_ids=[]) == ref


@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_top_k_one_equals_greedy_through_engine(monkeypatch, mode):
    model, tok = tiny("qwen3")
    draft = random_draft(model, block_size=4, seed=3)
    prompt = [7, 8, 9]
    ref = greedy_reference(model, prompt, 16)
    # The engine routes top_k=1 to GreedyAcceptor; force the sampling path too.
    assert tokens_of(model, draft, tok, prompt, max_tokens=16, temperature=1.0, top_k=1, stop_token_ids=[]) == ref
    monkeypatch.setattr(
        importlib.import_module("dflash_mlx.generate"), "make_acceptor",
        lambda temperature, **kw: SamplingAcceptor(temperature, **kw),
    )
    out = tokens_of(model, draft, tok, prompt, max_tokens=16, temperature=1.0, top_k=1,
                    seed=5, draft_sampling=mode, stop_token_ids=[])
    assert out == ref


def exact_first_tokens(model, prompt, k, **filters):
    """P(t1..tk) from the model itself: every prefix scored in one batched forward."""
    Vm = model.args.vocab_size
    joint = np.ones(())
    for depth in range(k):
        prefixes = np.array(list(itertools.product(range(Vm), repeat=depth)), dtype=np.int64)
        seqs = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes.reshape(len(prefixes), depth)], axis=1)
        logits = np.array(model(mx.array(seqs))[:, -1].astype(mx.float32))
        joint = joint[..., None] * ref_probs(logits, **filters).reshape(joint.shape + (Vm,))
    return joint


E2E_FILTERS = dict(temperature=0.3)


def engine_filters(filters: dict) -> dict:
    """A filters dict as `stream_generate` takes it (XTC as its three arguments)."""
    f = dict(filters)
    if f.get("xtc"):
        f["xtc_probability"], f["xtc_threshold"], f["xtc_special_tokens"] = f.pop("xtc")
    return f
E2E_PROMPT = [1, 2, 3, 0]


def engine_first_tokens(mode, n_runs=100, target=None, filters=E2E_FILTERS):
    """First three tokens of `n_runs` seeded `stream_generate` calls on a tiny
    transformer (vocabulary 4; `target`: another (model, tokenizer)) with a random
    DFlash draft over a reduced vocabulary, plus the exact joint and all accept lengths."""
    model, tok = target or tiny("llama", vocab_size=4)
    draft = random_draft(model, block_size=3, seed=4)
    draft.set_vocab(mx.array([0, 1, 2]))  # token 3 is outside the draft vocabulary
    outs, accepts = [], []
    for seed in range(n_runs):
        rs = list(stream_generate(model, draft, tok, E2E_PROMPT, max_tokens=3, seed=seed, block_size="draft",
                                  draft_sampling=mode, stop_token_ids=[], **engine_filters(filters)))
        outs.append([t for r in rs for t in r.tokens])
        accepts += rs[-1].accept_lengths
    exact = exact_first_tokens(model, E2E_PROMPT, 3, **filters)
    again = tokens_of(model, draft, tok, E2E_PROMPT, max_tokens=3, seed=7, draft_sampling=mode,
                      stop_token_ids=[], **engine_filters(filters))
    return np.array(outs), exact, accepts, again


@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_stream_generate_first_tokens_follow_target(mode):
    """Through the engine: the first three tokens over many seeds follow the
    target's own distribution (exact, from the model), and a seed reproduces."""
    out, exact, accepts, again = engine_first_tokens(mode)
    assert out.shape == (100, 3)
    assert 0 < sum(accepts) < 2 * len(accepts)  # some drafts accepted, some rejected
    _, pval = chi_square(encode(out, 4), exact)
    assert pval > 1e-3
    assert again == out[7].tolist()


def test_stream_generate_with_xtc_follows_target():
    """mlx-lm's XTC through the engine (each verify row with its own coin): the first three tokens over many
    seeds follow the target's own XTC distribution, which is not its distribution without XTC."""
    filters = dict(temperature=0.8, xtc=(0.7, 0.2, (3,)))
    out, exact, accepts, _ = engine_first_tokens("argmax", n_runs=150, filters=filters)
    assert 0 < sum(accepts) < 2 * len(accepts)
    _, pval = chi_square(encode(out, 4), exact)
    assert pval > 1e-3
    model, _ = tiny("llama", vocab_size=4)
    without = exact_first_tokens(model, E2E_PROMPT, 3, temperature=0.8)
    _, pval_without = chi_square(encode(out, 4), without)
    assert pval_without < 1e-3  # (the sample tells the two apart)


def test_stream_generate_first_tokens_follow_an_moe_target():
    """The same on a mixture-of-experts target (Qwen3-MoE, 8 experts, top 2): the
    rows of a verify route to other experts than one-token decoding would, and the
    distribution is still the target's own."""
    from dflash_mlx.testing.targets import byte_tokenizer
    from dflash_mlx.testing.archs import build

    model = build("qwen3_moe", vocab_size=4)
    out, exact, accepts, again = engine_first_tokens("argmax", target=(model, byte_tokenizer()))
    assert exact.max() < 0.5  # a spread distribution, not a near-deterministic one
    assert 0 < sum(accepts) < 2 * len(accepts)
    _, pval = chi_square(encode(out, 4), exact)
    assert pval > 1e-3
    assert again == out[7].tolist()


def test_stream_generate_always_accept_fails(monkeypatch):
    """The engine-level check is not vacuous: always accepting fails it."""
    monkeypatch.setattr(accept, "accept_draws", _always_accept)
    out, exact, _, _ = engine_first_tokens("argmax")
    _, pval = chi_square(encode(out, 4), exact)
    assert pval < 1e-6


def test_a_vanishing_temperature_or_top_p_is_greedy_in_the_library():
    """1/T overflows float32 below ~3e-39 and a top-p of 1e-300 is 0 there: both are the
    greedy limit, for library callers as for the server."""
    assert isinstance(accept.make_acceptor(1e-300), accept.GreedyAcceptor)
    assert isinstance(accept.make_acceptor(1.0, top_p=1e-300), accept.GreedyAcceptor)
    assert isinstance(accept.make_acceptor(0.5, top_p=0.9), accept.SamplingAcceptor)
    model, tok = tiny("llama")
    draft = random_draft(model, block_size=4, seed=2)
    prompt = list(range(10, 30))
    want = greedy_reference(model, prompt, 8, stop_ids=[])
    for sampling in ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-300}):
        assert tokens_of(model, draft, tok, prompt, max_tokens=8, stop_token_ids=[], seed=0, **sampling) == want


def test_stream_generate_with_token_trees_follows_target(monkeypatch):
    """Every drafted cycle a token tree (the policy forced), sampled down exactly
    (`tree.accept_sampled`): the first three tokens over many seeds still follow
    the target's own distribution."""
    assert tree_sampling_pvalue(monkeypatch) > 1e-3


def test_stream_generate_with_trees_that_always_take_the_first_child_fails(monkeypatch):
    """The engine-level check is not vacuous: a walk that accepts every first child fails it."""
    from dflash_mlx.speculation import tree_verify

    def first_child(tree, logprobs):
        children, path = tree.children(), [0]
        while children[path[-1]]:
            path.append(next(iter(children[path[-1]].values())))
        return path, int(mx.random.categorical(logprobs[path[-1]]).item())

    monkeypatch.setattr(tree_verify, "accept_sampled", first_child)
    assert tree_sampling_pvalue(monkeypatch) < 1e-6


def tree_sampling_pvalue(monkeypatch):
    from dflash_mlx.models.target import tree_attention
    from dflash_mlx.policy import trees
    from dflash_mlx.policy.sizer import forget_sizers

    monkeypatch.setattr(trees.TreePolicy, "explore", lambda self, chosen, limit: max(4, min(chosen, limit)))
    from dflash_mlx.testing.targets import byte_tokenizer
    from dflash_mlx.testing.archs import build

    model, tok = build("qwen3_moe", vocab_size=4), byte_tokenizer()
    assert tree_attention.tree_support(token_tree_target(model)) is None
    draft = random_draft(model, block_size=4, seed=4)
    outs, kinds = [], {}
    for seed in range(100):
        forget_sizers()
        rs = list(stream_generate(model, draft, tok, E2E_PROMPT, max_tokens=3, seed=seed, stop_token_ids=[],
                                  copy_proposals=False, **E2E_FILTERS))
        outs.append([t for r in rs for t in r.tokens])
        for kind, (cycles, _) in rs[-1].proposal_counts.items():
            kinds[kind] = kinds.get(kind, 0) + cycles
    assert kinds.get("tree", 0) >= 100  # every run's cycles were trees
    exact = exact_first_tokens(model, E2E_PROMPT, 3, **E2E_FILTERS)
    assert exact.max() < 0.5  # a spread distribution
    _, pval = chi_square(encode(np.array(outs), 4), exact)
    return pval


def token_tree_target(model):
    from dflash_mlx.models.target.adapter import Target

    return Target(model)


@pytest.mark.parametrize("limit", [dict(temperature=1e-30), dict(temperature=1e-300), dict(temperature=0.8, top_k=1)])
def test_xtc_in_the_greedy_limits_is_not_greedy(limit):
    """A vanishing temperature and top-k 1 are greedy on their own (GreedyAcceptor), but under XTC they take
    the likeliest token XTC leaves: a mixture of the argmax and the argmax of the survivors, which the
    engine keeps (the Markov joint by the chi-square test) and greedy decoding would not."""
    filters = dict(limit, xtc=(0.5, 0.15, (2,)))
    acc = make_acceptor(**acceptor_filters(filters))
    assert isinstance(acc, SamplingAcceptor) and isinstance(make_acceptor(**limit), GreedyAcceptor)
    assert isinstance(make_acceptor(**acceptor_filters(dict(filters, temperature=0.0))), GreedyAcceptor)
    mx.random.seed(2)
    out, _ = markov_generate(acc, 4_000)
    exact = exact_joint(**filters)
    assert (exact > 0).sum() > 1  # (not one sequence: the coin matters)
    _, pval = chi_square(encode(out, V), exact)
    assert pval > 1e-3
