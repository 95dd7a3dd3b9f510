"""A lone row's cycle, planned and launched before the host needs it.

A cycle is planned (`make_plan`: its width, a copy, a token tree; the policies' choices), then
launched (`launch`: the draft's block, the verify forward and the acceptance, all queued as one
lazy graph), then landed (`engine.cycle.cycle`: one host sync reads the accept length, then the
rollback and the step). Between two cycles the host builds the step's response (detokenizing),
hands it to the caller and comes back; on a GPU, where a small model's forward takes about as long,
the device would sit idle meanwhile. So a cycle that may (`may_launch`) ends by planning the next
one and launching it (`ahead`); the response is then built while the device runs it. Its time for
the width policy is its build plus the wait when it lands: what the gap did not hide.

A plain step's successor is even launched before the host reads the step (`before_reading`), as
mlx-lm's `generate_step` queues its steps (without a draft, where copies are on, on the guess that no
copy comes into sight with its token); a drafted chain's, on the guess that the chain is accepted
whole. Guesses are made where they pay (`policy.lookahead`), checked once read (`cycle.cycle`) and,
where wrong, their cycle discarded and the draft's features it kept taken back (`DraftContext.unkeep`).

A launched cycle has fed its rows to the target's caches. Where the next call is not its landing
(a second row joins the batch, the answer is cancelled, the prompt cache is reused by another call),
`discard` rolls them back first. Token trees are only planned ahead (their verify syncs midway), so
are plain steps on sliding-window caches (a one-token update overwrites what a discard would need)
and cycles whose LM head runs in two pieces (`syncs_midway`); nothing is launched ahead where a cycle
syncs more than once anyway (logprobs, the profiler), where rows cannot be rolled back whole
(recurrent state) or on a split target (every rank must run the same graphs in the same order).
"""

import os
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import ChunkedKVCache

from dflash_mlx.engine.timing import NoTimer, launched_seconds
from dflash_mlx.models.target import kv_quantization
from dflash_mlx.models.target.rollback import sub_caches
from dflash_mlx.models.target.windows import restore_windows, snapshot_windows
from dflash_mlx.speculation.accept import (GreedyAcceptor, Proposal, accept_in_pieces, pack_outcome,
                                          synced_acceptance)
from dflash_mlx.speculation.copies import CopyMatch
from dflash_mlx.speculation.processors import process_chain, process_prior


@dataclass
class Context:
    """What planning and launching a lone row's cycle reads (the arguments of `cycle.cycle`)."""

    target: Any
    drafter: Any
    acceptor: Any
    widths: Any
    state: Any  # PromptCache
    head_rows: Any
    copies: Any = None
    index: Any = None
    trees: Any = None
    shared: Any = None
    copy_trees: Any = None
    # whether the copy policies would copy after the context read last (`copy_in_sight`): until then,
    # and while they would, a plain step is not queued before the last is read (`before_reading`)
    copies_pay: bool = True
    # whether a cycle's successor is queued before its read, on a guess (`policy.lookahead.LookAhead`):
    # a greedy chain's, that it is accepted whole; a plain step's where copies are on, that no copy comes
    # into sight. None: chains never, plain steps where copies are on never
    lookahead: Any = None
    after_plain: bool = False  # a plain step landed: the next `plan_copies` tells `lookahead` what it found
    read_at: Optional[float] = None  # when the last cycle was read (`perf_counter`), None after a token tree
    processors: tuple = ()  # the row's logits processors (`speculation.processors`)


@dataclass
class Plan:
    """What a cycle verifies: the draft's chain or a plain step (`width`), a copy of
    `copy_length` tokens of `match`, a token tree of the draft (`use_tree`), or a copy tree."""

    width: int
    match: Optional[CopyMatch] = None
    copy_length: int = 0
    copy_tree: Any = None
    use_tree: bool = False

    @property
    def tree(self) -> Optional[str]:
        return "copy" if self.copy_tree is not None else "draft" if self.use_tree else None


@dataclass
class Launched:
    """A chain, copy or plain cycle whose graph is queued: what landing it reads."""

    width: int
    verify_in: mx.array  # [1, width]
    feats: Optional[mx.array]
    record: Any
    accept_len: mx.array
    committed: mx.array
    match: Optional[CopyMatch]
    copy_length: int
    outcome: mx.array  # [1, 1 + C + width] (a plain step: [1, 2]): `pack_outcome`, for one host read
    read: Any = None  # once landed: (accept lengths, committed rows, verify-input rows) on the host
    pieces: List[Tuple[int, mx.array]] = field(default_factory=list)  # (first row, logits) for logprobs
    unsure: Optional[mx.array] = None  # the acceptance took raw argmaxes and may differ from the exact one
    redo: Any = None  # () -> (accept_len, committed), the exact way (`GreedyAcceptor.exact`)
    redone: bool = False  # once landed: whether the exact acceptance replaced the raw one
    windows: Any = None  # sliding windows as they were before it, for a discard (`models.target.windows`)
    started: float = 0.0
    queued: float = 0.0  # launched ahead: when its graph went to the device (MLX's CPU `async_eval` may wait
    # there for the tasks before it to drain)
    built: float = 0.0
    landing: Optional[float] = None  # when the next call took it (launched ahead)

    seconds = launched_seconds


def make_plan(ctx: Context, budget: int, unread: int = 0) -> Plan:
    """The policies' choice for the next cycle (`budget`: tokens it may commit; `unread`: fed
    tokens not yet in `state.tokens`, a plain step's that the host has not read yet)."""
    widths, copies = ctx.widths, ctx.copies
    context = len(ctx.state.tokens) + unread
    widths.at_context(context)
    budget = min(budget, ctx.target.verify_room(context))  # the rows it may verify
    kv_room = kv_quantization.room(ctx.target, ctx.state.target_cache, ctx.state.kv_quantization, context)
    if kv_room is not None:  # (a quantized KV cache's rows: as plain decoding's would be, bit for bit)
        budget = min(budget, kv_room)
    width = widths.choose(budget)
    plan = Plan(width)
    if copies is not None and not unread:  # (the indexes lack an unread token: no copy lines up)
        plan_copies(ctx, plan, budget)
    if ctx.trees is not None and not plan.copy_length and plan.copy_tree is None:
        explore = ctx.trees.explore(width, min(budget, widths.max_block))
        if explore is not None:
            plan.width, plan.use_tree = explore, True
        else:
            plan.use_tree = ctx.trees.choose(width, widths.chain_tokens(width))
    return plan


def plan_copies(ctx: Context, plan: Plan, budget: int):
    """`plan`'s copy, or copy tree, where the copy policies find one that pays after the context read
    so far; `ctx.copies_pay` says whether they did."""
    copies, index, shared = ctx.copies, ctx.index, ctx.shared
    plan.match, plan.copy_length = copies.best(
        [index.match(copies.max_length), shared.match(index.tokens, copies.max_length) if shared else None],
        budget, plan.width)
    if ctx.copy_trees is not None:
        plan.copy_tree = ctx.copy_trees.plan(index.tokens[-1], ctx.copy_trees.gather(index, shared), plan.match,
                                             plan.copy_length, budget, plan.width)
    ctx.copies_pay = bool(plan.copy_length) or plan.copy_tree is not None
    if ctx.after_plain:
        ctx.after_plain = False
        ctx.lookahead.observe(1, not ctx.copies_pay)


def copy_in_sight(ctx: Context, budget: int, width: int) -> bool:
    """Whether a copy would pay now that a cycle is read behind which the next was queued (planned
    without copies, the indexes lacking this cycle's tokens; `width`: the queued cycle's): a row
    queues its successors so while none would; where one would, the queued cycle is discarded and
    the copy planned in its place (`ctx.copies_pay`)."""
    if ctx.copies is None or budget < 2:
        return False
    plan_copies(ctx, Plan(width), budget)
    return ctx.copies_pay


def launch(ctx: Context, plan: Plan, last: mx.array, timer, logprobs: Optional[int] = None,
           unread: Optional[mx.array] = None) -> Launched:
    """Queue `plan` (a chain, a copy or a plain step) after `last` [1]: draft, verify forward,
    acceptance. No host sync, except the one a split LM head takes between its pieces. `unread` [1, k]:
    the tokens the cycle before fed that are not in `state.tokens` yet (queued before its read)."""
    target, drafter, acceptor = ctx.target, ctx.drafter, ctx.acceptor
    started = time.perf_counter()
    width = plan.width
    pieces: List[Tuple[int, mx.array]] = []
    with mx.stream(generation_stream):
        if plan.copy_length:
            width = plan.copy_length + 1
            proposal = Proposal(mx.array([plan.match.continuation[: plan.copy_length]], dtype=mx.int32))
            verify_in = mx.concatenate([last[:, None], proposal.tokens], axis=1)
        elif width > 1:
            proposal = drafter.propose(last, width, acceptor)
            verify_in = mx.concatenate([last[:, None], proposal.tokens], axis=1)
            # The draft runs while the host builds the verify graph (on a GPU
            # the whole draft forward hides behind it).
            mx.async_eval(verify_in)
        else:
            proposal, verify_in = None, last[:, None]
        timer.mark("draft", verify_in)
        h, feats, record = target.forward(verify_in, ctx.state.target_cache, drafter.layer_ids, record=width > 1,
                                          fuse=drafter.fuse)

        computed = {}  # a redo reuses the pieces of logits already computed
        prior = process_prior(ctx.processors, ctx.state.history, unread)

        def row_logits(start, stop):
            if (start, stop) not in computed:
                logits = target.logits(h[:, start:stop])
                computed[start, stop] = process_chain(ctx.processors, prior, verify_in, logits, start)
                if logprobs is not None:
                    pieces.append((start, computed[start, stop]))
            return computed[start, stop]

        first = ctx.head_rows.first(width)
        accept_len, committed = accept_in_pieces(acceptor, proposal, row_logits, first, drafter.draft)
        unsure = acceptor.take_unsure()
        outcome = pack_outcome(accept_len, committed, verify_in)

    def redo():
        with mx.stream(generation_stream):
            return accept_in_pieces(acceptor.exact(), proposal, row_logits, first, drafter.draft)

    return Launched(width, verify_in, feats, record, accept_len, committed, plan.match, plan.copy_length, outcome,
                    pieces=pieces, unsure=unsure, redo=redo, started=started, built=time.perf_counter())


def land(launched: Launched):
    """The cycle's host sync: its accept length, tokens and inputs evaluated and read at once
    (`launched.read`), and, where the acceptance took raw argmaxes that may differ from the exact
    ones (rare), the exact acceptance."""
    raw = launched.accept_len
    launched.accept_len, launched.committed, launched.read = synced_acceptance(
        launched.accept_len, launched.committed, [launched.unsure], launched.redo, launched.verify_in,
        launched.outcome)
    launched.redone = launched.accept_len is not raw


def may_launch(ctx: Context, timer, logprobs: Optional[int]) -> bool:
    """Whether the next cycle may be launched ahead (see the module's docstring)."""
    target = ctx.target
    return isinstance(timer, NoTimer) and logprobs is None and not target.recurrent and target.sharding is None


def syncs_midway(ctx: Context, plan: Plan) -> bool:
    """Whether `plan`'s verify runs its LM head in two pieces, the host reading the first between them
    (`cycle.HeadRows`: on a CPU, rows past the likely accept length): such a cycle is planned ahead,
    never launched (its launch would wait for the cycle before it). Plain steps and narrow cycles run
    the head in one piece."""
    width = plan.copy_length + 1 if plan.copy_length else plan.width
    return ctx.head_rows.split and ctx.head_rows.first(width) < width


def ahead(ctx: Context, budget: int, last: mx.array, timer, unread: Optional[mx.array] = None):
    """Plan the next cycle now; launch it unless it is a token tree. Its rows are in the caches
    until it lands (the prompt cache is not valid meanwhile). `unread` [1, k]: the tokens the cycle
    before fed, not read yet (its successor queued before its read, on the guess that all are kept)."""
    plan = make_plan(ctx, budget, 0 if unread is None else unread.shape[1])
    state = ctx.state
    if (plan.tree is not None or (plan.width == 1 and not plan.copy_length and rotating(ctx))
            or syncs_midway(ctx, plan)):
        # (a one-token update of a full sliding window overwrites the entry a discard would need back)
        state.ahead = plan
        return
    # (only a cycle launched ahead can be discarded: its windows as they were, before its forward writes them.
    # Not in deterministic mode: there the verify's one-token updates write into the very arrays a snapshot
    # would hold, and its rollback of every row already puts each window back from copies, `exact_rows`)
    windows = snapshot_windows(state.target_cache) if rotating(ctx) and not ctx.target.deterministic else None
    launched = launch(ctx, plan, last, timer, unread=unread)
    launched.windows = windows
    launched.queued = time.perf_counter()
    mx.async_eval(launched.outcome, *([] if launched.unsure is None else [launched.unsure]))
    # (on MLX's CPU backend async_eval hands each node of the graph to the stream's worker thread, ~1.6 us a
    # node: for a tiny target that is most of the cycle, and it is counted here)
    launched.built = time.perf_counter()
    state.ahead, state.valid = launched, False


def _cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# On MLX's CPU backend the host thread and the stream's worker thread share the machine's cores. With
# a core each, a plain step queued before the last is read gains as mlx-lm's does (a tiny target's step
# 0.80 against 0.85 ms over 256 tokens, 0.98 against 1.10 over 1,024); sharing one, it loses (1.35
# against 0.94 ms, pinned to one core; 1.59 against 1.07 beside a busy process). (2026-12-05, once the
# step's host syncs ran on its own stream: `BatchEngine.decode_step`.)
BEFORE_READING_ON_CPU = _cores() > 1


def before_reading(ctx: Context, launched: Launched, budget: int, timer, logprobs: Optional[int]) -> bool:
    """Whether the cycle after `launched` can be planned and launched before the host reads it,
    as mlx-lm's `generate_step` queues its next step before it reads the last (on a GPU the host
    then builds the next graph while the device runs this one). A plain step commits its one
    token whatever it is, so the next cycle needs only its lazy value, where no policy reads the
    token (trees; copies, where none paid after the last token read, without a draft, and where the
    guess that none comes into sight pays, `copy_in_sight`, `policy.lookahead`) and a discard can take
    the step back (a stop token, or a raw argmax done again the exact way, `land`). A drafted chain's
    successor is queued on the guess that the chain is accepted whole, where that pays (greedy rows,
    the guess checked once read, `cycle.cycle`). Not where the next forward would start past the line
    of a quantized KV cache not converted yet (`models.target.kv_quantization`)."""
    if not (budget > launched.width and not launched.copy_length and not rotating(ctx)
            and may_launch(ctx, timer, logprobs)
            and (BEFORE_READING_ON_CPU or mx.default_device() != mx.cpu)
            and not kv_quantization.due(ctx.state.target_cache, ctx.state.kv_quantization)):
        return False
    guess = ctx.lookahead
    # (chains greedy only: a guess thrown away at T > 0 would have drawn from the seed's stream; a head in
    # two pieces whose second never ran leaves a short `committed`, no guess)
    if launched.width > 1:
        return (guess is not None and isinstance(ctx.acceptor, GreedyAcceptor) and launched.committed.shape[1]
                == launched.width and (ctx.copies is None or not ctx.copies_pay) and guess.pays(launched.width))
    return ctx.trees is None and (ctx.copies is None or (ctx.drafter.draft is None and not ctx.copies_pay
                                                         and guess is not None and guess.pays(1)))


def rotating(ctx: Context) -> bool:
    """Whether the row's target caches hold sliding windows: the model's own, or a bounded cache's
    (`max_kv_size`, `models.target.kv_window`)."""
    return ctx.target.rotating or ctx.state.windowed


def guesses_roll_back(target) -> bool:
    """Whether a cycle queued on a guess can be rolled back with the cycle before it: not where a
    forward drops entries off a cache's front by the offset it finds (mlx-lm's `ChunkedKVCache`, Llama
    4's chunked layers), which would count the rows the guess's rollback takes away. (Sliding windows:
    `before_reading` queues nothing behind a cycle on them.)"""
    return not any(isinstance(s, ChunkedKVCache) for c in target.make_cache() for s in sub_caches(c))


def take(state) -> Tuple[Optional[Launched], Optional[Plan]]:
    """(the cycle launched ahead, or None; the plan made ahead, or None), taken off `state`."""
    pending, state.ahead = state.ahead, None
    if isinstance(pending, Launched):
        pending.landing = time.perf_counter()
        return pending, None
    return None, pending


def discard(target, state):
    """Roll back a cycle launched ahead that will not land (its rows leave the caches whole; sliding
    windows are put back as they were, `models.target.windows`)."""
    pending, state.ahead = state.ahead, None
    if isinstance(pending, Launched):
        with mx.stream(generation_stream):
            target.rollback(state.target_cache, pending.width, pending.width, pending.record)
        restore_windows(pending.windows)
        state.valid = True
