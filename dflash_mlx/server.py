"""`dflash-mlx serve`: an OpenAI- and Anthropic-compatible HTTP server on the DFlash engine.

FastAPI on uvicorn; request and response bodies are the pydantic models of
`dflash_mlx.protocol`. Routes: OpenAI's POST /v1/chat/completions and
/v1/completions (tool calls, logprobs), Anthropic's POST /v1/messages and
/v1/messages/count_tokens, GET /v1/models and /health. Errors come in each API's
own shape. One target + draft are loaded at start; a single worker thread runs
`stream_generate` for one request at a time, taken from a bounded queue (a full
queue answers 429). The worker keeps one `PromptCache` across requests, so a
follow-up turn prefills only its new tokens: attention caches are trimmed to the
shared prefix, and snapshots taken at request boundaries (bounded in bytes)
serve caches that cannot be trimmed (Gated DeltaNet state) and conversations
that interleave. A client that goes away cancels its generation at the next
cycle. Tool calls are parsed by the tokenizer's mlx-lm tool parser
(`dflash_mlx.tool_calls`).

Here: the worker (queue, prompt cache, cancellation), the app's routes and the command line.
Request bodies to `GenerationRequest`s and stop strings: `server_requests.py`; the worker's
events as each API's answers, whole or streamed: `server_answers.py`.
"""

import argparse
import asyncio
import queue
import sys
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional

import mlx.core as mx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from starlette.exceptions import HTTPException

from dflash_mlx import protocol as P
from dflash_mlx.frontend import ArgumentParser, checked_options, load_model_and_draft
from dflash_mlx.generate import encode_prompt, stream_generate
from dflash_mlx.loading import apply_chat_template
from dflash_mlx.options import GenerationOptions, add_generation_args
from dflash_mlx.packaged import DEFAULT_MODEL
from dflash_mlx.prompt_cache import make_prompt_cache
from dflash_mlx.target import Target
from dflash_mlx.server_answers import (
    anthropic_error, call_id, openai_error, anthropic_complete, anthropic_stream, openai_complete, openai_stream,
)
from dflash_mlx.server_requests import (
    GenerationRequest, RequestError, StopMatcher, anthropic_prompt, completion_request, messages_request,
    openai_chat_request,
)
from dflash_mlx.tool_calls import with_tool_calling

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
SCHEDULING = "one request at a time, first come first served, from a bounded queue"
DEFAULT_PROMPT_CACHE_BYTES = 1 << 30  # snapshots kept for prefix reuse: 1 GiB


# -- the worker -----------------------------------------------------------------


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


class Worker:
    """Runs the engine for one job at a time, in its own thread, with one prompt cache."""

    def __init__(self, model, draft, tokenizer, model_name: str, draft_name: Optional[str] = None,
                 options: Optional[GenerationOptions] = None, queue_size: int = 16, max_snapshots: int = 4,
                 prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES):
        """`options`: the server's block size and draft sampling, and the defaults of the
        request fields (max_tokens and sampling). `max_snapshots`, `prompt_cache_bytes`:
        the bounds of the prompt cache's snapshots (by count and by bytes)."""
        if queue_size < 1:
            raise ValueError(f"queue_size must be at least 1, got {queue_size}")
        self.model, self.draft = model, draft
        self.tokenizer = with_tool_calling(
            tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer))
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
        if prompt_cache_bytes is not None and prompt_cache_bytes < 0:
            raise ValueError(f"prompt_cache_bytes must be >= 0, got {prompt_cache_bytes}")
        self.cache = make_prompt_cache(model, draft, max_snapshots=max_snapshots, max_bytes=prompt_cache_bytes)
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

    def encode_chat(self, messages, tools=None) -> List[int]:
        try:
            text = apply_chat_template(self.tokenizer, messages, tools=tools)
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
            "prompt_cache": self.cache.stats(),
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
                baseline=self.draft is None, logprobs=req.logprobs, **options.generate_kwargs(),
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
                lps = r.logprobs
                if lps is not None and r.finish_reason == "stop":
                    lps = lps[:-1]  # the stop token is not part of the answer
                if text or lps:
                    job.emit("text", (text, lps))
                if stop_matched:
                    finish = "stop"
                    break
                if r.finish_reason is not None:
                    finish = r.finish_reason
                    break
                if job.ended.is_set():
                    finish = "stop"
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
            job.emit("text", (tail, None))
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
        job.emit("done", {"finish_reason": finish, "usage": usage,
                          "stop_sequence": matcher.matched if stop_matched else None})


def _shutting_down() -> RequestError:
    return RequestError("the server is shutting down; retry on its next start", status=503,
                        code="shutting_down", type="server_error")


# -- the HTTP app ---------------------------------------------------------------


def _error_for(request: Request, err: RequestError):
    """Each API's own error shape: Anthropic's on /v1/messages, OpenAI's everywhere else."""
    return (anthropic_error if request.url.path.startswith("/v1/messages") else openai_error)(err)


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}
_TAGS = {"system", "developer", "user", "assistant", "tool", "text", "tool_use", "tool_result"}


def _param(loc) -> Optional[str]:
    """pydantic's error location as a field path ("messages[0].content"), without union members' names."""
    loc = [p for p in loc if p != "body"]
    parts = []
    for i, p in enumerate(loc):
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif (not isinstance(p, str) or not p.isidentifier() or p in _TYPE_NAMES or p[:1].isupper()
              or (p in _TAGS and i > 0 and isinstance(loc[i - 1], int) and i + 1 < len(loc))):
            continue  # a union member's type, or its tag (a list item's role or type), not a field
        else:
            parts.append(("." if parts else "") + p)
    return "".join(parts) or None


def _error_text(e) -> str:
    kind, ctx = e.get("type"), e.get("ctx") or {}
    if kind == "union_tag_invalid":
        return (f"unknown {str(ctx.get('discriminator', '')).strip(chr(39))} {ctx.get('tag')!r}: "
                f"use one of {ctx.get('expected_tags')}")
    if kind == "union_tag_not_found":
        return f"{ctx.get('discriminator')} is required"
    if kind == "missing":
        return "is required"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "must be a JSON object"
    return e.get("msg", "is invalid")


def validation_message(errors) -> RequestError:
    """pydantic's errors as one line naming the field (the alternatives of a union joined by "or")."""
    if not errors:
        return RequestError("invalid request body")
    invalid_json = [e for e in errors if e.get("type") == "json_invalid"]
    if invalid_json:
        ctx = invalid_json[0].get("ctx") or {}
        return RequestError(f"the request body is not valid JSON ({ctx.get('error', invalid_json[0].get('msg'))})")
    params = [_param(e.get("loc", ())) for e in errors]
    deepest = max(params, key=lambda p: len(p or ""))
    texts = []
    for p, e in zip(params, errors):
        text = _error_text(e)
        if p == deepest and text not in texts:
            texts.append(text)
    msg = " or ".join(texts[:1] + [t[0].lower() + t[1:] for t in texts[1:]])
    if deepest is None:
        return RequestError(f"the request body {msg[0].lower() + msg[1:]}")
    return RequestError(f"'{deepest}': {msg}", param=deepest)


_OPENAI_ERRORS = {s: {"model": P.OpenAIError} for s in (400, 404, 429, 500, 503)}
_ANTHROPIC_ERRORS = {s: {"model": P.AnthropicError} for s in (400, 404, 429, 500, 503)}


def _streamed(model, what: str) -> dict:
    return {200: {"model": model, "description": f"{what}; with \"stream\": true, server-sent events instead",
                  "content": {"text/event-stream": {}}}}


def create_app(worker: Worker):
    """The FastAPI app serving `worker`; stopping the app stops the worker."""
    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.stop()

    app = FastAPI(title="dflash-mlx", lifespan=lifespan,
                  description="OpenAI- and Anthropic-compatible server on DFlash speculative decoding")

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        err = RequestError(str(exc.detail), status=exc.status_code,
                           type="not_found_error" if exc.status_code == 404 else "invalid_request_error")
        return _error_for(request, err)

    @app.exception_handler(Exception)
    async def unexpected_error(request, exc):
        return _error_for(request, RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                                                type="server_error"))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        return _error_for(request, validation_message(exc.errors()))

    @app.get("/health")
    async def health():
        return worker.health()

    @app.get("/v1/models", response_model=P.ModelList)
    async def models():
        return P.ModelList(data=[P.ModelCard(id=worker.model_name)])

    async def run(request: Request, build, body, respond, stream_respond, error, prefix):
        try:
            req = build(worker, body)
            loop = asyncio.get_running_loop()
            job = Job(req, loop, asyncio.Queue())
            worker.submit(job)
        except RequestError as e:
            return error(e)
        rid = call_id(prefix)
        if req.stream:
            return StreamingResponse(stream_respond(job, rid), media_type="text/event-stream")
        return await respond(request, job, rid)

    def openai_routes(request, build, body, prefix):
        created = int(time.time())
        return run(request, build, body, lambda rq, job, rid: openai_complete(worker, rq, job, rid, created),
                   lambda job, rid: openai_stream(worker, job, rid, created), openai_error, prefix)

    @app.post("/v1/chat/completions", response_model=None, responses={**_streamed(P.ChatCompletion, "the answer"),
                                                                     **_OPENAI_ERRORS})
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        return await openai_routes(request, openai_chat_request, body, "chatcmpl-")

    @app.post("/v1/completions", response_model=None, responses={**_streamed(P.Completion, "the completion"),
                                                                **_OPENAI_ERRORS})
    async def completions(body: P.CompletionRequest, request: Request):
        return await openai_routes(request, completion_request, body, "cmpl-")

    @app.post("/v1/messages", response_model=None, responses={**_streamed(P.MessageResponse, "the message"),
                                                             **_ANTHROPIC_ERRORS})
    async def messages(body: P.MessagesRequest, request: Request):
        return await run(request, messages_request, body,
                         lambda rq, job, rid: anthropic_complete(worker, rq, job, rid),
                         lambda job, rid: anthropic_stream(worker, job, rid), anthropic_error, "msg_")

    @app.post("/v1/messages/count_tokens", response_model=P.TokenCount, responses=_ANTHROPIC_ERRORS)
    async def count_tokens(body: P.AnthropicPrompt):
        try:
            ids, _ = anthropic_prompt(worker, body, check_window=False)  # a count, also past the window
        except RequestError as e:
            return anthropic_error(e)
        return P.TokenCount(input_tokens=len(ids))

    return app


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


def _bytes(text: str) -> int:
    """A size in bytes: a whole number, optionally with K, M, G or T (powers of 1024)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    if t and t[-1] in "KMGT":
        scale, t = 1024 ** ("KMGT".index(t[-1]) + 1), t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        value = -1
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 512M, 2G or 1000000, got {text!r}")
    return int(value)


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
    p.add_argument("--prompt-cache-bytes", type=_bytes, default=DEFAULT_PROMPT_CACHE_BYTES,
                   help="most bytes the prompt-cache snapshots hold together, e.g. 512M, 2G or a number "
                   "(default: 1G); the live cache of the current conversation comes on top")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="weight dtype (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--baseline", action="store_true", help="serve the target alone, without a draft")
    return p


def load_worker(args) -> Worker:
    options = checked_options(args)
    model, tokenizer, draft, draft_name = load_model_and_draft(args.model, args.draft, args.baseline,
                                                               dtype=args.dtype)
    return Worker(model, draft, tokenizer, model_name=args.model, draft_name=draft_name,
                  options=options, queue_size=args.queue_size, max_snapshots=args.snapshots,
                  prompt_cache_bytes=args.prompt_cache_bytes)


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
