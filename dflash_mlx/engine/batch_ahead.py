"""A batch's next cycle, planned and launched before the host needs it (`ahead`'s twin for batches).

`BatchEngine` lands one batched cycle a step (`batch_cycle`). The next one is launched at the end of
the step (`launch_ahead`), before the step's responses are built and the caller takes them, so the
device runs it meanwhile. A batched plain step (width 1, no copies: where the width policy settles
with four rows or more) commits one token a row whatever it is, so the step after it can be queued
even before the host reads it (`before_reading`, `queue_behind`), as mlx-lm's `generate_step` queues
its steps, on the guess that the plan made once it is read is another plain step (the width policy
stays at 1, no copy comes into sight, no row ends, no raw argmax is done again). `policy.lookahead`
decides where that guess pays, from how often it held and the host's gap against a step's time.

A launched cycle has fed its rows to the batch's caches. Where it will not land (the guess failed, a
row joins or leaves first) `discard` takes every row's rows back out (`batch_cycle.discard_batch`).
Nothing is launched ahead where a cycle syncs more than once (profiling), where rows cannot be rolled
back whole (recurrent state), on a split target (every rank runs the same graphs in one order), nor,
for plain steps, on sliding windows (a one-token write overwrites what a discard would need back).
"""

import time
from typing import List, NamedTuple, Optional

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_mlx.engine import ahead as lone
from dflash_mlx.engine.batch_cycle import BatchLaunched, discard_batch, launch_batch, plan_batch
from dflash_mlx.engine.timing import NoTimer
from dflash_mlx.models.target.windows import snapshot_windows


class Plan(NamedTuple):
    """A batched cycle's width, copy tokens per row (0: the row drafts) and each row's match."""

    width: int
    copied: List[int]
    matches: List


def plan(engine) -> Plan:
    """The next batched cycle's width and copies, as the engine's policies choose them now."""
    return Plan(*plan_batch(engine.target, engine.rows, engine.widths, engine.fixed, engine.batch_copies))


def launch(engine, chosen: Plan, lasts: Optional[List[mx.array]] = None,
           unread: Optional[mx.array] = None) -> BatchLaunched:
    return launch_batch(engine.target, engine.draft, engine.rows, engine.cache, engine.kinds, engine.head_axis,
                        *chosen, lasts=lasts, unread=unread)


def may_launch(engine) -> bool:
    """Whether batched cycles may be launched ahead at all (see the module's docstring)."""
    target = engine.target
    return (isinstance(engine.timer, NoTimer) and target.sharding is None and not target.recurrent
            and all(kind == "trim" for kind in engine.kinds))


def plain(width: int, copied: List[int]) -> bool:
    """Whether a batched cycle of `width` with `copied` tokens a row is a plain step."""
    return width == 1 and not any(copied)


def launch_ahead(engine, chosen: Optional[Plan] = None):
    """Plan the next batched cycle (unless `chosen`) and launch it, or, a plain step on sliding
    windows, keep its plan for the next step."""
    if not may_launch(engine):
        return
    chosen = chosen or plan(engine)
    if plain(chosen.width, chosen.copied) and engine.target.rotating:
        engine.ahead = chosen
        return
    # (only a cycle launched ahead can be discarded: its windows as they were, before its forward writes them;
    # a batched plain step is never launched ahead on windows)
    windows = snapshot_windows(engine.cache) if engine.target.rotating else None
    launched = engine.ahead = launch(engine, chosen)
    launched.windows = windows
    queue(launched)
    engine.ahead_counts["launched ahead"] += 1


def before_reading(engine, launched: BatchLaunched) -> bool:
    """Whether the step after `launched`, a batched plain step, is queued before the host reads it."""
    # (a row's logprobs are computed from its logits when it is read: behind a step queued first, that
    # read would wait for the queued step too)
    return (plain(launched.width, launched.copied) and may_launch(engine)
            and not engine.target.rotating and all(r.budget > 1 and r.request.logprobs is None for r in launched.rows)
            and (lone.BEFORE_READING_ON_CPU or mx.default_device() != mx.cpu) and engine.lookahead.pays(1))


def queue_behind(engine, launched: BatchLaunched):
    """Queue a plain step behind `launched` (a plain step not read yet): every row's token is its
    lazy committed one, and the draft keeps `launched`'s features now (a plain step keeps them all)."""
    rows = launched.rows
    with mx.stream(generation_stream):
        if launched.feats is not None:
            for b, r in enumerate(rows):
                r.drafter.keep(launched.feats[b : b + 1])
        launched.kept_early = True
        lasts = [launched.committed[b : b + 1, 0] for b in range(len(rows))]
        queued = engine.ahead = launch(engine, Plan(1, [0] * len(rows), [None] * len(rows)), lasts,
                                       launched.verify_in)
    queue(queued)
    engine.ahead_counts["queued before a read"] += 1


def queue(launched: BatchLaunched):
    """Hand a launched cycle's graph to the device. Its build, for the policies, runs to the end of
    that hand-off, as a lone row's (`ahead.ahead`): MLX's CPU backend may wait in `async_eval` for the
    tasks before it, and a cycle's time that left it out would teach the width policy cycles that cost
    the host nothing."""
    launched.queued = time.perf_counter()
    mx.async_eval(launched.outcome, *[u for u in launched.unsure if u is not None])
    launched.built = time.perf_counter()


def after_reading(engine, launched: BatchLaunched, ended: list, read_at: float) -> Optional[Plan]:
    """Once `launched` is read: what the look-ahead learns from it, the step queued behind it
    discarded where the plan now made (returned) is not a plain step, or where a row ended or a raw
    argmax was done again (None then: the next is planned after the rows leave)."""
    queued_early = isinstance(engine.ahead, BatchLaunched)
    was_plain = plain(launched.width, launched.copied)
    if not may_launch(engine):
        return None
    chosen = None if ended or launched.redone or not engine.batched else plan(engine)
    if was_plain and engine.batched:
        engine.lookahead.observe(1, chosen is not None and plain(chosen.width, chosen.copied))
        if engine.read_at is not None:
            engine.lookahead.timed_cycle(1, read_at - engine.read_at)
    engine.read_at = read_at
    if queued_early and (chosen is None or not plain(chosen.width, chosen.copied)):
        discard(engine)
    return chosen


def rows_change(engine):
    """Rows join or leave: the cycle launched ahead goes, and the next read starts a new count."""
    discard(engine)
    engine.read_at = None


def discard(engine):
    """The cycle launched ahead goes (the batch's rows change first, or a guess failed): its rows
    leave the caches."""
    pending, engine.ahead = engine.ahead, None
    if isinstance(pending, BatchLaunched):
        discard_batch(pending, engine.cache, engine.kinds)
        engine.ahead_counts["discarded"] += 1
