"""Acceptance: which drafted tokens the target keeps, and the token it adds.

Words used here and by every caller:
  accepted tokens   the leading drafted tokens the target keeps (`accept_length` of them);
  recovered token   what the target puts at the first rejected position (its argmax, or a
                    draw from the residual normalize(max(p - q, 0)) at temperature > 0);
  bonus token       what the target adds after a fully accepted block (its last row);
  committed         accepted + the one recovered or bonus token: accept_length + 1 per cycle.

Two acceptors with one interface (`propose`, `first_token`, `accept`):

  GreedyAcceptor    temperature 0: the longest prefix equal to the target's argmax.
  SamplingAcceptor  temperature > 0, exact speculative sampling: the committed
                    tokens follow the target's own sampling distribution
                    whatever the draft proposes. Draft token d is accepted with
                    probability min(1, p(d)/q(d)); at the first rejection the
                    token comes from normalize(max(p - q, 0)); when the whole
                    block is accepted the bonus comes from the last target row.
                    p and q are the *sampling* distributions (temperature,
                    top-p, top-k, min-p, XTC), both from `sampling_logprobs`.

Proposals are deterministic (q one-hot on the proposed token) unless sampled:
  "argmax"  the draft's argmax, or the draft's own `select_tokens(draft_logits)`
            when it has one (DFlash 2's candidate selector). A deterministic
            proposal is accepted with probability p(d); the residual is p without d.
  "sample"  each position drawn from q (drafts without a selector only); q
            travels with the proposal for the acceptance test.

Everything stays in the MLX graph; the engine syncs once per cycle to read the
accept length. `accept_in_pieces` runs either acceptor with the target's logits
computed for the first few verify rows only, and for the rest only when every
draft those rows check was accepted (on a CPU the LM head's cost grows with its
rows). Randomness comes from `mx.random`'s global state, so `mx.random.seed`
makes a run reproducible.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from dflash_mlx.kernels import argmax
from dflash_mlx.speculation.xtc import XTC

DRAFT_SAMPLING_MODES = ("argmax", "sample")


@dataclass
class Proposal:
    """The draft's block in target ids [B, n]. A sampled proposal also keeps
    log q (filtered, tempered, over the draft vocabulary) [B, n, V_draft] and
    the sampled ids in the draft vocabulary [B, n]; a deterministic one keeps neither."""

    tokens: mx.array
    logq: Optional[mx.array] = None
    draft_ids: Optional[mx.array] = None

    @staticmethod
    def joined(parts: List["Proposal"]) -> "Proposal":
        """One proposal of consecutive ones (each of one or more positions)."""
        join = lambda name: None if getattr(parts[0], name) is None else mx.concatenate(  # noqa: E731
            [getattr(p, name) for p in parts], axis=1)
        return Proposal(join("tokens"), join("logq"), join("draft_ids"))

    def positions(self, start: int, stop: int) -> "Proposal":
        """The drafted positions start..stop-1 (along the block axis)."""
        cut = lambda a: None if a is None else a[:, start:stop]  # noqa: E731
        return Proposal(self.tokens[:, start:stop], cut(self.logq), cut(self.draft_ids))


def deterministic_proposal(draft, draft_logits: mx.array) -> Proposal:
    """The draft's own choice: `select_tokens` where the draft defines it, else argmax.
    Both return ids in the draft vocabulary (the last axis of `draft_logits`)."""
    select = getattr(draft, "select_tokens", None)
    ids = select(draft_logits) if select is not None else mx.argmax(draft_logits, axis=-1)
    return Proposal(draft.to_target_ids(ids).astype(mx.int32))


# 1/T past this overflows float32 (inf, then NaN): a vanishing temperature (under XTC, which keeps it
# from being greedy) scales by this instead, which is its limit to the last bit of float32 log-probs
MAX_INVERSE_TEMPERATURE = 1e30


def sampling_logprobs(
    logits: mx.array,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    xtc: Optional[XTC] = None,
    min_tokens_to_keep: int = 1,
) -> mx.array:
    """Log-probabilities of the distribution a token is sampled from ([..., V] -> [..., V]).

    mlx-lm's order (`make_sampler`): the filters act on the untempered
    log-probabilities (top-p, min-p, XTC, top-k), then the temperature scales what
    is left. Removed tokens get -inf. This is the one function that makes both p
    (target) and q (draft).
    """
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if 0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p > 0.0:
        logprobs = apply_min_p(logprobs, min_p, min_tokens_to_keep)
    if xtc is not None:
        logprobs = xtc.apply(logprobs)
    # A top-k at or above the vocabulary (a reduced draft vocabulary can be
    # small) keeps everything; mlx-lm would reject it.
    if 0 < top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, top_k)
    scaled = logprobs * min(1.0 / temperature, MAX_INVERSE_TEMPERATURE)
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def accept_draws(u: mx.array, p_drafted: mx.array, q_drafted: mx.array) -> mx.array:
    """Accept with probability min(1, p/q): u < p/q, written u*q < p so that
    q = 0 (a token the draft could not have sampled) accepts iff p > 0 and
    p = 0 never accepts."""
    return u * q_drafted < p_drafted


def residual_probs(p_row: mx.array, q_row: mx.array) -> mx.array:
    """normalize(max(p - q, 0)) up to the normalization (categorical needs none).

    The residual is empty only when p <= q everywhere, i.e. p == q, where a
    rejection cannot happen; rounding can still get there, so fall back to p."""
    r = mx.maximum(p_row - q_row, 0.0)
    empty = r.sum(axis=-1, keepdims=True) <= 0
    return mx.where(empty, p_row, r)


def sample_from_probs(probs: mx.array) -> mx.array:
    """One draw per row from unnormalized probabilities [..., V]."""
    return mx.random.categorical(mx.log(probs))


def greedy_choice(logits: mx.array) -> mx.array:
    """logits [..., V] -> the target's greedy token [...], int32, as mlx-lm's `generate_step`
    picks it: the argmax of the log-probabilities in the logits' own dtype. In bfloat16 or
    float16, subtracting the logsumexp rounds neighbouring logits to one value, and the argmax
    then takes the first of them, which the argmax of the raw logits need not be."""
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1).astype(mx.int32)


class GreedyAcceptor:
    """temperature 0: accept the longest prefix where the draft equals the target's argmax.

    Where it pays (`kernels.argmax`: float32 logits on the CPU) `accept` takes the raw argmax and
    records which calls had a row whose raw argmax may differ from `greedy_choice`'s; the caller
    takes that flag (`take_unsure`) right after it builds its acceptance, and where it is set once
    read, does the acceptance again with `exact()`, which always takes the log-probabilities."""

    def __init__(self, cheap: bool = True):
        self.cheap = cheap
        self._unsure = []

    def exact(self) -> "GreedyAcceptor":
        return GreedyAcceptor(cheap=False)

    def take_unsure(self) -> Optional[mx.array]:
        """Whether an `accept` since the last call may differ from the exact one (a lazy bool
        scalar), or None when none took the raw argmax."""
        flags, self._unsure = self._unsure, []
        if not flags:
            return None
        return flags[0] if len(flags) == 1 else mx.any(mx.stack(flags))

    def propose(self, draft, draft_logits: mx.array) -> Proposal:
        return deterministic_proposal(draft, draft_logits)

    def first_token(self, logits: mx.array) -> mx.array:
        """logits [B, V] -> [B]"""
        return greedy_choice(logits)

    def accept(self, proposal: Optional[Proposal], logits: mx.array, draft=None):
        """logits: target logits [B, n+1, V] for [last, d1..dn].

        Returns (accept_length [B], committed [B, n+1]): committed[:, :a] are the
        accepted drafts, committed[:, a] is the target's own token (the bonus).
        """
        if self.cheap and argmax.pays(logits):
            choice, unsure = argmax.argmax_or_unsure(logits)
            self._unsure.append(unsure.any())
        else:
            choice = greedy_choice(logits)
        if proposal is None or proposal.tokens.shape[1] == 0:
            return mx.zeros((logits.shape[0],), dtype=mx.int32), choice
        matches = (proposal.tokens == choice[:, :-1]).astype(mx.int32)
        accept_length = mx.cumprod(matches, axis=1).sum(axis=1)
        # Past the first mismatch the target's choices are conditioned on wrong
        # tokens; position a of `choice` is the bonus, positions < a equal drafts.
        return accept_length, choice


class SamplingAcceptor:
    """Exact speculative sampling at temperature > 0."""

    def __init__(
        self,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        draft_sampling: str = "argmax",
        xtc: Optional[XTC] = None,
        min_tokens_to_keep: int = 1,
    ):
        if not temperature > 0:
            raise ValueError(f"SamplingAcceptor needs temperature > 0, got {temperature}")
        if not 0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {top_k}")
        if not 0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        if isinstance(min_tokens_to_keep, bool) or not isinstance(min_tokens_to_keep, int) or min_tokens_to_keep < 1:
            raise ValueError(f"min_tokens_to_keep must be a whole number >= 1, got {min_tokens_to_keep!r}")
        if draft_sampling not in DRAFT_SAMPLING_MODES:
            raise ValueError(
                f"draft_sampling must be one of {DRAFT_SAMPLING_MODES}, got {draft_sampling!r}"
            )
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = int(top_k)
        self.min_p = float(min_p)
        self.draft_sampling = draft_sampling
        self.xtc = xtc
        self.min_tokens_to_keep = min_tokens_to_keep  # (min-p's floor, mlx-lm's make_sampler's)

    def logprobs(self, logits: mx.array) -> mx.array:
        """The target's sampling distribution (each row's XTC coin drawn here)."""
        return sampling_logprobs(logits, self.temperature, self.top_p, self.top_k, self.min_p, self.xtc,
                                 self.min_tokens_to_keep)

    def exact(self) -> "SamplingAcceptor":
        return self

    def take_unsure(self) -> None:
        return None

    def propose(self, draft, draft_logits: mx.array) -> Proposal:
        """draft_logits [B, n, V_draft] -> proposal in target ids."""
        # A draft with its own selector proposes along its selected path: sampling
        # positions independently from its logits would bypass the selector.
        if self.draft_sampling == "argmax" or hasattr(draft, "select_tokens"):
            return deterministic_proposal(draft, draft_logits)
        # (q may be any distribution the proposal was drawn from: no XTC, whose special tokens are target ids)
        logq = sampling_logprobs(draft_logits, self.temperature, self.top_p, self.top_k, self.min_p,
                                 min_tokens_to_keep=self.min_tokens_to_keep)
        ids = mx.random.categorical(logq)
        return Proposal(draft.to_target_ids(ids).astype(mx.int32), logq, ids)

    def first_token(self, logits: mx.array) -> mx.array:
        """logits [B, V] -> [B]"""
        return mx.random.categorical(self.logprobs(logits)).astype(mx.int32)

    def accept(self, proposal: Optional[Proposal], logits: mx.array, draft=None):
        """logits: target logits [B, n+1, V] for [last, d1..dn].

        Returns (accept_length [B], committed [B, n+1]): committed[:, :a] are the
        accepted drafts, committed[:, a] the token drawn from the residual at the
        first rejection (or from row n when all n drafts are accepted).
        """
        logp = self.logprobs(logits)
        B, rows, V = logp.shape
        n = rows - 1
        if proposal is None or proposal.tokens.shape[1] == 0:
            tokens = mx.random.categorical(logp).astype(mx.int32)
            return mx.zeros((B,), dtype=mx.int32), tokens
        drafted = proposal.tokens.astype(mx.int32)
        p = mx.exp(logp)
        p_drafted = mx.take_along_axis(p[:, :n], drafted[..., None], axis=-1)[..., 0]
        one_hot = proposal.logq is None
        if one_hot:
            q_drafted = mx.ones_like(p_drafted)
        else:
            q = mx.exp(proposal.logq.astype(mx.float32))  # [B, n, V_draft]
            draft_ids = proposal.draft_ids.astype(mx.int32)
            q_drafted = mx.take_along_axis(q, draft_ids[..., None], axis=-1)[..., 0]

        u = mx.random.uniform(shape=(B, n))
        accepted = accept_draws(u, p_drafted, q_drafted).astype(mx.int32)
        accept_length = mx.cumprod(accepted, axis=1).sum(axis=1)

        # Only row a needs a draw: the residual at the first rejection, or the
        # last target row when everything was accepted (q is 0 there, so the
        # residual formula gives p itself).
        idx = accept_length[:, None]
        p_row = mx.take_along_axis(p, idx[..., None], axis=1)[:, 0]  # [B, V]
        if one_hot:
            pad = mx.full((B, 1), -1, dtype=mx.int32)  # matches no token
            tok = mx.take_along_axis(mx.concatenate([drafted, pad], axis=1), idx, axis=1)
            q_row = (mx.arange(V)[None] == tok).astype(p.dtype)
        else:
            q_pad = mx.concatenate([q, mx.zeros_like(q[:, :1])], axis=1)
            q_row = mx.take_along_axis(q_pad, idx[..., None], axis=1)[:, 0]  # [B, V_draft]
            vocab_ids = getattr(draft, "vocab_ids", None)
            if vocab_ids is not None:
                # Tokens outside the draft vocabulary have q = 0.
                cols = mx.broadcast_to(vocab_ids.astype(mx.int32)[None], q_row.shape)
                q_row = mx.put_along_axis(mx.zeros((B, V), dtype=q_row.dtype), cols, q_row, axis=-1)
        bonus = sample_from_probs(residual_probs(p_row, q_row)).astype(mx.int32)

        committed = mx.concatenate([drafted, bonus[:, None]], axis=1)
        committed = mx.where(mx.arange(n + 1)[None] == idx, bonus[:, None], committed)
        return accept_length, committed


def accept_in_pieces(acceptor, proposal: Optional[Proposal], row_logits: Callable[[int, int], mx.array],
                     first_rows: int, draft=None):
    """`acceptor.accept` over a verify of [last, d1..dn] whose logits come in two pieces.

    row_logits(start, stop): the target's logits of verify rows start..stop-1,
    [B, stop - start, V]. Rows 0..first_rows-1 check drafts d1..d(first_rows-1)
    first; the other rows' logits are computed only when some batch row accepted
    all of those (one host sync). The second piece starts again at row
    first_rows - 1, which checks d(first_rows) there. Acceptance walks the rows in
    order and each row's decision reads only that row's logits and its own draws,
    so greedy gives what one `accept` over all rows gives and sampling keeps the
    same distribution; a row's bonus drawn in the first piece and then not used
    is discarded like any other unused draw.

    Returns (accept_length [B], committed [B, >= accept_length + 1]).
    """
    rows = 1 + (0 if proposal is None else proposal.tokens.shape[1])
    if proposal is None or not 2 <= first_rows < rows:
        return acceptor.accept(proposal, row_logits(0, rows), draft)
    checked = first_rows - 1  # drafts the first piece checks
    head_length, head = acceptor.accept(proposal.positions(0, checked), row_logits(0, first_rows), draft)
    go_on = head_length == checked
    if not go_on.any().item():
        return head_length, head
    tail_length, tail = acceptor.accept(proposal.positions(checked, rows - 1), row_logits(checked, rows), draft)
    accept_length = mx.where(go_on, checked + tail_length, head_length)
    padded = mx.pad(head, [(0, 0), (0, rows - first_rows)])
    committed = mx.where(go_on[:, None], mx.concatenate([head[:, :checked], tail], axis=1), padded)
    return accept_length, committed


def pack_outcome(accept_length: mx.array, committed: mx.array, verify_in: mx.array) -> mx.array:
    """[B, 1 + C + W] int32: a verify's accept lengths, committed tokens [B, C] and inputs [B, W] in one
    array, so that the host reads a cycle's outcome at once: on MLX's CUDA backend arrays live in
    managed memory, and each host read of one the GPU wrote moves its pages (mlx-lm's plain step
    reads one token). A plain step's (C = W = 1) accepts nothing: [B, 2], its token and its input,
    without the accept column (two ops fewer a step, where the host's work is the cost)."""
    parts = [committed, verify_in] if committed.shape[1] == verify_in.shape[1] == 1 else [
        accept_length[:, None], committed, verify_in]
    return mx.concatenate([a if a.dtype == mx.int32 else a.astype(mx.int32) for a in parts], axis=1)


def read_outcome(outcome: mx.array, committed_width: int) -> Tuple[List[int], List[List[int]], List[List[int]]]:
    """(accept lengths [B], committed rows, verify-input rows) of an evaluated `pack_outcome`."""
    rows = outcome.tolist()
    if outcome.shape[1] == 2:  # a plain step's: no accept column (a verify's has 3 or more)
        return [0] * len(rows), [r[:1] for r in rows], [r[1:] for r in rows]
    return ([r[0] for r in rows], [r[1 : 1 + committed_width] for r in rows],
            [r[1 + committed_width :] for r in rows])


def synced_acceptance(accept_length: mx.array, committed: mx.array, unsure, exact_again: Callable[[], tuple],
                      verify_in: mx.array, outcome: Optional[mx.array] = None):
    """The cycle's host sync and its one read: `outcome` (`pack_outcome` of the three, made here
    when not given) evaluated, and where a `take_unsure` flag of theirs is set (raw argmaxes that
    may differ from the exact ones, rare), `exact_again()`'s acceptance instead. `unsure`: the
    flags taken, None where none was. Returns (accept_length, committed, `read_outcome`'s lists)."""
    flags = [u for u in unsure if u is not None]
    if outcome is None:
        outcome = pack_outcome(accept_length, committed, verify_in)
    if flags:  # (else the read evaluates it)
        mx.eval(outcome, *flags)
    if any(u.item() for u in flags):
        accept_length, committed = exact_again()
        outcome = pack_outcome(accept_length, committed, verify_in)
        mx.eval(outcome)
    return accept_length, committed, read_outcome(outcome, committed.shape[1])


# Below these, sampling is greedy in the limit, and float32 cannot scale logits by 1/T
# (inf, then NaN) nor hold the top-p mass (0): they are greedy.
GREEDY_BELOW_TEMPERATURE = 1e-5
GREEDY_BELOW_TOP_P = 1e-6


def make_acceptor(temperature: float = 0.0, **sampling):
    """GreedyAcceptor at temperature 0 (or top_k 1, or a vanishing temperature or top-p: the
    greedy limit), else SamplingAcceptor. Under XTC (`sampling["xtc"]`) a vanishing temperature and
    top_k 1 are not greedy (they take the likeliest token XTC leaves, which its coin may not be the
    likeliest one): only temperature 0 (mlx-lm's greedy sampler, no XTC) and a vanishing top-p (it
    leaves one token, which XTC keeps) are."""
    top_p = sampling.get("top_p")
    if temperature == 0 or (top_p is not None and top_p < GREEDY_BELOW_TOP_P):
        return GreedyAcceptor()
    if sampling.get("xtc") is None and (temperature < GREEDY_BELOW_TEMPERATURE or sampling.get("top_k") == 1):
        return GreedyAcceptor()
    return SamplingAcceptor(temperature=temperature, **sampling)
