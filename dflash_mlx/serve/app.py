"""`dflash-mlx serve`: an OpenAI- and Anthropic-compatible HTTP server on the DFlash engine.

FastAPI on uvicorn; request and response bodies are the pydantic models of
`dflash_mlx.serve.protocol` (OpenAI) and `dflash_mlx.serve.protocol_anthropic`.
Routes: OpenAI's POST /v1/chat/completions and /v1/completions (tool calls,
logprobs), Anthropic's POST /v1/messages and /v1/messages/count_tokens, GET
/v1/models and /health. Errors come in each API's own shape. One target + draft
are loaded at start; one worker thread runs the engine: continuous batching
(`--max-batch` requests decode together, new ones join between cycles) or, for
targets the batch engine does not take, one request at a time; either from a
bounded queue (a full queue answers 429 with Retry-After). A follow-up turn
prefills only its new tokens from cached conversations (bounded in bytes). A
client that goes away cancels its generation at the next cycle. Tool calls are
parsed by the tokenizer's mlx-lm tool parser (`dflash_mlx.tool_calls`).

Here: the app's routes and how request validation errors read. The command line:
`cli.py`; the worker (scheduling): `worker.py`, its batched steps: `steps.py`, on a
target split over processes: `ranks.py`, its jobs and their answers' events:
`jobs.py`, cached conversations: `cache_pool.py`; request bodies to
`GenerationRequest`s and stop strings: `requests.py`; the worker's events as each
API's answers, whole or streamed: `answers.py`.
"""

import asyncio
import time
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException

from dflash_mlx.serve import protocol as P
from dflash_mlx.serve import protocol_anthropic as PA
from dflash_mlx.serve.answers import (
    anthropic_error, call_id, openai_error, anthropic_complete, anthropic_stream, openai_complete, openai_stream,
)
from dflash_mlx.serve.jobs import Job
from dflash_mlx.serve.requests import (
    RequestError, anthropic_prompt, completion_request, messages_request, openai_chat_request,
)
from dflash_mlx.serve.worker import Worker


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
_ANTHROPIC_ERRORS = {s: {"model": PA.AnthropicError} for s in (400, 404, 429, 500, 503)}


def _streamed(model, what: str) -> dict:
    return {200: {"model": model, "description": f"{what}; with \"stream\": true, server-sent events instead",
                  "content": {"text/event-stream": {}}}}


def create_app(worker: Worker, allowed_origins=("*",)):
    """The FastAPI app serving `worker`; stopping the app stops the worker. `allowed_origins`: the web pages
    (origins) whose scripts may call it, as mlx-lm's server's `--allowed-origins` ("*": any; empty: none)."""
    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.stop()

    app = FastAPI(title="dflash-mlx", lifespan=lifespan,
                  description="OpenAI- and Anthropic-compatible server on DFlash speculative decoding")
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

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

    @app.post("/v1/messages", response_model=None, responses={**_streamed(PA.MessageResponse, "the message"),
                                                             **_ANTHROPIC_ERRORS})
    async def messages(body: PA.MessagesRequest, request: Request):
        return await run(request, messages_request, body,
                         lambda rq, job, rid: anthropic_complete(worker, rq, job, rid),
                         lambda job, rid: anthropic_stream(worker, job, rid), anthropic_error, "msg_")

    @app.post("/v1/messages/count_tokens", response_model=PA.TokenCount, responses=_ANTHROPIC_ERRORS)
    async def count_tokens(body: PA.AnthropicPrompt):
        try:
            ids, _ = anthropic_prompt(worker, body, check_window=False)  # a count, also past the window
        except RequestError as e:
            return anthropic_error(e)
        return PA.TokenCount(input_tokens=len(ids))

    return app
