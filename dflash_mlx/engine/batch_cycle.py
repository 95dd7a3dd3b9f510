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

A cycle is planned (`plan_batch`), launched (`launch_batch`: draft, verify and acceptance queued
as one lazy graph) and landed (`land_batch`: the one host sync, the commits, the rollback). The
engine launches the next one before it builds a step's responses; where the batch's rows change
first, `discard_batch` takes every row's verify rows back out of the caches.
"""

import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_mlx.engine.batch_caches import for_forward, rollback_rows
from dflash_mlx.engine.cycle import copy_kind
from dflash_mlx.engine.drafter import propose_rows
from dflash_mlx.engine.responses import Step
from dflash_mlx.engine.rows import Row
from dflash_mlx.engine.timing import launched_seconds
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.models.target.rollback import in_temporal_order, sub_caches
from dflash_mlx.models.target.windows import restore_windows
from dflash_mlx.speculation.accept import GreedyAcceptor, Proposal, pack_outcome, synced_acceptance
from dflash_mlx.speculation.copies import CopyMatch
from dflash_mlx.speculation.processors import process_batch, process_prior


def _copy_proposal(continuation: List[int], n: int, width: int) -> Proposal:
    """A row's copy of `n` tokens in a verify of `width`: the tokens after the copy (when the
    batch is wider) repeat its last one; a deterministic proposal, exact at every temperature."""
    tokens = continuation[:n] + [continuation[n - 1]] * (width - 1 - n)
    return Proposal(mx.array([tokens], dtype=mx.int32))


def plan_batch(target: Target, rows: Sequence[Row], widths, fixed, batch_copies) -> Tuple[int, List[int], List]:
    """A batched cycle's width and copy tokens per row (0: the row drafts), with each row's match:
    the batch's width policy's choice (`widths`, or `fixed` where the width is fixed), then the rows'
    copies (`batch_copies`, `BatchCopyPolicy`, picks the batch's width from every row's expected tokens
    per second of a verify of that many rows; none when copies are off)."""
    # every row's verify rows stay within its position limit (`Target.verify_room`)
    room = min(target.verify_room(len(r.state.tokens)) for r in rows)
    remaining = min(max(r.budget for r in rows), room)
    context = max(len(r.state.tokens) for r in rows)
    width = widths.choose(len(rows), remaining, context) if widths is not None else fixed.choose(remaining)
    if batch_copies is None or not any(r.copies is not None for r in rows):
        return width, [0] * len(rows), [None] * len(rows)
    sizer, lone = widths.current, widths.sizer(1)
    budgets = [min(r.budget, room) for r in rows]
    matches = [batch_copies.pick(r.copy_matches(batch_copies.max_length), b) if r.copies is not None else None
               for r, b in zip(rows, budgets)]
    batch_copies.at_context(context)
    lone.at_context(context)
    batch_copies.seed({w: t * lone.load for w, t in lone.times.items()})
    width, copied = batch_copies.plan(matches, budgets, width, sizer.chain_tokens)
    return width, copied, matches


@dataclass
class BatchLaunched:
    """A batched cycle whose graph is queued (`launch_batch`): what landing it reads. Launched ahead
    (`engine.BatchEngine`), it holds the batch's caches until it lands or is discarded."""

    rows: List[Row]  # the rows it verifies, in the batch caches' order
    width: int
    copied: List[int]
    matches: List[Optional[CopyMatch]]
    proposals: List[Optional[Proposal]]
    verify_in: mx.array  # [B, width]
    feats: Optional[mx.array]
    record: Any
    logits: mx.array  # [B, width, V]
    accept_len: mx.array
    committed: mx.array
    unsure: List[Optional[mx.array]]
    outcome: mx.array  # [B, 1 + width + width]: accept lengths, committed and verify_in, packed for one host read
    started: float
    built: float = 0.0
    queued: float = 0.0  # launched ahead: when its graph went to the device
    landing: Optional[float] = None  # when the next step took it (launched ahead)
    kept_early: bool = False  # the draft kept its features before the read (a plain step queued behind it)
    windows: Any = None  # sliding windows as they were before it, for a discard (`models.target.windows`)
    redone: bool = False  # once landed: whether the exact acceptance replaced the raw one

    seconds = launched_seconds


def launch_batch(target: Target, draft, rows: Sequence[Row], cache: List, kinds, head_axis: bool, width: int,
                 copied: Sequence[int], matches: Sequence[Optional[CopyMatch]],
                 lasts: Optional[List[mx.array]] = None, unread: Optional[mx.array] = None) -> BatchLaunched:
    """Queue one cycle of `rows` (two or more, decoding on the batch's caches `cache`, whose rollback
    `kinds` the engine read) at `width`: row b verifies a copy of `copied[b]` tokens of
    `matches[b]`, or (0) its draft's block (with no draft, its last token repeated: it commits
    one token, as a plain step). `lasts`: each row's last token [1] where not yet its `Row.last` (a
    cycle queued before the one before it is read), and `unread` [B, k] the tokens that one fed, not yet
    in the rows' `state.tokens`. Draft, verify forward and acceptance, no host sync."""
    started = time.perf_counter()
    for r in rows:
        r.state.valid = False
    lasts = [r.last for r in rows] if lasts is None else lasts
    with mx.stream(generation_stream):
        lasts = [last[:, None] for last in lasts]
        proposals = [_copy_proposal(m.continuation, c, width) if c else None for m, c in zip(matches, copied)]
        drafting = [b for b, c in enumerate(copied) if not c] if width > 1 else []
        if drafting and draft is None:  # no draft: a row without a copy verifies its last token repeated
            for b in drafting:
                proposals[b] = Proposal(mx.repeat(lasts[b], width - 1, axis=1))
        elif drafting:
            drafted = propose_rows([rows[b].drafter for b in drafting], [lasts[b][:, 0] for b in drafting], width,
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
        if any(r.processors for r in rows):  # (each row after its own tokens: `speculation.processors`)
            logits = process_batch([r.processors for r in rows],
                                   [process_prior(r.processors, r.state.history, None if unread is None else unread[b])
                                    for b, r in enumerate(rows)], verify_in, logits)
        acceptors = [r.acceptor for r in rows]
        accept_len, committed = _accept(acceptors, proposals, verify_in, logits, width, draft)
        unsure = [a.take_unsure() for a in acceptors]
        # (packed now, in the cycle's own graph: packed when it lands, behind a cycle queued after it, its read
        # would wait for that one too)
        outcome = pack_outcome(accept_len, committed, verify_in)
    return BatchLaunched(list(rows), width, list(copied), list(matches), proposals, verify_in, feats, record, logits,
                         accept_len, committed, unsure, outcome, started, built=time.perf_counter())


def land_batch(launched: BatchLaunched, cache: List, kinds, draft) -> Tuple[List[Step], List[int], float]:
    """The cycle's one host sync and read, then every row's commit and the caches' rollback:
    (each row's step, each row's accept length, the cycle's seconds for the policies)."""
    rows, width, logits, proposals = launched.rows, launched.width, launched.logits, launched.proposals
    acceptors = [r.acceptor for r in rows]

    def exact_again():
        with mx.stream(generation_stream):
            return _accept([a.exact() for a in acceptors], proposals, launched.verify_in, logits, width, draft)

    accept_len, committed, (accepts, chosen, fed) = synced_acceptance(
        launched.accept_len, launched.committed, launched.unsure, exact_again, launched.verify_in, launched.outcome)
    launched.redone = accept_len is not launched.accept_len
    seconds = launched.seconds()  # (a split target's ranks learn rank 0's: engine.distributed)
    steps = [r.commit(chosen[b], fed[b], accepts[b], committed[b : b + 1, accepts[b]], width,
                      copy_kind(launched.matches[b]) if launched.copied[b]
                      else "draft" if width > 1 and draft is not None else None, logits[b])
             for b, r in enumerate(rows)]
    rejected = [width - len(s.tokens) for s in steps]
    with mx.stream(generation_stream):
        rollback_rows(cache, kinds, launched.record, width, rejected)
        if launched.feats is not None and not launched.kept_early:
            for b, r in enumerate(rows):
                r.drafter.keep(launched.feats[b : b + 1, : width - rejected[b]])
    return steps, accepts, seconds


def discard_batch(launched: BatchLaunched, cache: List, kinds):
    """Roll back a batched cycle launched ahead that will not land (a row joins or leaves first):
    every row's rows leave the caches whole (what its draft read stays: committed tokens' features), and
    sliding windows are put back as they were (`models.target.windows`)."""
    with mx.stream(generation_stream):
        rollback_rows(cache, kinds, launched.record, launched.width, [launched.width] * len(launched.rows))
    restore_windows(launched.windows)


def _accept(acceptors, proposals, verify_in, logits, width: int, draft):
    """(accept_len [B], committed [B, width]) of a batch's verify, one acceptance for greedy rows."""
    if all(isinstance(a, GreedyAcceptor) for a in acceptors):  # one acceptance for the batch
        return acceptors[0].accept(Proposal(verify_in[:, 1:]) if width > 1 else None, logits, draft)
    # each row with its own sampling
    each = [a.accept(p, logits[b : b + 1], draft) for b, (a, p) in enumerate(zip(acceptors, proposals))]
    return mx.concatenate([a for a, _ in each]), mx.concatenate([c[:, :width] for _, c in each])
