"""`dflash-mlx serve`: an OpenAI- and Anthropic-compatible HTTP server on the DFlash engine.

FastAPI on uvicorn; request and response bodies are the pydantic models of
`dflash_mlx.serve.protocol`. Routes: OpenAI's POST /v1/chat/completions and
/v1/completions (tool calls, logprobs), Anthropic's POST /v1/messages and
/v1/messages/count_tokens, GET /v1/models and /health. Errors come in each API's
own shape. One target + draft are loaded at start; one worker thread runs the
engine: continuous batching (`--max-batch` requests decode together, new ones join
between cycles) or, for targets the batch engine does not take, one request at a
time; either from a bounded queue (a full queue answers 429 with Retry-After).
A follow-up turn prefills only its new tokens from cached conversations (bounded in
bytes). A client that goes away cancels its generation at the next cycle. Tool calls
are parsed by the tokenizer's mlx-lm tool parser (`dflash_mlx.tool_calls`).

Here: the app's routes and the command line. The worker (scheduling, cached
conversations, cancellation): `server_worker.py`; request bodies to
`GenerationRequest`s and stop strings: `server_requests.py`; the worker's events as
each API's answers, whole or streamed: `server_answers.py`.
"""

import argparse
import asyncio
import sys
import threading
import time
from contextlib import asynccontextmanager
from typing import Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException

from dflash_mlx.serve import protocol as P
from dflash_mlx.cli.common import ArgumentParser, checked_options, load_model_and_draft
from dflash_mlx.options import GenerationOptions, add_generation_args
from dflash_mlx.models.packaged import DEFAULT_MODEL
from dflash_mlx.serve.answers import (
    anthropic_error, call_id, openai_error, anthropic_complete, anthropic_stream, openai_complete, openai_stream,
)
from dflash_mlx.serve.requests import (
    RequestError, StopMatcher, anthropic_prompt, completion_request, messages_request, openai_chat_request,
)
from dflash_mlx.serve.worker import DEFAULT_PROMPT_CACHE_BYTES, Job, Worker, default_max_batch

__all__ = ["Job", "StopMatcher", "Worker", "build_parser", "create_app", "load_worker", "main"]

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080


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
    p.add_argument("--max-batch", type=_positive, default=None,
                   help="requests decoding at once (continuous batching; 1: one at a time; default: "
                   f"{default_max_batch()} on this machine, one per 3 GiB of memory); targets the batch "
                   "engine does not take are served one at a time")
    p.add_argument("--queue-size", type=_positive, default=16,
                   help="requests that may wait for a free row; more get 429 with Retry-After (default: 16)")
    p.add_argument("--snapshots", type=_count, default=4,
                   help="cached conversations kept for prefix reuse across requests (default: 4)")
    p.add_argument("--prompt-cache-bytes", type=_bytes, default=DEFAULT_PROMPT_CACHE_BYTES,
                   help="most bytes the cached conversations hold, e.g. 512M, 2G or a number (default: 1G); "
                   "batched, the running requests' caches count too (no new request joins past it); "
                   "one at a time, the current conversation comes on top")
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
                  prompt_cache_bytes=args.prompt_cache_bytes, max_batch=args.max_batch)


def main(argv=None) -> int:
    """`dflash-mlx serve`; `dflash_mlx.cli.main.main` turns errors into one line."""
    args = build_parser().parse_args(argv)
    worker = load_worker(args)
    print(f"dflash-mlx serve: {args.model} with draft {worker.draft_name}, block size {worker.options.block_size}, "
          f"{worker.scheduling}, on http://{args.host}:{args.port}/v1", file=sys.stderr)
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
