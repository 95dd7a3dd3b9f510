"""The engine: one answer or many at once, continuous batching with DFlash.

A row that decodes alone runs `cycle.cycle` on its own caches (token trees, copy
proposals, a split LM head): every `stream_generate` call is this batch-of-one case.
With two rows or more, `BatchEngine` advances every decoding row together, one target
forward per cycle; when the batch is down to one row again, that row's caches are
extracted back and it goes on alone. Each batched cycle, at a width chosen for
the batch (`BatchWidths`), every row's draft proposes its own block from its own
context, the target verifies all rows' blocks in one forward (B x width rows), every
row accepts its own length with its own acceptor (greedy or its own sampling), and
every row's caches drop what that row rejected:

- the target's attention KV lives in mlx-lm's `BatchKVCache` (rows left-padded to one
  write index); a row that rejected more than the others moves its entries right and
  grows its left padding (`rollback.rollback_batch_rows`), so no row ever sees a
  rejected position and the next tokens of every row sit at its own true positions;
- each row keeps its own draft context cache and pending features (a `PromptCache` per
  row, as one `stream_generate` call has): the draft needs no rollback.

Requests join between cycles: a joining request's prompt is prefilled in its own
caches a chunk at a time, up to a budget of prompt tokens per cycle shared first come
first served (`cycle.prefill_chunks`), reusing whatever prefix its `PromptCache`
holds, then merged into the batch; a finished or cancelled row leaves at
once and its KV goes back to its `PromptCache` (for a later request's prefix).

Which targets batch, how rows' caches become a batch's and how a batch rolls back per row:
`batch_caches`.

Proposals in batched cycles: each row verifies its draft's chain or, with `auto`, a copy of
its own context (`copy_proposals.BatchCopyPolicy` picks the batch's width from every row's
expected tokens per second of a verify of that many rows; a copying row runs no draft
forward; the drafting rows share one draft forward, `cycle.propose_rows`). Token trees are
a lone row's: at one row they are about neutral on the CPU measured here, and at 4-8 rows
the width policy settles on width 1, where a tree has no room.
"""

import copy
import time
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_mlx.speculation.accept import GreedyAcceptor, Proposal, make_acceptor
from dflash_mlx.policy.sizer import BlockSizer, FixedWidth, sizer_for
from dflash_mlx.engine.batch_caches import batch_support, extend_rows, for_forward, mask_head_axis, merge_rows, rollback_rows
from dflash_mlx.speculation.copies import batch_copy_policy_for, copy_policy_for
from dflash_mlx.engine.cycle import (DraftContext, HeadRows, NoTimer, PhaseTimer, PlainDecoding, cycle, prefill_chunks,
                              propose_rows, stop_ids)
from dflash_mlx.options import AUTO, GenerationOptions, fixed_width
from dflash_mlx.engine.prompt_cache import PromptCache, make_prompt_cache
from dflash_mlx.engine.responses import Answer, DFlashResponse, Step, committed_span, first_step, token_logprobs
from dflash_mlx.models.target.rollback import UnsupportedTargetError, in_temporal_order, sub_caches
from dflash_mlx.models.target.adapter import Target, target_for
from dflash_mlx.speculation.tree import tree_policy_for, tree_support


def _copy_proposal(continuation: List[int], n: int, width: int) -> Proposal:
    """A row's copy of `n` tokens in a verify of `width`: the tokens after the copy (when the
    batch is wider) repeat its last one; a deterministic proposal, exact at every temperature."""
    tokens = continuation[:n] + [continuation[n - 1]] * (width - 1 - n)
    return Proposal(mx.array([tokens], dtype=mx.int32))


@dataclass
class BatchRequest:
    """One answer asked of the engine. `options.block_size` is not used (the batch's width
    policy decides); `prompt_cache`: caches whose prefix the prompt may reuse (else new)."""

    prompt_ids: List[int]
    options: GenerationOptions
    stop_token_ids: Sequence[int] = ()
    logprobs: Optional[int] = None
    prompt_cache: Optional[PromptCache] = None


class Row:
    """A request in the engine: joining (its prompt being prefilled), decoding, or done."""

    def __init__(self, uid: int, request: BatchRequest, engine: "BatchEngine"):
        self.uid = uid
        self.request = request
        opts = request.options
        # a recurrent state cannot be trimmed back to a shared prefix: the end of the prompt is
        # kept as a snapshot, which a next turn that starts with this prompt restores
        self.state = request.prompt_cache or make_prompt_cache(engine.model, engine.draft,
                                                               max_snapshots=1 if engine.target.recurrent else 0)
        self.drafter = DraftContext(engine.draft, self.state) if engine.draft is not None else PlainDecoding()
        self.acceptor = make_acceptor(opts.temperature, top_p=opts.top_p, top_k=opts.top_k, min_p=opts.min_p,
                                      draft_sampling=opts.draft_sampling)
        # copies and trees ride on the pair's own sizer (bucket 1), as in every single-sequence
        # call; trees only while the row decodes alone (`cycle.cycle`)
        self.head_rows = HeadRows(split=mx.default_device() == mx.cpu if engine.split_head is None
                                  else engine.split_head)
        sizer = engine.widths.sizer(1) if engine.widths is not None and engine.draft is not None else None
        self.copies = copy_policy_for(sizer) if sizer is not None and engine.copy_proposals else None
        self.trees = (tree_policy_for(sizer) if sizer is not None and engine.token_trees
                      and tree_support(engine.target) is None else None)
        self.index = None  # the context's copy index (`context_index`), kept up to date by every cycle
        self.stops = stop_ids(engine.tokenizer, request.stop_token_ids)
        max_tokens = opts.max_tokens
        if engine.target.max_context:
            max_tokens = min(max_tokens, engine.target.max_context - len(request.prompt_ids))
        self.budget = max_tokens
        self.first_logits: Optional[list] = [] if request.logprobs is not None else None
        self._prefill = prefill_chunks(engine.target, self.drafter, self.acceptor, self.state, request.prompt_ids,
                                       engine.prefill_chunk, self.first_logits)
        self.queued_at = time.perf_counter()
        self.started: Optional[float] = None
        self.last: Optional[mx.array] = None  # [1] the last committed token
        self.answer: Optional[Answer] = None
        self.done = False

    def context_index(self):
        """The index copies match against (made on first use, from the prompt cache's)."""
        if self.index is None:
            self.index = self.state.context_index(int(self.last.item()))
        return self.index


class BatchWidths:
    """Verify width per cycle for a batch: one `BlockSizer` per batch size bucket (1, 2, 3-4,
    5-8, ...), keyed on decoding rows only. At B rows a cycle verifies B x width rows, so what
    pays at one row can lose at eight: each bucket learns its own cycle times (acceptance is
    the draft's and is observed from every row). The key moves to a new bucket only after
    `hold` cycles there, so rows joining and leaving do not flip the width every cycle.
    Bucket 1 is the target/draft pair's own sizer (`sizer_for`), shared with `stream_generate`."""

    def __init__(self, model, draft, hold: int = 4):
        self.model, self.draft = model, draft
        self.hold = hold
        self.sizers: Dict[int, BlockSizer] = {}
        self.key: Optional[int] = None
        self._candidate: Optional[int] = None
        self._seen = 0
        self.current: Optional[BlockSizer] = None
        self.chosen: Dict[int, Dict[int, int]] = {}  # bucket -> width -> cycles

    @staticmethod
    def bucket(rows: int) -> int:
        b = 1
        while b < rows:
            b *= 2
        return b

    def sizer(self, bucket: int) -> BlockSizer:
        if bucket not in self.sizers:
            # A probe (a drafted cycle while width 1 wins) costs every row a draft forward and
            # doubles the verify's rows: in big batches probes are rarer.
            self.sizers[bucket] = (sizer_for(self.model, self.draft) if bucket == 1
                                   else BlockSizer(self.draft.block_size, probe_every=8 * bucket,
                                                   max_probe_every=32 * bucket))
        return self.sizers[bucket]

    def choose(self, rows: int, remaining: int, context: int) -> int:
        """`context`: the longest row's context (every row's verify attends that far, padded)."""
        bucket = self.bucket(rows)
        if self.key is None:
            self.key = bucket
        elif bucket == self.key:
            self._candidate, self._seen = None, 0
        else:
            self._seen = self._seen + 1 if bucket == self._candidate else 1
            self._candidate = bucket
            if self._seen >= self.hold:
                self.key, self._candidate, self._seen = bucket, None, 0
        self.current = self.sizer(self.key)
        self.current.trees_on = False  # batch cycles verify chains
        self.current.at_context(context)
        return self.current.choose(remaining)

    def count(self, bucket: int, width: int):
        """A cycle of `width` at batch size `bucket`, for `chosen` (what /health reports)."""
        counts = self.chosen.setdefault(bucket, {})
        counts[width] = counts.get(width, 0) + 1

    def update(self, width: int, accept_lengths: Sequence[int], seconds: Optional[float]):
        """`accept_lengths`: of the rows that verified the draft's chain; `seconds`: the
        cycle's time, None when rows verified copies instead (a cycle cheaper than a drafted
        one of its width: it must not price the width)."""
        if seconds is None:
            for a in accept_lengths:
                self.current.observe(width, a)
            return
        for a in accept_lengths[1:]:
            self.current.observe(width, a)
        self.current.update(width, accept_lengths[0] if accept_lengths else 0, seconds, chain=bool(accept_lengths))


class BatchEngine:
    """Rows decode together; requests join and leave between cycles. Single-threaded: the
    caller (the server's worker thread) calls `add`, `remove` and `step`."""

    def __init__(self, model, draft, tokenizer, max_batch: int = 8, prefill_chunk: int = 256,
                 prefill_budget: int = 512, block_size=AUTO, target: Optional[Target] = None,
                 copy_proposals: bool = True, token_trees: bool = True, split_head: Optional[bool] = None,
                 profile: bool = False, snapshot_prompts: bool = True):
        """`prefill_chunk`: prompt tokens per prefill forward; `prefill_budget`: prompt tokens
        run per step before the decoding rows' cycle (joining requests' time to first token
        against the running rows' pace). A row decoding alone runs `cycle.cycle` on its own
        caches, where `copy_proposals`, `token_trees` and `split_head` apply as in
        `stream_generate`; `profile`: phase times in its steps (from a copy of the width policy).
        `snapshot_prompts`: a recurrent target's prompt end is kept as a snapshot (the next
        turn's prefix). `target`: the adapter to use (default: the one `draft` is bound to)."""
        self.model, self.draft, self.tokenizer = model, draft, tokenizer
        self.target = target if target is not None else target_for(model, draft)
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_batch > 1:
            reason = batch_support(self.target)
            if reason is not None:
                raise UnsupportedTargetError(f"{self.target.name} cannot be batched: {reason}")
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.prefill_budget = prefill_budget
        self.copy_proposals, self.token_trees, self.split_head = copy_proposals, token_trees, split_head
        self.snapshot_prompts = snapshot_prompts
        width = fixed_width(block_size, draft.block_size) if draft is not None else 1
        self.widths = BatchWidths(model, draft) if width is None else None
        if self.widths is not None and profile:
            # profiling syncs at every phase: its cycle times must not teach the shared policy
            self.widths.sizers[1] = copy.deepcopy(sizer_for(model, draft))  # copies and trees come along
        self.fixed = FixedWidth(width) if width is not None else None
        # copies in batched cycles (with `auto`, as a lone row's): their acceptance is the lone rows'
        self.batch_copies = (batch_copy_policy_for(self.widths.sizer(1))
                             if self.widths is not None and draft is not None and copy_proposals else None)
        self.timer = PhaseTimer() if profile else NoTimer()
        self.rows: List[Row] = []  # decoding, in the order of the batch caches' rows
        self.joining: Deque[Row] = deque()
        # per layer: a lone row's own caches, or the batch's (BatchKVCache, BatchRotatingKVCache,
        # ArraysCache) while two rows or more decode (`batched`)
        self.cache: Optional[List] = None
        self.kinds = self.target.rollback_kinds()
        self.head_axis = max_batch > 1 and mask_head_axis(self.target)
        self._uid = 0
        self.cycles = 0

    # -- admission

    @property
    def room(self) -> int:
        return self.max_batch - len(self.rows) - len(self.joining)

    @property
    def batched(self) -> bool:
        """Whether `cache` holds a batch's caches (else a lone row's own, or none)."""
        return len(self.rows) > 1

    @property
    def idle(self) -> bool:
        return not self.rows and not self.joining

    def add(self, request: BatchRequest) -> Row:
        if not request.prompt_ids:
            raise ValueError("the prompt is empty: give at least one token of input")
        if self.target.max_context and len(request.prompt_ids) >= self.target.max_context:
            raise ValueError(f"the prompt has {len(request.prompt_ids)} tokens but {self.target.name} has a "
                             f"context window of {self.target.max_context} tokens: shorten the prompt")
        self._uid += 1
        row = Row(self._uid, request, self)
        self.joining.append(row)
        return row

    def remove(self, row: Row):
        """End a row now (finished or cancelled); its caches go back to its `PromptCache`."""
        if row.done:
            return
        row.done = True
        if row in self.joining:
            self.joining.remove(row)
            row._prefill.close()
            row.state.valid = False  # a prefill cut short: nothing of it may be reused
            return
        self._leave([row])

    def _leave(self, rows: List[Row]):
        if not self.batched:  # the lone row: its caches are its PromptCache's already
            self.rows, self.cache = [], None
            return
        idx = [self.rows.index(r) for r in rows]
        for r, b in zip(rows, idx):
            r.state.target_cache = [c.extract(b) for c in self.cache]
            r.state.valid = True
        keep = [b for b in range(len(self.rows)) if b not in idx]
        self.rows = [self.rows[b] for b in keep]
        if keep:
            for c in self.cache:
                c.filter(keep)
        else:
            self.cache = None
        if len(self.rows) == 1:  # alone again: back on its own caches, for trees and copies
            alone = self.rows[0]
            alone.state.target_cache = self.cache = [c.extract(0) for c in self.cache]

    def _join(self, row: Row):
        if not self.rows:  # alone: the row decodes on its PromptCache's own caches
            self.cache = row.state.target_cache
        else:
            if not self.batched:
                alone = self.rows[0]
                self.cache = merge_rows([self.cache])
                alone.state.target_cache, alone.state.valid = [], False  # the batch holds it now
            extend_rows(self.cache, row.state.target_cache)
            row.state.target_cache, row.state.valid = [], False
        self.rows.append(row)

    # -- one cycle

    def step(self) -> List[Tuple[Row, DFlashResponse]]:
        """`prefill_step`, then `decode_step`: every row's response of this step."""
        return self.prefill_step() + self.decode_step()

    def prefill_step(self) -> List[Tuple[Row, DFlashResponse]]:
        """Prefill chunks of joining requests, first come first served, up to `prefill_budget`
        tokens; the first response of each request whose prompt is done (it joins the batch)."""
        events = []
        budget = self.prefill_budget
        while self.joining and budget > 0:
            spent, joined = self._prefill_step(self.joining[0])
            budget -= spent
            events += joined
        return events

    def decode_step(self) -> List[Tuple[Row, DFlashResponse]]:
        """One cycle of every decoding row: each row's response (rows that end leave)."""
        return self._cycle() if self.rows else []

    def _prefill_step(self, row: Row) -> Tuple[int, List[Tuple[Row, DFlashResponse]]]:
        """One chunk of `row`'s prefill: (tokens run, [its first response] when it was the last)."""
        if row.started is None:
            row.started = time.perf_counter()
            if row.request.options.seed is not None:
                # as stream_generate does; the random stream is the batch's, so a seed reproduces
                # a sampled answer only for a row that runs alone (at a fixed width)
                mx.random.seed(row.request.options.seed)
        try:
            return next(row._prefill), []
        except StopIteration as done:
            last, prefilled = done.value
        self.joining.popleft()
        row.last = last
        row.answer = Answer(self.tokenizer, len(row.request.prompt_ids), prefilled,
                            time.perf_counter() - row.started)
        first = int(last.item())
        step = first_step(first, row.stops, row.budget, row.first_logits[0] if row.first_logits else None,
                          row.request.logprobs)
        row.budget -= 1
        if self.target.recurrent and self.snapshot_prompts:
            row.state.snapshot()
        if step.finish is None:
            self._join(row)
        else:
            row.done = True
        ran = (prefilled - 1) % self.prefill_chunk + 1 if prefilled else 1  # the last chunk's tokens
        return ran, [(row, row.answer.response(step, first=True))]

    def _cycle_alone(self, row: Row) -> List[Tuple[Row, DFlashResponse]]:
        """A lone row's cycle on its own caches: `cycle.cycle`, with copies and trees."""
        if self.widths is not None:
            widths = self.widths.sizer(1)
            widths.trees_on = row.trees is not None
        else:
            widths = self.fixed
        index = row.context_index() if row.copies is not None else None
        step, row.last = cycle(self.target, row.drafter, row.acceptor, widths, row.state, row.last, row.budget,
                               row.stops, self.timer, row.head_rows, row.request.logprobs, row.copies, index,
                               row.trees)
        row.budget -= len(step.tokens)
        self.cycles += 1
        if self.widths is not None:  # reported with the batch's widths, under batch size 1
            self.widths.count(1, step.width)
        if step.finish is not None:
            row.done = True
            self._leave([row])
        return [(row, row.answer.response(step))]

    def _copies(self, width: int, context: int) -> Tuple[int, List[int], List]:
        """This batched cycle's width and copy tokens per row (0: the row drafts), with each
        row's match (`BatchCopyPolicy`); the draft's width and no copies when copies are off."""
        rows = self.rows
        if self.batch_copies is None or not any(r.copies is not None for r in rows):
            return width, [0] * len(rows), [None] * len(rows)
        matches = [r.context_index().match(self.batch_copies.max_length) if r.copies is not None else None
                   for r in rows]
        policy, sizer, lone = self.batch_copies, self.widths.current, self.widths.sizer(1)
        policy.at_context(context)
        lone.at_context(context)
        policy.seed({w: t * lone.load for w, t in lone.times.items()})
        width, copied = policy.plan(matches, [r.budget for r in rows], width, sizer.chain_tokens)
        return width, copied, matches

    def _cycle(self) -> List[Tuple[Row, DFlashResponse]]:
        rows = self.rows
        if not self.batched:
            return self._cycle_alone(rows[0])
        remaining = max(r.budget for r in rows)
        context = max(len(r.state.tokens) for r in rows)
        width = (self.widths.choose(len(rows), remaining, context) if self.widths is not None
                 else self.fixed.choose(remaining))
        width, copied, matches = self._copies(width, context)
        if self.widths is not None:
            self.widths.count(self.widths.key, width)
        t0 = time.perf_counter()
        for r in rows:
            r.state.valid = False
        with mx.stream(generation_stream):
            lasts = [r.last[:, None] for r in rows]
            proposals = [_copy_proposal(m.continuation, c, width) if c else None for m, c in zip(matches, copied)]
            drafting = [b for b, c in enumerate(copied) if not c] if width > 1 else []
            if drafting:
                drafted = propose_rows([rows[b].drafter for b in drafting], [rows[b].last for b in drafting], width,
                                       [rows[b].acceptor for b in drafting])
                for b, p in zip(drafting, drafted):
                    proposals[b] = p
            verify_in = mx.concatenate(
                [mx.concatenate([l, p.tokens], axis=1) if p is not None else l for l, p in zip(lasts, proposals)],
                axis=0)  # [B, width]
            mx.async_eval(verify_in)
            layer_ids = rows[0].drafter.layer_ids
            if width > 1:
                for c in self.cache:
                    for sub in sub_caches(c):
                        in_temporal_order(sub)
            h, feats, record = self.target.forward(verify_in, for_forward(self.cache, self.kinds, self.head_axis),
                                                   layer_ids, record=width > 1)
            logits = self.target.logits(h)  # [B, width, V]
            if all(isinstance(r.acceptor, GreedyAcceptor) for r in rows):  # one acceptance for the batch
                accept_len, committed = rows[0].acceptor.accept(
                    Proposal(verify_in[:, 1:]) if width > 1 else None, logits, self.draft)
            else:  # each row with its own sampling
                each = [r.acceptor.accept(p, logits[b : b + 1], self.draft)
                        for b, (r, p) in enumerate(zip(rows, proposals))]
                accept_len = mx.concatenate([a for a, _ in each])
                committed = mx.concatenate([c[:, :width] for _, c in each])
        mx.eval(verify_in, accept_len, committed)  # the cycle's host sync
        seconds = time.perf_counter() - t0
        fed, accept_lens, chosen = verify_in.tolist(), accept_len.tolist(), committed.tolist()
        accepts, rejected, steps = [], [], []
        for b, r in enumerate(rows):
            a = accept_lens[b]
            tokens = chosen[b][: a + 1]
            kept, finish = committed_span(tokens, r.stops, r.budget)
            lps = (token_logprobs(logits[b, :kept], tokens[:kept], r.request.logprobs)
                   if r.request.logprobs is not None else None)
            accepts.append(a)
            rejected.append(width - kept)
            steps.append(Step(tokens[:kept], [i < a for i in range(kept)], finish, min(kept, a), width,
                              logprobs=lps, proposal="copy" if copied[b] else "draft" if width > 1 else None))
            r.last = committed[b : b + 1, a]
            r.budget -= kept
            r.state.tokens.extend(fed[b][:kept])
            if r.index is not None:
                r.index.extend(tokens[:kept])
            if copied[b]:
                self.batch_copies.record.update(matches[b].length, copied[b], min(a, copied[b]))
        with mx.stream(generation_stream):
            rollback_rows(self.cache, self.kinds, record, width, rejected)
            if feats is not None:
                for b, r in enumerate(rows):
                    r.drafter.keep(feats[b : b + 1, : width - rejected[b]])
        self.cycles += 1
        if self.widths is not None:
            # (a cycle's rollback runs lazily in the next cycle's graph, and is timed there)
            self.widths.update(width, [a for a, c in zip(accepts, copied) if not c], None if any(copied) else seconds)
            if self.batch_copies is not None:
                self.batch_copies.update(len(rows) * width, seconds)
        events = [(r, r.answer.response(s)) for r, s in zip(rows, steps)]
        ended = [r for r, s in zip(rows, steps) if s.finish is not None]
        for r in ended:
            r.done = True
        if ended:
            self._leave(ended)
        return events

    # -- reporting

    def stats(self) -> dict:
        return {
            "rows": len(self.rows),
            "joining": len(self.joining),
            "max_batch": self.max_batch,
            "cycles": self.cycles,
            "widths": ({str(k): {str(w): n for w, n in sorted(v.items())} for k, v in sorted(self.widths.chosen.items())}
                       if self.widths is not None else {"fixed": self.fixed.width}),
            "width_key": self.widths.key if self.widths is not None else None,
        }
