"""The server's scheduler: one engine thread serving jobs from a bounded queue.

Two ways, chosen at start:

- **batched** (`max_batch` > 1 on a target `batch_caches.batch_support` accepts): continuous
  batching on `engine.BatchEngine`, a step at a time (`steps`): before each step, the rows
  whose answer is over, cancelled or ended leave and waiting jobs join into the free rows
  (their prompts prefilled one chunk per step, so running streams keep flowing), each from
  the longest cached prefix among the caches of earlier answers (`cache_pool.CachePool`,
  bounded in count and, with every row's live caches, in bytes).
- **one at a time** (other targets, or `max_batch` 1): `stream_generate` per job with one
  `PromptCache` whose snapshots serve caches that cannot be trimmed (Gated DeltaNet state).

Either way a full queue answers 429 with a Retry-After estimate; a stopping server 503.
What each job's engine responses become (text pieces, stop strings, logprobs, usage)
is `jobs.JobAnswer`, the same for both.

On a target split over processes (`mlx.launch`) every rank runs a worker and the same
engine steps; rank 0's worker decides each step's events and shares them with the others,
which serve nothing (`ranks`). Such a target is always served batched, one row at a time
where it does not batch.
"""

import os
import queue
import threading
from dataclasses import replace
from typing import Dict, List, Optional

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.engine.batch_caches import batch_support
from dflash_mlx.generate import encode_prompt, stream_generate, tokens_to_window
from dflash_mlx.models.loading import apply_chat_template
from dflash_mlx.options import GenerationOptions
from dflash_mlx.engine.prompt_cache import make_prompt_cache
from dflash_mlx.models.target import kv_quantization, kv_window
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.models.target.tree_attention import tree_support
from dflash_mlx.serve.cache_pool import DEFAULT_PROMPT_CACHE_BYTES, CachePool
from dflash_mlx.serve.jobs import Job, JobAnswer, shutting_down
from dflash_mlx.serve.ranks import Ranks
from dflash_mlx.serve.steps import run_batched
from dflash_mlx.serve.requests import GenerationRequest, RequestError
from dflash_mlx.speculation.suffix_index import DEFAULT_SUFFIX_INDEX_BYTES, SuffixIndex
from dflash_mlx.tool_calls import with_tool_calling


def default_max_batch() -> int:
    """Rows decoding at once by default: one per 3 GiB of memory, 1 to 16 (8 on a 24 GiB machine)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8
    return max(1, min(16, round(memory / (3 << 30))))


class Worker:
    """Runs the engine in its own thread: batched, or one job at a time (see the module)."""

    def __init__(self, model, draft, tokenizer, model_name: str, draft_name: Optional[str] = None,
                 options: Optional[GenerationOptions] = None, queue_size: int = 16, max_snapshots: int = 4,
                 prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES, max_batch: Optional[int] = None,
                 baseline: bool = False, global_copies_bytes: int = DEFAULT_SUFFIX_INDEX_BYTES,
                 deterministic: bool = False, kv_cache: Optional[dict] = None,
                 chat_template_args: Optional[dict] = None, prefill_step_size: int = 2048):
        """`options`: the server's block size and draft sampling, and the defaults of the
        request fields (max_tokens and sampling). `max_snapshots`, `prompt_cache_bytes`:
        the bounds of the cached conversations (by count and by bytes; batched, the rows'
        live caches count toward the bytes too). `max_batch`: rows decoding at once
        (None: `default_max_batch()`; 1: one job at a time). `baseline`: plain decoding, nothing
        else (with `draft` None and no `baseline`, copies of the context where they pay).
        `global_copies_bytes`: the bound of the index of earlier requests' prompts and answers
        that every request not opting out copies from and adds to (0: none). `deterministic`:
        every target row in plain decoding's shapes (`models.target.exact_rows`), one request at a
        time (a batch's rows are not plain decoding's shapes). `kv_cache`: mlx-lm's quantized KV cache
        (`stream_generate`'s `kv_bits`, `kv_group_size`, `quantized_kv_start`) for every request, one at a
        time, as mlx-lm's server serves it (its batch caches have no quantized kind); a target whose caches
        cannot be quantized so is refused here, in one line; its `max_kv_size`, mlx-lm's bounded cache, also one
        request at a time (its batch windows keep no front tokens). `chat_template_args`: arguments for every
        chat request's template (mlx-lm's server's `--chat-template-args`); a request's own
        `chat_template_kwargs` override them. `prefill_step_size`: prompt tokens a prefill forward runs at most
        (mlx-lm's server's flag)."""
        if queue_size < 1:
            raise ValueError(f"queue_size must be at least 1, got {queue_size}")
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be at least 1, got {prefill_step_size}")
        self.prefill_step_size = prefill_step_size
        if prompt_cache_bytes is not None and prompt_cache_bytes < 0:
            raise ValueError(f"prompt_cache_bytes must be >= 0, got {prompt_cache_bytes}")
        self.model, self.draft, self.baseline = model, (None if baseline else draft), baseline
        self.tokenizer = with_tool_calling(
            tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer))
        self.model_name, self.draft_name = model_name, draft_name
        self.model_ids = {model_name}
        self.options = (options or GenerationOptions(max_tokens=512)).check()
        self.queue_size = queue_size
        self.max_snapshots = max_snapshots
        self.max_bytes = prompt_cache_bytes
        # earlier requests' prompts and answers, shared by all requests (used on the engine thread)
        self.suffix_index = (SuffixIndex(global_copies_bytes, model=model)
                             if global_copies_bytes > 0 and not baseline else None)
        # MLX streams belong to the thread that made them: an array still lazy here
        # (weights loaded lazily, a draft's vocabulary ids) could not be evaluated
        # by the worker thread, so everything is evaluated now.
        mx.eval(model.parameters())
        if draft is not None:
            mx.eval(draft.parameters(), [v for v in vars(draft).values() if isinstance(v, mx.array)])
        target = getattr(draft, "target", None) or Target(model)
        self.deterministic = deterministic
        if deterministic:
            target.deterministic = True  # refuses, in one line, a target it cannot run so
            max_batch = 1
        self.kv_cache = dict(kv_cache or {})
        self.chat_template_args = dict(chat_template_args or {})
        quantized = {k: v for k, v in self.kv_cache.items() if k != "max_kv_size"}
        self.max_kv_size = kv_window.checked_max_kv_size(self.kv_cache.get("max_kv_size"))
        if self.max_kv_size is not None and kv_window.bounds(model):  # (first: refused beside kv_bits)
            kv_window.check(target, quantized=bool(quantized))
            max_batch = 1
        if quantized:
            kv_quantization.check(target, kv_quantization.make_kv_quantization(**quantized))
            max_batch = 1
        self.context_window = target.max_context
        self.recurrent = target.recurrent
        self.vocab_size = target.vocab_size
        self.max_batch = default_max_batch() if max_batch is None else max_batch
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        self.batch_refused = batch_support(target) if self.max_batch > 1 else "max_batch is 1"
        self.ranks = Ranks(target)
        self.failed: Optional[str] = None  # why the engine thread stopped (one line)
        self.ended = threading.Event()  # the batched engine thread is done (`ranks.follow` waits on it)
        self.engine: Optional[BatchEngine] = None
        if self.ranks.size > 1:
            # every rank runs the engine's steps, so a target that does not batch runs its rows one
            # at a time there; the tree probe (a forward) runs now, on every rank, not when rank 0
            # admits a request (`steps.decide` runs no collective)
            self.max_batch = self.max_batch if self.batch_refused is None else 1
            tree_support(target)
        if self.batch_refused is None or self.ranks.size > 1:
            self.engine = self._new_engine()
        # cached conversations: one PromptCache (with snapshots) one at a time; batched, a pool
        self.cache = (make_prompt_cache(model, self.draft, max_snapshots=max_snapshots, max_bytes=prompt_cache_bytes,
                                        max_kv_size=self.max_kv_size)
                      if self.engine is None else None)
        self.pool = CachePool(max_snapshots, prompt_cache_bytes)
        self.shared_keys: List[int] = []  # the pool's keys the other ranks last heard of (`steps`)
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue(maxsize=queue_size)
        self.current: Optional[Job] = None
        self.active: Dict[int, tuple] = {}  # batched: row uid -> (job, answer, row)
        self.stopping = False
        self.counts = {"served": 0, "cancelled": 0, "rejected": 0, "failed": 0}
        self.cycles_after_cancel: List[int] = []  # per cancelled job: engine cycles run after the cancel
        self.served_seconds: List[float] = []  # the last answers' service times (for Retry-After)
        run, args = (self._run, ()) if self.engine is None else (run_batched, (self,))
        self._thread = threading.Thread(target=run, args=args, name="dflash-engine", daemon=True)
        self._thread.start()

    @property
    def scheduling(self) -> str:
        split = f", on {self.ranks.size} ranks" if self.ranks.size > 1 else ""
        if self.engine is not None and self.max_batch > 1:
            return (f"continuous batching: up to {self.max_batch} rows decode together{split}, new requests join "
                    "between cycles, from a bounded queue")
        return f"one request at a time{split}, first come first served, from a bounded queue ({self.batch_refused})"

    # -- prompts

    def encode_text(self, text: str) -> List[int]:
        return encode_prompt(self.tokenizer, text)

    def encode_chat(self, messages, tools=None, template_kwargs: Optional[dict] = None) -> List[int]:
        try:
            text = apply_chat_template(self.tokenizer, messages, tools=tools,
                                       template_kwargs=dict(self.chat_template_args, **(template_kwargs or {})))
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
        out["global_copies"] = self.suffix_index.stats() if self.suffix_index is not None else None
        if self.engine is not None:
            out["batch"] = self.engine.stats()  # read from another thread: a moment's view
            out["prompt_cache"] = self.pool.stats(self.engine)
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

    def stopped(self) -> bool:
        """Whether the engine thread has ended."""
        return not self._thread.is_alive()

    def _cancelled_waiting(self, job: Job):
        """A job cancelled while it waited: answered without running a cycle."""
        self.counts["cancelled"] += 1
        self.cycles_after_cancel.append(0)
        job.emit("done", None)

    def _failed(self, job: Job, e: Exception):
        if isinstance(e, RequestError):
            job.emit("error", e)
            return
        self.counts["failed"] += 1  # keep serving: one failed request must not stop the server
        job.emit("error", RequestError(f"generation failed: {type(e).__name__}: {e}", status=500,
                                       type="server_error"))

    def _options(self, req: GenerationRequest) -> GenerationOptions:
        options = req.options
        return replace(options, max_tokens=tokens_to_window(self.context_window, len(req.prompt_ids),
                                                            options.max_tokens))

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
                    self._cancelled_waiting(job)
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
                baseline=self.baseline, logprobs=req.logprobs, deterministic=self.deterministic,
                **self.kv_cache, **self._options(req).generate_kwargs(), prefill_step_size=self.prefill_step_size,
                suffix_index=self.suffix_index if req.global_copies else None,
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

    # -- batched (`steps`)

    def _new_engine(self) -> BatchEngine:
        return BatchEngine(self.model, self.draft, self.tokenizer, max_batch=self.max_batch,
                           block_size=1 if self.baseline else self.options.block_size,
                           copy_proposals=not self.baseline, suffix_index=self.suffix_index,
                           prefill_chunk=self.prefill_step_size)
