"""Acceptance: how many drafted tokens the target keeps, and the token it adds.

Everything stays in the MLX graph; the engine syncs once per cycle to read the
accept length. Greedy here; speculative sampling plugs in as another `Acceptor`.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx


@dataclass
class Proposal:
    """The draft's block: token ids [B, n] (target vocabulary) and, when sampling,
    the draft distribution q over the draft vocabulary [B, n, V_draft]."""

    tokens: mx.array
    draft_logits: Optional[mx.array] = None


class GreedyAcceptor:
    """temperature 0: accept the longest prefix where the draft equals the target's argmax."""

    def propose(self, draft, draft_logits: mx.array) -> Proposal:
        return Proposal(draft.to_target_ids(mx.argmax(draft_logits, axis=-1)))

    def first_token(self, logits: mx.array) -> mx.array:
        """logits [B, V] -> [B]"""
        return mx.argmax(logits, axis=-1)

    def accept(self, proposal: Optional[Proposal], logits: mx.array, draft=None):
        """logits: target logits [B, n+1, V] for [last, d1..dn].

        Returns (accept_length [B], committed [B, n+1]): committed[:, :a] are the
        accepted drafts, committed[:, a] is the target's own token (the bonus).
        """
        choice = mx.argmax(logits, axis=-1)
        if proposal is None or proposal.tokens.shape[1] == 0:
            return mx.zeros((logits.shape[0],), dtype=mx.int32), choice
        drafted = proposal.tokens
        matches = (drafted == choice[:, :-1]).astype(mx.int32)
        accept_length = mx.cumprod(matches, axis=1).sum(axis=1)
        # Past the first mismatch the target's choices are conditioned on wrong
        # tokens; position a of `choice` is the bonus, positions < a equal drafts.
        return accept_length, choice


def make_acceptor(temperature: float = 0.0, **sampling):
    if temperature <= 0 or sampling.get("top_k") == 1:
        return GreedyAcceptor()
    try:
        from dflash_mlx.sampling import SamplingAcceptor
    except ImportError:
        raise NotImplementedError("sampling at temperature > 0 is not available yet") from None
    return SamplingAcceptor(temperature=temperature, **sampling)
