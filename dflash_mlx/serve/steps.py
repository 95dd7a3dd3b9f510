"""The batched worker's steps: each engine step's events, decided on rank 0, applied on every rank.

Continuous batching on `engine.BatchEngine`: every step starts with its events
(`StepEvents`): the rows whose answer is over, cancelled or ended leave, and waiting jobs
join into the free rows (their prompts then prefilled a chunk per step, each from the
longest cached prefix among earlier answers' caches, `cache_pool.CachePool`); then the
engine runs one step (prefill chunks, then a cycle of the decoding rows) and the rows that
finished complete their answers. The worker (rank 0, or the only process) decides the
events and applies them as it decides; on a target split over processes it then shares them
(`ranks.Ranks.share`), and every other rank applies the same events to its own engine
(`apply`) and runs the same step, serving nothing. "Worker" annotations name
`dflash_mlx.serve.worker.Worker` (not imported: that module imports this one).
"""

import queue
from dataclasses import dataclass, field
from typing import List, Optional

from dflash_mlx.engine.rows import BatchRequest
from dflash_mlx.options import GenerationOptions
from dflash_mlx.serve.cache_pool import CachePool
from dflash_mlx.serve.jobs import JobAnswer, shutting_down
from dflash_mlx.serve.ranks import HEARTBEAT_S, lost
from dflash_mlx.serve.requests import RequestError


@dataclass
class Join:
    """A request that joins the batch: `uid` its row's on rank 0, `cache_key` the cached
    conversation it starts from (None: a new one)."""

    uid: int
    prompt_ids: List[int]
    options: GenerationOptions
    logprobs: Optional[int]
    global_copies: bool
    cache_key: Optional[int]

    def request(self, pool: CachePool) -> BatchRequest:
        return BatchRequest(self.prompt_ids, self.options, logprobs=self.logprobs,
                            prompt_cache=pool.take(self.cache_key), global_copies=self.global_copies)


@dataclass
class StepEvents:
    """What changes before one engine step, in this order: `leaves` (rows, by rank 0's uid),
    `joins`, then `kept` (the keys of rank 0's cached conversations, when they changed); or stop."""

    leaves: List[int] = field(default_factory=list)
    joins: List[Join] = field(default_factory=list)
    kept: Optional[List[int]] = None
    stop: bool = False

    def __bool__(self) -> bool:
        return bool(self.leaves or self.joins or self.stop) or self.kept is not None


def run_batched(worker: "Worker"):
    """The engine thread of a batched worker, on every rank: steps until stopped."""
    try:
        while step(worker):
            pass
    except Exception as e:  # a collective of a split target failed (a rank is gone), or a bug
        worker.failed, worker.stopping = lost(e, worker.ranks), True
        for job, _, _ in worker.active.values():
            if job is not None:
                worker._failed(job, e)
    finally:
        worker.ended.set()


def step(worker: "Worker") -> bool:
    """One step: its events (decided here on rank 0 and shared), then the engine's; False: stop."""
    ranks = worker.ranks
    events = ranks.share(decide(worker) if ranks.speaks else None) or StepEvents()
    if events.stop:
        for job, _, _ in worker.active.values():
            if job is not None:
                job.emit("error", shutting_down())
        return False
    if not ranks.speaks:
        apply(worker, events)
    engine = worker.engine
    if engine.idle:
        return True
    try:
        # joined requests' first tokens go out before the cycle of the running rows
        for phase in (engine.prefill_step, engine.decode_step):
            for row, r in phase():
                answer = worker.active[row.uid][1] if ranks.speaks else None
                if answer is not None and not answer.over:
                    answer.feed(r)  # an answer that is over leaves before the next step
    except Exception as e:
        if ranks.size > 1:
            raise  # the ranks may no longer agree: the run ends (`run_batched`)
        for job, _, _ in worker.active.values():  # the batch is lost: fail its jobs, start a new engine
            worker._failed(job, e)
        worker.active.clear()
        worker.engine = worker._new_engine()
        return True
    settle(worker)
    return True


def settle(worker: "Worker"):
    """Rows that are done: their answers complete, their conversations kept for a later prefix
    (bounded on rank 0; the other ranks keep alike and drop what rank 0 dropped)."""
    for uid, (job, answer, row) in list(worker.active.items()):
        if row.done:
            del worker.active[uid]
            if answer is not None:
                answer.complete()
            if row.state.valid and row.state.tokens:
                worker.pool.keep(row.state, worker.engine if worker.ranks.speaks else None)


def leave(worker: "Worker", uids: List[int]):
    for uid in uids:
        worker.engine.remove(worker.active[uid][2])
    settle(worker)


def apply(worker: "Worker", events: StepEvents):
    """Rank 0's events on another rank: the same rows leave, the same requests join (each
    row's job here is None: rank 0 answers), the same conversations stay cached."""
    leave(worker, events.leaves)
    for j in events.joins:
        try:
            row = worker.engine.add(j.request(worker.pool))
        except ValueError:  # refused on rank 0 alike, which answered it
            continue
        worker.active[j.uid] = (None, None, row)
    if events.kept is not None:
        worker.pool.mirror(events.kept)


def decide(worker: "Worker") -> StepEvents:
    """Rank 0's events, applied as they are decided: rows whose answer is over, cancelled or
    ended leave; waiting jobs join while there are free rows and bytes, waiting for one while
    nothing runs (on a split target, an empty step every `HEARTBEAT_S`)."""
    engine, events = worker.engine, StepEvents()
    events.leaves = [uid for uid, (job, answer, row) in worker.active.items() if not row.done and (
        answer.over or job.cancelled.is_set() or job.ended.is_set())]
    leave(worker, events.leaves)
    while engine.room > 0 and worker.pool.room(engine):
        try:
            job = worker.jobs.get(block=engine.idle, timeout=HEARTBEAT_S if worker.ranks.size > 1 else None)
        except queue.Empty:
            break
        if job is None:
            events.stop = True
            break
        if worker.stopping:
            job.emit("error", shutting_down())
            continue
        if job.cancelled.is_set():
            worker._cancelled_waiting(job)
            continue
        req = job.request
        join = Join(0, req.prompt_ids, worker.ranks.with_seed(worker._options(req)), req.logprobs,
                    req.global_copies, worker.pool.best(req.prompt_ids))
        try:
            row = engine.add(join.request(worker.pool))
        except ValueError as e:
            job.emit("error", RequestError(str(e)))
            continue
        except Exception as e:
            worker._failed(job, e)
            continue
        join.uid = row.uid
        worker.active[row.uid] = (job, JobAnswer(worker, job), row)
        events.joins.append(join)
    keys = worker.pool.keys()
    if keys != worker.shared_keys:
        events.kept = worker.shared_keys = keys
    return events
