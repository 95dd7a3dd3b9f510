"""One cycle of a batch's decoding rows: every row's block verified in one target forward.

At the width the engine chose for the batch, every row proposes its own block from its own
context: a copy of a span of its context (`policy.copies.BatchCopyPolicy` decides which rows
copy, and how much), or its draft's block (the drafting rows share one draft forward,
`drafter.propose_rows`). The target verifies all rows' blocks in one forward (B x width
rows), every row accepts its own length with its own acceptor (greedy or its own sampling),
commits what it accepted (`Row.commit`), and drops what it rejected:

- the target's attention KV lives in mlx-lm's `BatchKVCache` (rows left-padded to one
  write index); a row that rejected more than the others moves its entries right and
  grows its left padding (`rollback.rollback_batch_rows`), so no row ever sees a
  rejected position and the next tokens of every row sit at its own true positions;
  recurrent state rolls back per row as `batch_caches.rollback_rows` describes;
- each row keeps its own draft context cache and pending features (a `PromptCache` per
  row, as one `stream_generate` call has): the draft needs no rollback.
"""

import time
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_mlx.engine.batch_caches import for_forward, rollback_rows
from dflash_mlx.engine.cycle import copy_kind
from dflash_mlx.engine.drafter import propose_rows
from dflash_mlx.engine.responses import Step
from dflash_mlx.engine.rows import Row
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.models.target.rollback import in_temporal_order, sub_caches
from dflash_mlx.speculation.accept import GreedyAcceptor, Proposal, synced_acceptance
from dflash_mlx.speculation.copies import CopyMatch


def _copy_proposal(continuation: List[int], n: int, width: int) -> Proposal:
    """A row's copy of `n` tokens in a verify of `width`: the tokens after the copy (when the
    batch is wider) repeat its last one; a deterministic proposal, exact at every temperature."""
    tokens = continuation[:n] + [continuation[n - 1]] * (width - 1 - n)
    return Proposal(mx.array([tokens], dtype=mx.int32))


def batch_cycle(target: Target, draft, rows: Sequence[Row], cache: List, kinds, head_axis: bool, width: int,
                copied: Sequence[int], matches: Sequence[Optional[CopyMatch]]) -> Tuple[List[Step], List[int], float]:
    """One cycle of `rows` (two or more, decoding on the batch's caches `cache`, whose rollback
    `kinds` the engine read) at `width`: row b verifies a copy of `copied[b]` tokens of
    `matches[b]`, or (0) its draft's block (with no draft, its last token repeated: it commits
    one token, as a plain step). (each row's step, each row's accept length, the seconds to
    the cycle's one host sync.)"""
    t0 = time.perf_counter()
    for r in rows:
        r.state.valid = False
    with mx.stream(generation_stream):
        lasts = [r.last[:, None] for r in rows]
        proposals = [_copy_proposal(m.continuation, c, width) if c else None for m, c in zip(matches, copied)]
        drafting = [b for b, c in enumerate(copied) if not c] if width > 1 else []
        if drafting and draft is None:  # no draft: a row without a copy verifies its last token repeated
            for b in drafting:
                proposals[b] = Proposal(mx.repeat(rows[b].last[:, None], width - 1, axis=1))
        elif drafting:
            drafted = propose_rows([rows[b].drafter for b in drafting], [rows[b].last for b in drafting], width,
                                   [rows[b].acceptor for b in drafting])
            for b, p in zip(drafting, drafted):
                proposals[b] = p
        verify_in = mx.concatenate(
            [mx.concatenate([l, p.tokens], axis=1) if p is not None else l for l, p in zip(lasts, proposals)],
            axis=0)  # [B, width]
        mx.async_eval(verify_in)
        layer_ids, fuse = rows[0].drafter.layer_ids, rows[0].drafter.fuse
        if width > 1:
            for c in cache:
                for sub in sub_caches(c):
                    in_temporal_order(sub)
        h, feats, record = target.forward(verify_in, for_forward(cache, kinds, head_axis), layer_ids,
                                          record=width > 1, fuse=fuse)
        logits = target.logits(h)  # [B, width, V]
        acceptors = [r.acceptor for r in rows]
        accept_len, committed = _accept(acceptors, proposals, verify_in, logits, width, draft)
        unsure = [a.take_unsure() for a in acceptors]

    def exact_again():
        with mx.stream(generation_stream):
            return _accept([a.exact() for a in acceptors], proposals, verify_in, logits, width, draft)

    # the host sync, and its one read
    accept_len, committed, (accepts, chosen, fed) = synced_acceptance(accept_len, committed, unsure, exact_again,
                                                                      verify_in)
    seconds = time.perf_counter() - t0  # (a split target's ranks learn rank 0's: engine.distributed)
    steps = [r.commit(chosen[b], fed[b], accepts[b], committed[b : b + 1, accepts[b]], width,
                      copy_kind(matches[b]) if copied[b] else "draft" if width > 1 and draft is not None else None,
                      logits[b])
             for b, r in enumerate(rows)]
    rejected = [width - len(s.tokens) for s in steps]
    with mx.stream(generation_stream):
        rollback_rows(cache, kinds, record, width, rejected)
        if feats is not None:
            for b, r in enumerate(rows):
                r.drafter.keep(feats[b : b + 1, : width - rejected[b]])
    return steps, accepts, seconds


def _accept(acceptors, proposals, verify_in, logits, width: int, draft):
    """(accept_len [B], committed [B, width]) of a batch's verify, one acceptance for greedy rows."""
    if all(isinstance(a, GreedyAcceptor) for a in acceptors):  # one acceptance for the batch
        return acceptors[0].accept(Proposal(verify_in[:, 1:]) if width > 1 else None, logits, draft)
    # each row with its own sampling
    each = [a.accept(p, logits[b : b + 1], draft) for b, (a, p) in enumerate(zip(acceptors, proposals))]
    return mx.concatenate([a for a, _ in each]), mx.concatenate([c[:, :width] for _, c in each])
