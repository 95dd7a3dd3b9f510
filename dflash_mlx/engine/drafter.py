"""Drafters: what a cycle asks of the draft.

`DraftContext` is a draft with its context cache (held by a row's `PromptCache`), and
`PlainDecoding` the null drafter of plain decoding at width 1; `propose_rows` drafts the
blocks of a batch's drafting rows in one forward where the draft can.
"""

from typing import List, Optional, Sequence

import mlx.core as mx

from dflash_mlx.engine.prompt_cache import PromptCache
from dflash_mlx.speculation.accept import Proposal


class PlainDecoding:
    """The null drafter: no draft, so every cycle is a one-token target step."""

    draft = None
    layer_ids: List[int] = []
    fuse = None

    def absorb(self, features):
        pass

    def keep(self, features):
        pass

    def unkeep(self, rows: int):
        pass


class DraftContext:
    """A draft and its context cache (held by the prompt cache) as the cycles use them.

    Features of committed positions wait in `state.pending` until the next draft
    forward absorbs them, so a width-1 cycle runs no draft computation at all.
    """

    # Past this many waiting positions they are absorbed anyway, which bounds the
    # lazy graph a long stretch of width-1 cycles would otherwise build up.
    MAX_PENDING = 64

    def __init__(self, draft, state: PromptCache):
        self.draft = draft
        self.state = state
        self.layer_ids = list(draft.config.target_layer_ids)
        # a split target may send the taps' share of the draft's fc instead of the taps
        self.fuse = getattr(draft, "fused_taps", lambda: None)()

    def take_pending(self) -> Optional[mx.array]:
        """The features waiting for the next draft forward, handed over (none wait after)."""
        pending, self.state.pending = self.state.pending, None
        return pending

    def absorb(self, features: Optional[mx.array]):
        """Inject features now (prefill), after whatever was waiting."""
        pending = self.take_pending()
        if pending is not None:
            self.draft.inject(pending, self.state.draft_cache)
        self.draft.inject(features, self.state.draft_cache)

    def keep(self, features: mx.array):
        pending = self.state.pending
        self.state.pending = features if pending is None else mx.concatenate([pending, features], axis=1)
        if self.state.pending.shape[1] > self.MAX_PENDING:
            self.absorb(None)

    def unkeep(self, rows: int):
        """Take back the newest `rows` positions kept (a cycle queued before its read guessed they
        would stay): from the features waiting, or, once a draft forward absorbed them, from the
        context cache (a sliding layer holds `ContextCache.TRIM_SLACK` entries past its window for this)."""
        if rows <= 0:
            return
        pending = self.state.pending
        if pending is not None:
            self.state.pending = pending[:, :-rows] if pending.shape[1] > rows else None
        else:
            for c in self.state.draft_cache:
                c.trim(rows)

    def draft_logits(self, last: mx.array, width: int) -> mx.array:
        """The draft's logits [1, width - 1, V_draft] for the block after `last`."""
        return self.draft.propose_logits(last, self.take_pending(), self.state.draft_cache, width)

    def propose(self, last: mx.array, width: int, acceptor) -> Proposal:
        chain = getattr(self.draft, "propose_chain", None)
        if chain is None:
            return acceptor.propose(self.draft, self.draft_logits(last, width))
        chosen = []  # (an autoregressive draft: each token the acceptor chooses is the next one it runs)

        def choose(logits):  # [B, V] -> [B]
            chosen.append(acceptor.propose(self.draft, logits[:, None]))
            return chosen[-1].tokens[:, 0]

        chain(last, self.take_pending(), self.state.draft_cache, width, choose)
        return Proposal.joined(chosen)


def propose_rows(drafters: Sequence[DraftContext], lasts: Sequence[mx.array], width: int,
                 acceptors: Sequence) -> List[Proposal]:
    """Each row's proposal for a verify of `width` (a batch's drafting rows, same draft): one
    draft forward for them all where the draft batches rows of different contexts
    (`propose_logits_rows`), else a forward per row. Per row on a CPU, the draft's small
    matmuls cost about as much for one row as for eight."""
    draft = drafters[0].draft
    caches = [d.state.draft_cache for d in drafters]
    if len(drafters) < 2 or not getattr(draft, "batches_rows", lambda c: False)(caches):
        return [d.propose(last, width, a) for d, last, a in zip(drafters, lasts, acceptors)]
    # [B, width - 1, V_draft]
    logits = draft.propose_logits_rows(lasts, [d.take_pending() for d in drafters], caches, width)
    return [a.propose(draft, logits[b : b + 1]) for b, a in enumerate(acceptors)]
