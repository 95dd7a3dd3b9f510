"""The engine: one answer or many at once, continuous batching with DFlash.

A row that decodes alone runs `cycle.cycle` on its own caches (token trees, copy
proposals, a split LM head): every `stream_generate` call is this batch-of-one case.
With two rows or more, `BatchEngine` advances every decoding row together, one target
forward per cycle (`batch_cycle`); when the batch is down to one row again, that row's
caches are extracted back and it goes on alone. The engine chooses each batched cycle's
width for the batch (`policy.batch_widths.BatchWidths`) and which rows verify a copy of
their own context instead of their draft's block (`policy.copies.BatchCopyPolicy` picks
the batch's width from every row's expected tokens per second of a verify of that many
rows). Token trees are a lone row's: at one row they are about neutral on the CPU
measured here, and at 4-8 rows the width policy settles on width 1, where a tree has no room.

Requests join between cycles: a joining request's prompt is prefilled in its own
caches a chunk at a time, up to a budget of prompt tokens per cycle shared first come
first served (`cycle.prefill_chunks`), reusing whatever prefix its `PromptCache`
holds, then merged into the batch; a finished or cancelled row leaves at
once and its KV goes back to its `PromptCache` (for a later request's prefix).
A batched cycle is launched at the end of the step before it, before that step's responses are
built, or a plain step's successor before the step is read; a row joining or leaving first rolls
it back whole (`batch_ahead`).
What is a row's own (its caches, drafter, acceptor, budget, answer): `rows.Row`.
Which targets batch, and how rows' caches become a batch's: `batch_caches`.
"""

import copy
import time
from collections import deque
from typing import Deque, List, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_mlx.engine import batch_ahead
from dflash_mlx.engine.ahead import discard, guesses_roll_back
from dflash_mlx.engine.batch_caches import batch_support, extend_rows, extract_row, mask_head_axis, merge_rows
from dflash_mlx.engine.batch_cycle import BatchLaunched, land_batch
from dflash_mlx.engine.distributed import share_seconds
from dflash_mlx.engine.responses import DFlashResponse
from dflash_mlx.engine.rows import BatchRequest, Row
from dflash_mlx.engine.timing import NoTimer, PhaseTimer
from dflash_mlx.models.target import kv_quantization, kv_window
from dflash_mlx.models.target.adapter import Target, target_for
from dflash_mlx.models.target.rollback import UnsupportedTargetError
from dflash_mlx.options import AUTO, fixed_width
from dflash_mlx.policy.batch_widths import BatchWidths
from dflash_mlx.policy.copies import batch_copy_policy_for
from dflash_mlx.policy.lookahead import LookAhead
from dflash_mlx.policy.sizer import FixedWidth, sizer_for
from dflash_mlx.speculation.suffix_index import SuffixIndex


class PromptTooLongError(ValueError):
    """A prompt at or past the target's context window (`Target.max_context`): refused whole."""


class BatchEngine:
    """Rows decode together; requests join and leave between cycles. Single-threaded: the
    caller (the server's worker thread) calls `add`, `remove` and `step`."""

    def __init__(self, model, draft, tokenizer, max_batch: int = 8, prefill_chunk: int = 256,
                 prefill_budget: int = 512, block_size=AUTO, target: Optional[Target] = None,
                 copy_proposals: bool = True, token_trees: bool = True, split_head: Optional[bool] = None,
                 profile: bool = False, snapshot_prompts: bool = True, suffix_index: Optional[SuffixIndex] = None):
        """`prefill_chunk`: prompt tokens per prefill forward; `prefill_budget`: prompt tokens
        run per step before the decoding rows' cycle (joining requests' time to first token
        against the running rows' pace). A row decoding alone runs `cycle.cycle` on its own
        caches, where `copy_proposals`, `token_trees` and `split_head` apply as in
        `stream_generate`; `profile`: phase times in its steps (from a copy of the width policy).
        `snapshot_prompts`: a recurrent target's prompt end is kept as a snapshot (the next
        turn's prefix). `target`: the adapter to use (default: the one `draft` is bound to).
        With no draft, `block_size` "auto" and `copy_proposals` verify copies where they pay
        and plain steps otherwise (any other setting: plain steps). `suffix_index`: earlier
        requests' prompts and answers, for copies (`speculation.suffix_index`); every
        request that does not opt out (`BatchRequest.global_copies`) is added as it ends."""
        self.model, self.draft, self.tokenizer = model, draft, tokenizer
        self.target = target if target is not None else target_for(model, draft)
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_batch > 1:
            reason = ("deterministic mode runs one sequence in plain decoding's shapes" if self.target.deterministic
                      else batch_support(self.target))
            if reason is not None:
                raise UnsupportedTargetError(f"{self.target.name} cannot be batched: {reason}")
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.prefill_budget = prefill_budget
        # a token tree's verify has no plain-decoding twin: deterministic mode verifies chains
        self.copy_proposals, self.split_head = copy_proposals, split_head
        self.token_trees = token_trees and not self.target.deterministic
        self.snapshot_prompts = snapshot_prompts
        if draft is not None:
            width = fixed_width(block_size, draft.block_size)
        else:  # no draft: copies where they pay (a width-1 sizer prices them), else plain steps
            width = None if fixed_width(block_size, 1) is None and copy_proposals else 1
        self.suffix_index = suffix_index
        self.widths = BatchWidths(model, draft) if width is None else None
        if self.widths is not None and profile:
            # profiling syncs at every phase: its cycle times must not teach the shared policy
            self.widths.sizers[1] = copy.deepcopy(sizer_for(model, draft))  # copies and trees come along
        self.fixed = FixedWidth(width) if width is not None else None
        # copies in batched cycles (with `auto`, as a lone row's): their acceptance is the lone rows'
        self.batch_copies = (batch_copy_policy_for(self.widths.sizer(1))
                             if self.widths is not None and copy_proposals else None)
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
        # the next batched cycle, launched (or planned) before this step's responses are built, or a plain
        # step's successor queued before its read, where the look-ahead finds that pays (`batch_ahead`)
        self.ahead: Union[BatchLaunched, batch_ahead.Plan, None] = None
        self.lookahead = LookAhead()
        self.guesses_roll_back = guesses_roll_back(self.target)  # (a lone row's guesses: `ahead.before_reading`)
        self.read_at: Optional[float] = None  # when the last batched cycle was read
        self.ahead_counts = {"launched ahead": 0, "queued before a read": 0, "discarded": 0}  # batched cycles

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
            raise PromptTooLongError(f"the prompt has {len(request.prompt_ids)} tokens but {self.target.name} "
                                     f"has a context window of {self.target.max_context} tokens: shorten the prompt"
                                     + (f" ({self.target.context_note})" if self.target.context_note else ""))
        low, high = min(request.prompt_ids), max(request.prompt_ids)
        if low < 0 or high >= self.target.vocab_size:  # (embedded from outside the table: garbage, no error)
            raise ValueError(f"the prompt holds token id {low if low < 0 else high}, outside "
                             f"{self.target.name}'s vocabulary of {self.target.vocab_size} tokens: encode it "
                             "with this model's own tokenizer")
        bias = request.options.logit_bias or {}
        outside = [t for t in bias if not 0 <= t < self.target.vocab_size]
        if outside:  # (an index past the logits: garbage, no error)
            raise ValueError(f"logit_bias names token id {outside[0]}, outside {self.target.name}'s vocabulary of "
                             f"{self.target.vocab_size} tokens")
        check_cache_settings(self.target, self.max_batch, request)
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
            row.cancel_prefill()
            return
        self._leave([row])

    def _remember(self, rows: List[Row]):
        """Rows that end go into the index of earlier requests, unless they opted out."""
        if self.suffix_index is not None:
            for r in rows:
                if r.request.global_copies:
                    self.suffix_index.add(r.document())

    def _leave(self, rows: List[Row]):
        batch_ahead.rows_change(self)
        self._remember(rows)
        if not self.batched:  # the lone row: its caches are its PromptCache's already
            for r in rows:  # (cancelled: the cycle it launched ahead leaves them)
                discard(self.target, r.state)
            self.rows, self.cache = [], None
            return
        idx = [self.rows.index(r) for r in rows]
        for r, b in zip(rows, idx):
            r.state.target_cache = extract_row(self.cache, b)
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
        batch_ahead.rows_change(self)
        if not self.rows:  # alone: the row decodes on its PromptCache's own caches
            self.cache = row.state.target_cache
        else:
            if not self.batched:
                alone = self.rows[0]
                discard(self.target, alone.state)  # batched from now on: its cycle launched ahead goes
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
        with mx.stream(generation_stream):  # (see `decode_step`)
            while self.joining and budget > 0:
                spent, joined = self._prefill_step(self.joining[0])
                budget -= spent
                events += joined
        return events

    def decode_step(self) -> List[Tuple[Row, DFlashResponse]]:
        """One cycle of every decoding row: each row's response (rows that end leave)."""
        if not self.rows:
            return []
        # The whole step on mlx-lm's generation stream, its host syncs too, as `generate_step` runs
        # its loop: an evaluation from another stream of arrays computed on this one makes the two
        # streams' threads wait on each other (measured on the CPU: +0.05-0.08 ms a tiny target's step)
        with mx.stream(generation_stream):
            return self._cycle()

    def _prefill_step(self, row: Row) -> Tuple[int, List[Tuple[Row, DFlashResponse]]]:
        """One chunk of `row`'s prefill: (tokens run, [its first response] when it was the last)."""
        row.start()
        try:
            return next(row.prefill), []
        except StopIteration as done:
            last, prefilled = done.value
        self.joining.popleft()
        step = row.begin_answer(last, prefilled, self.tokenizer)
        if self.target.recurrent and self.snapshot_prompts:
            row.state.snapshot()
        if step.finish is None:
            self._join(row)
        else:
            self._remember([row])
        ran = (prefilled - 1) % self.prefill_chunk + 1 if prefilled else 1  # the last chunk's tokens
        return ran, [row.respond(step, first=True)]

    def _cycle_alone(self, row: Row) -> List[Tuple[Row, DFlashResponse]]:
        """A lone row's cycle on its own caches: `cycle.cycle`, with copies and trees."""
        if self.widths is not None:
            widths = self.widths.sizer(1)
            widths.trees_on = row.trees is not None
        else:
            widths = self.fixed
        step = row.cycle_alone(self.target, widths, self.timer)
        self.cycles += 1
        if self.widths is not None:  # reported with the batch's widths, under batch size 1
            self.widths.tally(1, step.width)
        event = row.respond(step)
        if row.done:
            self._leave([row])
        return [event]

    def _cycle(self) -> List[Tuple[Row, DFlashResponse]]:
        rows = self.rows
        if not self.batched:
            return self._cycle_alone(rows[0])
        pending, self.ahead = self.ahead, None
        if isinstance(pending, BatchLaunched):
            pending.landing = time.perf_counter()
            launched = pending
        else:
            launched = batch_ahead.launch(self, pending or batch_ahead.plan(self))
        if batch_ahead.before_reading(self, launched):
            batch_ahead.queue_behind(self, launched)
        width, copied, matches = launched.width, launched.copied, launched.matches
        if self.widths is not None:
            self.widths.tally(self.widths.key, width)
        steps, accepts, seconds = land_batch(launched, self.cache, self.kinds, self.draft)  # the host sync
        read_at = time.perf_counter()
        for m, c, a in zip(matches, copied, accepts):
            if c:
                self.batch_copies.record_of(m).update(m.length, c, min(a, c))
        self.cycles += 1
        if self.widths is not None:
            # (a cycle's rollback runs lazily in the next cycle's graph, and is timed there)
            chained, timed = [a for a, c in zip(accepts, copied) if not c], not any(copied)
            # a cycle of copies prices no drafted width; on a split target rank 0's time
            # arrives a cycle or more later, what was accepted is taken now
            width_time, copies, verified = (self.widths.count(width, chained, timed), self.batch_copies,
                                            len(rows) * width)

            def learn(seconds: float):
                width_time(seconds)
                if copies is not None:
                    copies.update(verified, seconds)
            share_seconds(self.target, seconds, learn)
        ended = [r for r, s in zip(rows, steps) if s.finish is not None]
        chosen = batch_ahead.after_reading(self, launched, ended, read_at)
        if ended:
            self._leave(ended)
        if self.batched and self.ahead is None:
            batch_ahead.launch_ahead(self, chosen)
            if isinstance(self.ahead, BatchLaunched):  # what a plain step queued before the read would hide
                self.lookahead.timed_gap(self.ahead.queued - read_at)
        return [r.respond(s) for r, s in zip(rows, steps)]

    # -- reporting

    def stats(self) -> dict:
        return {
            "rows": len(self.rows),
            "joining": len(self.joining),
            "max_batch": self.max_batch,
            "cycles": self.cycles,
            "widths": ({str(k): {str(w): n for w, n in sorted(v.items())}
                        for k, v in sorted(self.widths.chosen.items())}
                       if self.widths is not None else {"fixed": self.fixed.width}),
            "width_key": self.widths.key if self.widths is not None else None,
            "batched_ahead": dict(self.ahead_counts),
        }


def check_cache_settings(target, max_batch: int, request: BatchRequest):
    """Refuse, in one line, a quantized KV cache (`kv_bits`, or a prompt cache an earlier call quantized)
    or a bounded one (`max_kv_size`) the engine cannot run exactly: both one sequence at a time (mlx-lm's
    batch caches have no quantized kind, and its batch windows keep no front tokens)."""
    cache = request.prompt_cache.target_cache if request.prompt_cache is not None else []
    alone = "runs one sequence at a time (an engine of max_batch=1)"
    # (the bounded cache first: beside kv_bits it is refused before the quantized cache's probes run)
    if request.prompt_cache is not None and request.prompt_cache.windowed:
        if max_batch > 1:
            raise UnsupportedTargetError(f"max_kv_size: {target.name}: a bounded KV cache {alone}")
        kv_window.check(target, quantized=request.kv_quantization is not None)
    if request.kv_quantization is not None or kv_quantization.holds_quantized(cache):
        if max_batch > 1:
            raise UnsupportedTargetError(f"kv_bits: {target.name}: a quantized KV cache {alone}")
        if request.kv_quantization is not None:
            kv_quantization.check(target, request.kv_quantization)
        kv_quantization.row_limit(target, cache, request.kv_quantization)  # (probed now, not mid-cycle)
