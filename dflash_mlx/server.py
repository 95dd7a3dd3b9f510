"""`dflash-mlx serve`: an OpenAI-compatible HTTP server on the DFlash engine.

FastAPI on uvicorn. One target + draft are loaded at start; a single worker
thread runs `stream_generate` for one request at a time, taken from a bounded
queue (a full queue answers 429). The worker keeps one `PromptCache` across
requests, so a follow-up turn prefills only its new tokens: attention caches
are trimmed to the shared prefix, and snapshots taken at request boundaries
serve caches that cannot be trimmed (Gated DeltaNet state) and conversations
that interleave. A client that goes away cancels its generation at the next
cycle.
"""

import argparse
import asyncio
import json
import queue
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional

import mlx.core as mx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from starlette.exceptions import HTTPException

from dflash_mlx.frontend import ArgumentParser, checked_options, load_model_and_draft
from dflash_mlx.generate import encode_prompt, stream_generate
from dflash_mlx.loading import apply_chat_template
from dflash_mlx.options import GenerationOptions, add_generation_args
from dflash_mlx.packaged import DEFAULT_MODEL
from dflash_mlx.prompt_cache import make_prompt_cache
from dflash_mlx.target import Target

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
SCHEDULING = "one request at a time, first come first served, from a bounded queue"


# -- requests -------------------------------------------------------------------


class RequestError(Exception):
    """A request the server refuses, as an OpenAI-style error object."""

    def __init__(self, message, param=None, status=400, code=None, type="invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class GenerationRequest:
    kind: str  # "chat" | "completion"
    prompt_ids: List[int]
    options: GenerationOptions  # the engine's arguments: the server's block size, the request's sampling
    stop: List[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


_MISSING = object()

# Fields whose other values ask for something the server does not do: refused
# rather than silently ignored. (Sampling penalties and other extras are ignored.)
_UNSUPPORTED = {
    "tools": (None, []),
    "functions": (None, []),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}


def _field(body, name, types, what, default=_MISSING):
    value = body.get(name, default)
    if value is _MISSING:
        raise RequestError(f"'{name}' is required: give {what}", param=name)
    if value is None or value is default:
        return value
    # bool is an int in Python; a JSON true is never a number here
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise RequestError(f"'{name}' must be {what}, got {json.dumps(value)[:60]}", param=name)
    return value


def _message_text(content, i) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text ones can be served
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(
                    f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                    param=f"messages[{i}].content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content")


def parse_request(raw: bytes, kind: str, worker: "Worker") -> GenerationRequest:
    """Validate an OpenAI request body; raise RequestError naming what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")

    model = _field(body, "model", (str,), "a model id from GET /v1/models", default=None)
    if model is not None and model not in worker.model_ids:
        raise RequestError(
            f"model '{model}' is not served here: use '{worker.model_name}' (GET /v1/models)",
            param="model", status=404, code="model_not_found",
        )
    for name, served in _UNSUPPORTED.items():
        if body.get(name) not in served:
            raise RequestError(f"'{name}' is not supported by this server: leave it out", param=name)
    n = _field(body, "n", (int,), "1", default=1)
    if n != 1:
        raise RequestError(f"'n' must be 1 (one choice per request), got {n}", param="n")

    if kind == "chat":
        messages = _field(body, "messages", (list,), "a non-empty list of messages")
        if not messages:
            raise RequestError("'messages' is empty: give at least one message", param="messages")
        chat = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")
            chat.append({"role": m["role"], "content": _message_text(m.get("content") or "", i)})
        prompt_ids = worker.encode_chat(chat)
    else:
        prompt = _field(body, "prompt", (str, list), "a string or a list of token ids")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list):
            vocab = worker.vocab_size
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
                raise RequestError(
                    f"'prompt' as a list must be one string or token ids in [0, {vocab})", param="prompt"
                )
            prompt_ids = list(prompt)
        else:
            if not prompt:
                raise RequestError("'prompt' is empty: give some text", param="prompt")
            prompt_ids = worker.encode_text(prompt)
    if not prompt_ids:
        raise RequestError("the prompt encodes to no tokens", param="messages" if kind == "chat" else "prompt")

    max_tokens = _field(body, "max_completion_tokens", (int,), "an integer >= 1", default=None)
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", (int,), "an integer >= 1", default=None)
    if max_tokens is None:
        max_tokens = worker.options.max_tokens
    elif max_tokens < 1:
        raise RequestError(f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens")

    window = worker.context_window
    if window and len(prompt_ids) >= window:
        raise RequestError(
            f"the prompt is {len(prompt_ids)} tokens, past the model's context window of {window} tokens: "
            "shorten it", param="messages" if kind == "chat" else "prompt", code="context_length_exceeded",
        )

    sampling = {}
    for name, types, what, ok in (
        ("temperature", (int, float), "a number in [0, 2]", lambda v: 0 <= v <= 2),
        ("top_p", (int, float), "a number in (0, 1]", lambda v: 0 < v <= 1),
        ("top_k", (int,), "a whole number >= 0", lambda v: v >= 0),  # mlx-lm's server takes these two too
        ("min_p", (int, float), "a number in [0, 1]", lambda v: 0 <= v <= 1),
        ("seed", (int,), "an integer", lambda v: True),
    ):
        value = _field(body, name, types, what, default=None)
        if value is not None:
            if not ok(value):
                raise RequestError(f"'{name}' must be {what}, got {value}", param=name)
            sampling[name] = value
    options = replace(worker.options, max_tokens=max_tokens, **sampling)
    try:
        options.check()
    except ValueError as e:
        raise RequestError(str(e)) from None

    stop = _field(body, "stop", (str, list), "a string or a list of strings", default=None)
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError("'stop' must be a non-empty string or a list of non-empty strings", param="stop")

    stream = _field(body, "stream", (bool,), "true or false", default=False)
    stream_options = _field(body, "stream_options", (dict,), "an object", default=None) or {}
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("'stream_options.include_usage' must be true or false", param="stream_options")
    return GenerationRequest(kind, prompt_ids, options, list(stop), bool(stream), include_usage)


# -- stop strings ---------------------------------------------------------------


class StopMatcher:
    """Cuts streamed text at the first stop string, also one spread over several tokens.

    Text that could still be the start of a stop string is held back until the
    next piece shows whether it is.
    """

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str):
        """(text safe to send now, whether a stop string matched)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return buf[:cut], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


# -- the worker -----------------------------------------------------------------


@dataclass
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)
    cycles: int = 0  # engine responses the worker has taken so far
    cancel_cycle: Optional[int] = None  # `cycles` when the cancel came

    def cancel(self):
        if not self.cancelled.is_set():
            self.cancel_cycle = self.cycles
            self.cancelled.set()

    def emit(self, kind: str, payload: Any = None):
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


class Worker:
    """Runs the engine for one job at a time, in its own thread, with one prompt cache."""

    def __init__(self, model, draft, tokenizer, model_name: str, draft_name: Optional[str] = None,
                 options: Optional[GenerationOptions] = None, queue_size: int = 16, max_snapshots: int = 4):
        """`options`: the server's block size and draft sampling, and the defaults of the
        request fields (max_tokens and sampling)."""
        if queue_size < 1:
            raise ValueError(f"queue_size must be at least 1, got {queue_size}")
        self.model, self.draft = model, draft
        self.tokenizer = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
        self.model_name, self.draft_name = model_name, draft_name
        self.model_ids = {model_name}
        self.options = (options or GenerationOptions(max_tokens=512)).check()
        self.queue_size = queue_size
        # MLX streams belong to the thread that made them: an array still lazy here
        # (weights loaded lazily, a draft's vocabulary ids) could not be evaluated
        # by the worker thread, so everything is evaluated now.
        mx.eval(model.parameters())
        if draft is not None:
            mx.eval(draft.parameters(), [v for v in vars(draft).values() if isinstance(v, mx.array)])
        self.cache = make_prompt_cache(model, draft, max_snapshots=max_snapshots)
        target = getattr(draft, "target", None) or Target(model)
        self.context_window = target.max_context
        self.recurrent = target.recurrent
        self.vocab_size = target.vocab_size
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue(maxsize=queue_size)
        self.current: Optional[Job] = None
        self.stopping = False
        self.counts = {"served": 0, "cancelled": 0, "rejected": 0, "failed": 0}
        self.cycles_after_cancel: List[int] = []  # per cancelled job: engine cycles run after the cancel
        self._thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
        self._thread.start()

    # -- prompts

    def encode_text(self, text: str) -> List[int]:
        return encode_prompt(self.tokenizer, text)

    def encode_chat(self, messages) -> List[int]:
        try:
            text = apply_chat_template(self.tokenizer, messages)
        except Exception as e:  # jinja's TemplateError, or the template's own raise_exception
            raise RequestError(f"the model's chat template refused the messages: {e}", param="messages") from None
        return self.encode_text(text)

    # -- scheduling

    def submit(self, job: Job):
        if self.stopping:
            raise _shutting_down()
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self.counts["rejected"] += 1
            raise RequestError(
                f"the server is busy: {self.queue_size} requests are already waiting; retry shortly",
                status=429, code="queue_full", type="rate_limit_error",
            ) from None

    def health(self) -> dict:
        return {
            "status": "ok",
            "model": self.model_name,
            "draft": self.draft_name,
            "block_size": self.options.block_size,
            "scheduling": SCHEDULING,
            "busy": self.current is not None,
            "queued": self.jobs.qsize(),
            "queue_size": self.queue_size,
            "prompt_cache": {"tokens": len(self.cache.tokens), "snapshots": len(self.cache.snapshots)},
            **self.counts,
        }

    def stop(self, timeout: float = 10.0):
        """Refuse the waiting jobs, cancel the running one, and end the thread (idempotent)."""
        self.stopping = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit("error", _shutting_down())
        job = self.current
        if job is not None:
            job.cancel()
        if self._thread.is_alive():
            self.jobs.put(None)
            self._thread.join(timeout)

    def _run(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.current = job
            try:
                if self.stopping:  # taken between stop()'s drain and its cancel
                    job.emit("error", _shutting_down())
                elif job.cancelled.is_set():
                    self.counts["cancelled"] += 1
                    self.cycles_after_cancel.append(0)
                    job.emit("done", None)
                else:
                    self._generate(job)
            except RequestError as e:
                job.emit("error", e)
            except Exception as e:  # keep serving: one failed request must not stop the server
                self.counts["failed"] += 1
                job.emit("error", RequestError(f"generation failed: {type(e).__name__}: {e}", status=500,
                                               type="server_error"))
            finally:
                self.current = None

    def _lost_leading_space(self, token: int) -> str:
        """" " when the streaming detokenizer drops the first token's leading space.

        mlx-lm's BPE detokenizer starts every answer without it, right for a chat
        answer but not for a completion, whose text continues the prompt.
        """
        if not isinstance(self.tokenizer.detokenizer, BPEStreamingDetokenizer):
            return ""
        return " " if self.tokenizer.decode([token]).startswith(" ") else ""

    def _generate(self, job: Job):
        req = job.request
        started = time.perf_counter()
        matcher = StopMatcher(req.stop)
        options = req.options
        if self.context_window:
            options = replace(options, max_tokens=min(options.max_tokens, self.context_window - len(req.prompt_ids)))
        try:
            stream = stream_generate(
                self.model, self.draft, self.tokenizer, req.prompt_ids, prompt_cache=self.cache,
                baseline=self.draft is None, **options.generate_kwargs(),
            )
            first, last, finish, widths, stop_matched = True, None, None, {}, False
            lead = ""
            for r in stream:
                job.cycles += 1
                if first:
                    first = False
                    if self.recurrent:
                        self.cache.snapshot()  # end of the prompt: recurrent state cannot be trimmed back here
                    if req.kind == "completion":
                        lead = self._lost_leading_space(r.token)
                last = r
                if r.verify_width is not None:
                    widths[r.verify_width] = widths.get(r.verify_width, 0) + 1
                text = r.text
                if lead and text:
                    text = text if text.startswith(lead) else lead + text
                    lead = ""
                text, stop_matched = matcher.feed(text)
                if text:
                    job.emit("text", text)
                if stop_matched:
                    finish = "stop"
                    break
                if r.finish_reason is not None:
                    finish = r.finish_reason
                    break
                if job.cancelled.is_set():
                    break
            stream.close()
        except ValueError as e:
            raise RequestError(str(e)) from None
        if finish is None and job.cancelled.is_set():
            self.counts["cancelled"] += 1
            self.cycles_after_cancel.append(job.cycles - job.cancel_cycle)
            job.emit(*(("error", _shutting_down()) if self.stopping else ("done", None)))
            return
        tail = "" if stop_matched else matcher.flush()  # held back for a stop string that never came
        if tail:
            job.emit("text", tail)
        self.counts["served"] += 1
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
                "verify_widths": {str(k): v for k, v in sorted(widths.items())},
                "prompt_tokens_reused": reused,
                "prefill_tokens": last.prefill_tokens,
                "prompt_tokens_per_second": last.prompt_tps,
                "tokens_per_second": last.generation_tps,
                "queue_seconds": started - job.queued_at,
                "seconds": time.perf_counter() - started,
                "block_size": req.options.block_size,
                "draft": self.draft_name,
            },
        }
        job.emit("done", {"finish_reason": finish, "usage": usage})


def _shutting_down() -> RequestError:
    return RequestError("the server is shutting down; retry on its next start", status=503,
                        code="shutting_down", type="server_error")


# -- the HTTP app ---------------------------------------------------------------


def _error_response(err: RequestError):
    return JSONResponse(err.body(), status_code=err.status)


def create_app(worker: Worker):
    """The FastAPI app serving `worker`; stopping the app stops the worker."""
    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.stop()

    app = FastAPI(title="dflash-mlx", lifespan=lifespan)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        err = RequestError(str(exc.detail), status=exc.status_code,
                           type="not_found_error" if exc.status_code == 404 else "invalid_request_error")
        return _error_response(err)

    @app.exception_handler(Exception)
    async def unexpected_error(request, exc):
        return _error_response(RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                                            type="server_error"))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        return _error_response(RequestError(f"invalid request: {exc.errors()[0].get('msg')}"))

    @app.get("/health")
    async def health():
        return worker.health()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": worker.model_name, "object": "model", "created": 0, "owned_by": "dflash-mlx"}
        ]}

    async def handle(request: Request, kind: str):
        try:
            req = parse_request(await request.body(), kind, worker)
        except RequestError as e:
            return _error_response(e)
        loop = asyncio.get_running_loop()
        job = Job(req, loop, asyncio.Queue())
        try:
            worker.submit(job)
        except RequestError as e:
            return _error_response(e)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if req.stream:
            return StreamingResponse(_sse(job, kind, rid, created, worker.model_name),
                                     media_type="text/event-stream")
        return await _complete(request, job, kind, rid, created, worker.model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion")

    return app


async def _watch_disconnect(request, job: Job):
    """Cancel `job` when the client goes away (the body is read: the next message says so)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


async def _complete(request, job: Job, kind, rid, created, model):
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    pieces = []
    try:
        while True:
            event, payload = await job.events.get()
            if event == "text":
                pieces.append(payload)
            elif event == "error":
                return _error_response(payload)
            elif payload is None:  # cancelled: nobody is listening
                return JSONResponse({}, status_code=499)
            else:
                break
    finally:
        watcher.cancel()
    text = "".join(pieces)
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": payload["finish_reason"], "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": payload["finish_reason"], "logprobs": None}
        obj = "text_completion"
    return JSONResponse({"id": rid, "object": obj, "created": created, "model": model,
                         "choices": [choice], "usage": payload["usage"]})


def _sse_line(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(job: Job, kind, rid, created, model):
    """Server-sent events in OpenAI's chunk format; cancelled if the client goes away."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(text=None, finish=None, role=False):
        if kind == "chat":
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}

    try:
        if kind == "chat":
            yield _sse_line(chunk(text="", role=True))
        while True:
            event, payload = await job.events.get()
            if event == "text":
                yield _sse_line(chunk(text=payload))
            elif event == "error":
                yield _sse_line(payload.body())
                break
            elif payload is None:
                break
            else:
                yield _sse_line(chunk(finish=payload["finish_reason"]) if kind == "chat"
                                else chunk(text="", finish=payload["finish_reason"]))
                if job.request.include_usage:
                    yield _sse_line({"id": rid, "object": obj, "created": created, "model": model,
                                     "choices": [], "usage": payload["usage"]})
                break
        yield "data: [DONE]\n\n"
    finally:
        # Starlette cancels this generator when the client disconnects
        job.cancel()


# -- command line ---------------------------------------------------------------


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def build_parser():
    p = ArgumentParser(
        prog="dflash-mlx serve",
        description="OpenAI-compatible server (POST /v1/chat/completions, /v1/completions; "
        "GET /v1/models, /health) on DFlash speculative decoding.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"packaged name, .gguf file, mlx-lm folder or hub id (default: {DEFAULT_MODEL})")
    p.add_argument("--draft", help="DFlash draft: packaged name, folder or hub id "
                   "(default: the packaged draft of a packaged --model)")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default: {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})")
    # --max-tokens and the sampling flags are the defaults of a request's own fields
    add_generation_args(p, GenerationOptions(max_tokens=512))
    p.add_argument("--queue-size", type=_positive, default=16,
                   help="requests that may wait while one runs; more get 429 (default: 16)")
    p.add_argument("--snapshots", type=_count, default=4,
                   help="prompt-cache snapshots kept for prefix reuse across requests (default: 4)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="weight dtype (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--baseline", action="store_true", help="serve the target alone, without a draft")
    return p


def load_worker(args) -> Worker:
    options = checked_options(args)
    model, tokenizer, draft, draft_name = load_model_and_draft(args.model, args.draft, args.baseline,
                                                               dtype=args.dtype)
    return Worker(model, draft, tokenizer, model_name=args.model, draft_name=draft_name,
                  options=options, queue_size=args.queue_size, max_snapshots=args.snapshots)


def main(argv=None) -> int:
    """`dflash-mlx serve`; `dflash_mlx.cli.main` turns errors into one line."""
    args = build_parser().parse_args(argv)
    worker = load_worker(args)
    print(f"dflash-mlx serve: {args.model} with draft {worker.draft_name}, block size {worker.options.block_size}, "
          f"on http://{args.host}:{args.port}/v1", file=sys.stderr)
    config = uvicorn.Config(create_app(worker), host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=5)
    _serve(config, worker)
    return 0


def _serve(config, worker: Worker):
    class Server(uvicorn.Server):
        """On Ctrl-C / SIGTERM the worker stops first, so open streams end (with an
        error event) at their next cycle instead of waiting out the grace period."""

        def handle_exit(self, sig, frame):
            threading.Thread(target=worker.stop, daemon=True).start()  # it joins the worker: not on the loop
            super().handle_exit(sig, frame)

    Server(config).run()


if __name__ == "__main__":
    sys.exit(main())
