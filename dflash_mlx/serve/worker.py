"""The server's scheduler: one engine thread serving jobs from a bounded queue.

Two ways, chosen at start:

- **batched** (`max_batch` > 1 on a target `batch_caches.batch_support` accepts): continuous
  batching on `batch.BatchEngine`. Jobs join between cycles while there are free rows
  (their prompts prefilled one chunk per cycle, so running streams keep flowing), each
  from the longest cached prefix among the caches of earlier answers (a pool bounded in
  count and, with every row's live caches, in bytes); a finished, cancelled or ended job
  leaves at once and frees its row.
- **one at a time** (other targets, or `max_batch` 1): `stream_generate` per job with one
  `PromptCache` whose snapshots serve caches that cannot be trimmed (Gated DeltaNet state).

Either way a full queue answers 429 with a Retry-After estimate; a stopping server 503.
What each job's engine responses become (text pieces, stop strings, logprobs, usage)
is `JobAnswer`, the same for both.
"""

import asyncio
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

from dflash_mlx.engine.engine import BatchEngine, BatchRequest
from dflash_mlx.engine.batch_caches import batch_support
from dflash_mlx.generate import encode_prompt, stream_generate
from dflash_mlx.models.loading import apply_chat_template
from dflash_mlx.options import GenerationOptions
from dflash_mlx.engine.prompt_cache import PromptCache, make_prompt_cache, nbytes
from dflash_mlx.serve.requests import GenerationRequest, RequestError, StopMatcher
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.tool_calls import with_tool_calling

DEFAULT_PROMPT_CACHE_BYTES = 1 << 30  # cached conversations (and, batched, the rows' caches): 1 GiB


def default_max_batch() -> int:
    """Rows decoding at once by default: one per 3 GiB of memory, 1 to 16 (8 on a 24 GiB machine)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8
    return max(1, min(16, round(memory / (3 << 30))))


@dataclass
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)  # the answer is complete: stop generating
    queued_at: float = field(default_factory=time.perf_counter)
    cycles: int = 0  # engine responses the worker has taken so far
    cancel_cycle: Optional[int] = None  # `cycles` when the cancel came

    def cancel(self):
        if not self.cancelled.is_set():
            self.cancel_cycle = self.cycles
            self.cancelled.set()

    def end(self):
        """The client has all of the answer it asked for (its one tool call): end it as served."""
        self.ended.set()

    def emit(self, kind: str, payload: Any = None):
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


class JobAnswer:
    """One job's engine responses as events: text pieces (stop strings held back and cut,
    logprobs), then "done" with the finish reason and usage, or the cancellation."""

    def __init__(self, worker: "Worker", job: Job):
        self.worker, self.job = worker, job
        self.matcher = StopMatcher(job.request.stop)
        self.started = time.perf_counter()
        self.first, self.last, self.finish, self.stop_matched = True, None, None, False
        self.widths: Dict[int, int] = {}
        self.lead = ""

    def feed(self, r) -> bool:
        """Take one engine response; True when the answer is over (a finish, a stop string,
        the client ended or cancelled it)."""
        job, req = self.job, self.job.request
        job.cycles += 1
        if self.first:
            self.first = False
            if req.kind == "completion":
                self.lead = self.worker._lost_leading_space(r.token)
        self.last = r
        if r.verify_width is not None:
            self.widths[r.verify_width] = self.widths.get(r.verify_width, 0) + 1
        text = r.text
        if self.lead and text:
            text = text if text.startswith(self.lead) else self.lead + text
            self.lead = ""
        text, self.stop_matched = self.matcher.feed(text)
        lps = r.logprobs
        if lps is not None and r.finish_reason == "stop":
            lps = lps[:-1]  # the stop token is not part of the answer
        if text or lps:
            job.emit("text", (text, lps))
        if self.stop_matched:
            self.finish = "stop"
        elif r.finish_reason is not None:
            self.finish = r.finish_reason
        elif job.ended.is_set():
            self.finish = "stop"
        return self.finish is not None or job.cancelled.is_set()

    def complete(self):
        """Emit the end: "done" with usage, or (cancelled) "done" without, or the shutdown error."""
        job, worker, last = self.job, self.worker, self.last
        if self.finish is None:  # cancelled (or the server stopping)
            worker.counts["cancelled"] += 1
            worker.cycles_after_cancel.append(job.cycles - (job.cancel_cycle or job.cycles))
            job.emit(*(("error", shutting_down()) if worker.stopping else ("done", None)))
            return
        tail = "" if self.stop_matched else self.matcher.flush()  # held back for a stop string that never came
        if tail:
            job.emit("text", (tail, None))
        worker.counts["served"] += 1
        worker.served_seconds.append(time.perf_counter() - self.started)
        del worker.served_seconds[:-16]
        accepts = last.accept_lengths
        reused = last.prompt_tokens - last.prefill_tokens
        usage = {
            "prompt_tokens": last.prompt_tokens,
            "completion_tokens": last.generation_tokens,
            "total_tokens": last.prompt_tokens + last.generation_tokens,
            "prompt_tokens_details": {"cached_tokens": reused},
            "dflash": {
                "tau": last.tau,
                "mean_accept_length": sum(accepts) / len(accepts) if accepts else 0.0,
                "cycles": len(accepts),
                "verify_widths": {str(k): v for k, v in sorted(self.widths.items())},
                "prompt_tokens_reused": reused,
                "prefill_tokens": last.prefill_tokens,
                "prompt_tokens_per_second": last.prompt_tps,
                "tokens_per_second": last.generation_tps,
                "queue_seconds": self.started - job.queued_at,
                "seconds": time.perf_counter() - self.started,
                "block_size": job.request.options.block_size,
                "draft": worker.draft_name,
            },
        }
        job.emit("done", {"finish_reason": self.finish, "usage": usage,
                          "stop_sequence": self.matcher.matched if self.stop_matched else None})


class Worker:
    """Runs the engine in its own thread: batched, or one job at a time (see the module)."""

    def __init__(self, model, draft, tokenizer, model_name: str, draft_name: Optional[str] = None,
                 options: Optional[GenerationOptions] = None, queue_size: int = 16, max_snapshots: int = 4,
                 prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES, max_batch: Optional[int] = None):
        """`options`: the server's block size and draft sampling, and the defaults of the
        request fields (max_tokens and sampling). `max_snapshots`, `prompt_cache_bytes`:
        the bounds of the cached conversations (by count and by bytes; batched, the rows'
        live caches count toward the bytes too). `max_batch`: rows decoding at once
        (None: `default_max_batch()`; 1: one job at a time)."""
        if queue_size < 1:
            raise ValueError(f"queue_size must be at least 1, got {queue_size}")
        if prompt_cache_bytes is not None and prompt_cache_bytes < 0:
            raise ValueError(f"prompt_cache_bytes must be >= 0, got {prompt_cache_bytes}")
        self.model, self.draft = model, draft
        self.tokenizer = with_tool_calling(
            tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer))
        self.model_name, self.draft_name = model_name, draft_name
        self.model_ids = {model_name}
        self.options = (options or GenerationOptions(max_tokens=512)).check()
        self.queue_size = queue_size
        self.max_snapshots = max_snapshots
        self.max_bytes = prompt_cache_bytes
        # MLX streams belong to the thread that made them: an array still lazy here
        # (weights loaded lazily, a draft's vocabulary ids) could not be evaluated
        # by the worker thread, so everything is evaluated now.
        mx.eval(model.parameters())
        if draft is not None:
            mx.eval(draft.parameters(), [v for v in vars(draft).values() if isinstance(v, mx.array)])
        target = getattr(draft, "target", None) or Target(model)
        self.context_window = target.max_context
        self.recurrent = target.recurrent
        self.vocab_size = target.vocab_size
        self.max_batch = default_max_batch() if max_batch is None else max_batch
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        self.batch_refused = batch_support(target) if self.max_batch > 1 else "max_batch is 1"
        self.engine: Optional[BatchEngine] = None
        if self.batch_refused is None:
            self.engine = BatchEngine(model, draft, self.tokenizer, max_batch=self.max_batch,
                                      block_size=self.options.block_size)
        # cached conversations: one PromptCache (with snapshots) one at a time; batched, a pool
        self.cache = (make_prompt_cache(model, draft, max_snapshots=max_snapshots, max_bytes=prompt_cache_bytes)
                      if self.engine is None else None)
        self.pool: "OrderedDict[int, PromptCache]" = OrderedDict()
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue(maxsize=queue_size)
        self.current: Optional[Job] = None
        self.active: Dict[int, tuple] = {}  # batched: row uid -> (job, answer, row)
        self.stopping = False
        self.counts = {"served": 0, "cancelled": 0, "rejected": 0, "failed": 0}
        self.cycles_after_cancel: List[int] = []  # per cancelled job: engine cycles run after the cancel
        self.served_seconds: List[float] = []  # the last answers' service times (for Retry-After)
        self._thread = threading.Thread(target=self._run if self.engine is None else self._run_batched,
                                        name="dflash-engine", daemon=True)
        self._thread.start()

    @property
    def scheduling(self) -> str:
        if self.engine is not None:
            return (f"continuous batching: up to {self.max_batch} rows decode together, new requests join "
                    "between cycles, from a bounded queue")
        return f"one request at a time, first come first served, from a bounded queue ({self.batch_refused})"

    # -- prompts

    def encode_text(self, text: str) -> List[int]:
        return encode_prompt(self.tokenizer, text)

    def encode_chat(self, messages, tools=None) -> List[int]:
        try:
            text = apply_chat_template(self.tokenizer, messages, tools=tools)
        except Exception as e:  # jinja's TemplateError, or the template's own raise_exception
            raise RequestError(f"the model's chat template refused the messages: {e}", param="messages") from None
        return self.encode_text(text)

    # -- scheduling

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue ahead, served a batch of rows at a
        time, at the recent answers' mean service time (1 s before any was served)."""
        mean = sum(self.served_seconds) / len(self.served_seconds) if self.served_seconds else 1.0
        slots = self.max_batch if self.engine is not None else 1
        return max(1, round(mean * (self.jobs.qsize() + slots) / slots))

    def submit(self, job: Job):
        if self.stopping:
            raise shutting_down()
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self.counts["rejected"] += 1
            raise RequestError(
                f"the server is busy: {self.queue_size} requests are already waiting; retry shortly",
                status=429, code="queue_full", type="rate_limit_error", retry_after=self.retry_after(),
            ) from None

    def health(self) -> dict:
        out = {
            "status": "ok",
            "model": self.model_name,
            "draft": self.draft_name,
            "block_size": self.options.block_size,
            "scheduling": self.scheduling,
            "busy": self.current is not None or bool(self.active),
            "queued": self.jobs.qsize(),
            "queue_size": self.queue_size,
            **self.counts,
        }
        if self.engine is not None:
            stats = self.engine.stats()  # read from another thread: a moment's view
            out["batch"] = stats
            # the one-at-a-time keys: kept conversations as "snapshots", the rows' caches as "live"
            out["prompt_cache"] = {"snapshots": len(self.pool), "max_snapshots": self.max_snapshots,
                                   "snapshot_bytes": self._pool_bytes(), "live_bytes": self._rows_bytes(),
                                   "max_bytes": self.max_bytes}
        else:
            out["prompt_cache"] = self.cache.stats()
        return out

    def stop(self, timeout: float = 10.0):
        """Refuse the waiting jobs, cancel the running ones, and end the thread (idempotent)."""
        self.stopping = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit("error", shutting_down())
        for job in [self.current] + [entry[0] for entry in list(self.active.values())]:
            if job is not None:
                job.cancel()
        if self._thread.is_alive():
            self.jobs.put(None)
            self._thread.join(timeout)

    def _lost_leading_space(self, token: int) -> str:
        """" " when the streaming detokenizer drops the first token's leading space.

        mlx-lm's BPE detokenizer starts every answer without it, right for a chat
        answer but not for a completion, whose text continues the prompt.
        """
        if not isinstance(self.tokenizer.detokenizer, BPEStreamingDetokenizer):
            return ""
        return " " if self.tokenizer.decode([token]).startswith(" ") else ""

    def _failed(self, job: Job, e: Exception):
        if isinstance(e, RequestError):
            job.emit("error", e)
            return
        self.counts["failed"] += 1  # keep serving: one failed request must not stop the server
        job.emit("error", RequestError(f"generation failed: {type(e).__name__}: {e}", status=500,
                                       type="server_error"))

    def _options(self, req: GenerationRequest) -> GenerationOptions:
        options = req.options
        if self.context_window:
            options = replace(options, max_tokens=min(options.max_tokens, self.context_window - len(req.prompt_ids)))
        return options

    # -- one at a time

    def _run(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.current = job
            try:
                if self.stopping:  # taken between stop()'s drain and its cancel
                    job.emit("error", shutting_down())
                elif job.cancelled.is_set():
                    self.counts["cancelled"] += 1
                    self.cycles_after_cancel.append(0)
                    job.emit("done", None)
                else:
                    self._generate(job)
            except Exception as e:
                self._failed(job, e)
            finally:
                self.current = None

    def _generate(self, job: Job):
        req = job.request
        answer = JobAnswer(self, job)
        try:
            stream = stream_generate(
                self.model, self.draft, self.tokenizer, req.prompt_ids, prompt_cache=self.cache,
                baseline=self.draft is None, logprobs=req.logprobs, **self._options(req).generate_kwargs(),
            )
            for r in stream:
                if answer.first and self.recurrent:
                    self.cache.snapshot()  # end of the prompt: recurrent state cannot be trimmed back here
                if answer.feed(r):
                    break
            stream.close()
        except ValueError as e:
            raise RequestError(str(e)) from None
        answer.complete()

    # -- batched

    def _run_batched(self):
        engine = self.engine
        while True:
            if not self._admit():
                return
            if engine.idle:
                continue
            try:
                # joined requests' first tokens go out before the cycle of the running rows
                for step in (engine.prefill_step, engine.decode_step):
                    for row, r in step():
                        job, answer, _ = self.active[row.uid]
                        if answer.feed(r) and not row.done:
                            engine.remove(row)
            except Exception as e:  # the batch is lost: fail its jobs, start a new engine
                for job, _, _ in self.active.values():
                    self._failed(job, e)
                self.active.clear()
                self.engine = engine = BatchEngine(self.model, self.draft, self.tokenizer, max_batch=self.max_batch,
                                                   block_size=self.options.block_size)
                continue
            for uid, (job, answer, row) in list(self.active.items()):
                if not row.done and (job.cancelled.is_set() or job.ended.is_set()):
                    engine.remove(row)
                if row.done:
                    del self.active[uid]
                    answer.complete()
                    if row.state.valid and row.state.tokens:
                        self._keep(row.state)

    def _admit(self) -> bool:
        """Take waiting jobs into free rows (waiting for one when nothing runs); False: stop."""
        engine = self.engine
        while engine.room > 0 and self._bytes_left():
            try:
                job = self.jobs.get(block=engine.idle)
            except queue.Empty:
                return True
            if job is None:
                for j, _, _ in self.active.values():
                    j.emit("error", shutting_down())
                return False
            if self.stopping:
                job.emit("error", shutting_down())
                continue
            if job.cancelled.is_set():
                self.counts["cancelled"] += 1
                self.cycles_after_cancel.append(0)
                job.emit("done", None)
                continue
            req = job.request
            try:
                row = engine.add(BatchRequest(req.prompt_ids, self._options(req), logprobs=req.logprobs,
                                              prompt_cache=self._take(req.prompt_ids)))
            except ValueError as e:
                job.emit("error", RequestError(str(e)))
                continue
            except Exception as e:
                self._failed(job, e)
                continue
            self.active[row.uid] = (job, JobAnswer(self, job), row)
        return True

    # -- cached conversations (batched)

    def _take(self, prompt_ids: List[int]) -> Optional[PromptCache]:
        """The pooled conversation sharing the longest prefix with `prompt_ids` (taken out of
        the pool: a row owns its caches), or None for new ones."""
        best, best_len = None, 0
        for key, state in self.pool.items():
            n = 0
            for a, b in zip(state.tokens, prompt_ids):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = key, n
        return self.pool.pop(best) if best is not None else None

    def _keep(self, state: PromptCache):
        if self.max_snapshots < 1:
            return
        self.pool[id(state)] = state
        while len(self.pool) > self.max_snapshots:
            self.pool.popitem(last=False)
        self._evict()

    def _pool_bytes(self) -> int:
        return sum(s.live_bytes + s.snapshot_bytes for s in list(self.pool.values()))

    def _rows_bytes(self) -> int:
        engine = self.engine
        rows = list(engine.rows) + list(engine.joining)
        # a lone row decodes on its own PromptCache's caches, which are the engine's then
        batch = nbytes(engine.cache) if engine.batched else 0
        return batch + sum(nbytes(r.state.draft_cache) + nbytes(r.state.target_cache) + r.state.snapshot_bytes
                           for r in rows)

    def _evict(self):
        """Least recently used conversations out while rows and pool hold more than `max_bytes`."""
        if self.max_bytes is None:
            return
        while self.pool and self._pool_bytes() + self._rows_bytes() > self.max_bytes:
            self.pool.popitem(last=False)

    def _bytes_left(self) -> bool:
        """Whether another row may join: the rows' caches leave room under `max_bytes`
        (conversations in the pool go first; with nothing running a job always runs)."""
        if self.max_bytes is None or self.engine.idle:
            return True
        self._evict()
        return self._rows_bytes() < self.max_bytes


def shutting_down() -> RequestError:
    return RequestError("the server is shutting down; retry on its next start", status=503,
                        code="shutting_down", type="server_error")
