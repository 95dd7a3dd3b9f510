"""The server's answers: the worker's events as text, tool calls, logprobs and an end, in
OpenAI's and Anthropic's shapes, whole or streamed (server-sent events), and errors in each API's
own shape. "Worker" and "Job" annotations name `dflash_mlx.serve.worker.Worker` and
`dflash_mlx.serve.jobs.Job`."""

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any, List, Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from dflash_mlx.serve import protocol as P
from dflash_mlx.serve import protocol_anthropic as PA
from dflash_mlx.serve.requests import RequestError
from dflash_mlx.tool_calls import ToolCallStream

# -- answers: the worker's events as text, tool calls and an end ---------------------


@dataclass
class Piece:
    kind: str  # "text" | "calls" | "done" | "error" | "cancelled"
    value: Any = None
    logprobs: Optional[list] = None  # TokenLogprobs of the tokens up to this piece


async def answer_pieces(worker: "Worker", job: "Job"):
    """The job's answer as `Piece`s: text and parsed tool calls in order, then one end piece."""
    req = job.request
    splitter = ToolCallStream(worker.tokenizer, req.tools) if req.tools else None
    pending: list = []
    calls_seen = False

    def pieces(events):
        nonlocal pending, calls_seen
        for kind, value in events:
            if calls_seen and not req.parallel_tool_calls:
                continue  # one call was asked for: what follows it is not part of the answer
            if kind == "calls":
                calls_seen = True
                if not req.parallel_tool_calls:
                    value = value[:1]
                    job.end()
            yield Piece(kind, value, pending)
            pending = []

    while True:
        event, payload = await job.events.get()
        if event == "text":
            text, lps = payload
            pending = pending + list(lps or [])
            for piece in pieces(splitter.feed(text) if splitter else [("text", text)] if text else []):
                yield piece
        elif event == "error":
            yield Piece("error", payload)
            return
        elif payload is None:
            yield Piece("cancelled")
            return
        else:
            for piece in pieces(splitter.finish() if splitter else []):
                yield piece
            if pending:
                yield Piece("text", "", pending)
            if calls_seen and payload["finish_reason"] == "stop" and payload["stop_sequence"] is None:
                payload = dict(payload, finish_reason="tool_calls")
            yield Piece("done", payload)
            return


def call_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _token_text(worker: "Worker", token: int) -> str:
    return worker.tokenizer.decode([token])


def chat_logprobs(worker: "Worker", lps) -> List[dict]:
    def entry(token, logprob):
        text = _token_text(worker, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [dict(entry(t.token, t.logprob), top_logprobs=[entry(i, v) for i, v in t.top]) for t in lps]


def completion_logprobs(worker: "Worker", lps, offset: int = 0) -> dict:
    tokens = [_token_text(worker, t.token) for t in lps]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [t.logprob for t in lps],
            "top_logprobs": [{_token_text(worker, i): v for i, v in t.top} for t in lps], "text_offset": offsets}


def openai_tool_calls(calls, streaming_from: Optional[int] = None) -> List[dict]:
    out = []
    for i, call in enumerate(calls):
        c = {"id": call_id("call_"), "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
        if streaming_from is not None:
            c["index"] = streaming_from + i
        out.append(c)
    return out


async def openai_complete(worker: "Worker", request: Request, job: "Job", rid, created):
    req = job.request
    text, calls, lps, done = [], [], [], None
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    try:
        async for piece in answer_pieces(worker, job):
            lps.extend(piece.logprobs or [])
            if piece.kind == "text":
                text.append(piece.value)
            elif piece.kind == "calls":
                calls.extend(openai_tool_calls(piece.value))
            elif piece.kind == "error":
                return openai_error(piece.value)
            elif piece.kind == "cancelled":
                return JSONResponse({}, status_code=499)  # nobody is listening
            else:
                done = piece.value
    finally:
        watcher.cancel()
    usage = done["usage"]
    if req.kind == "chat":
        message = {"role": "assistant", "content": "".join(text) if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        logprobs = {"content": chat_logprobs(worker, lps)} if req.logprobs is not None else None
        body = P.ChatCompletion(id=rid, created=created, model=worker.model_name, usage=usage, choices=[
            P.ChatChoice(message=message, finish_reason=done["finish_reason"], logprobs=logprobs)])
    else:
        logprobs = completion_logprobs(worker, lps) if req.logprobs is not None else None
        body = P.Completion(id=rid, created=created, model=worker.model_name, usage=usage, choices=[
            P.CompletionChoice(text="".join(text), finish_reason=done["finish_reason"], logprobs=logprobs)])
    return JSONResponse(body.model_dump(exclude_none=False))


def _sse_line(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def openai_stream(worker: "Worker", job: "Job", rid, created):
    """Server-sent events in OpenAI's chunk format; cancelled if the client goes away."""
    req = job.request
    chat = req.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": rid, "object": obj, "created": created, "model": worker.model_name}
    n_calls, offset = 0, 0

    def chunk(delta=None, text="", finish=None, lps=None):
        nonlocal offset
        if chat:
            logprobs = {"content": chat_logprobs(worker, lps)} if lps and req.logprobs is not None else None
            choice = {"index": 0, "delta": delta or {}, "finish_reason": finish, "logprobs": logprobs}
        else:
            logprobs = completion_logprobs(worker, lps, offset) if lps and req.logprobs is not None else None
            offset += len(text)
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return _sse_line(dict(head, choices=[choice]))

    try:
        if chat:
            yield chunk({"role": "assistant", "content": ""})
        async for piece in answer_pieces(worker, job):
            if piece.kind == "text":
                yield chunk({"content": piece.value}, piece.value, lps=piece.logprobs)
            elif piece.kind == "calls":
                calls = openai_tool_calls(piece.value, streaming_from=n_calls)
                n_calls += len(calls)
                yield chunk({"tool_calls": calls}, lps=piece.logprobs)
            elif piece.kind == "error":
                yield _sse_line(piece.value.openai_body())
                break
            elif piece.kind == "cancelled":
                break
            else:
                yield chunk(finish=piece.value["finish_reason"])
                if req.include_usage:
                    yield _sse_line(dict(head, choices=[], usage=piece.value["usage"]))
        yield "data: [DONE]\n\n"
    finally:
        # Starlette cancels this generator when the client disconnects
        job.cancel()


def _stop_reason(done) -> str:
    return {"tool_calls": "tool_use", "length": "max_tokens"}.get(
        done["finish_reason"], "stop_sequence" if done["stop_sequence"] is not None else "end_turn")


def _anthropic_usage(usage) -> dict:
    """Anthropic's split: input_tokens are the prompt tokens not read from the prompt cache."""
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def anthropic_tool_uses(calls) -> List[dict]:
    return [{"type": "tool_use", "id": call_id("toolu_"), "name": c["name"], "input": c["arguments"]} for c in calls]


async def anthropic_complete(worker: "Worker", request: Request, job: "Job", rid):
    blocks, done = [], None
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    try:
        async for piece in answer_pieces(worker, job):
            if piece.kind == "text" and piece.value:
                if blocks and blocks[-1]["type"] == "text":
                    blocks[-1]["text"] += piece.value
                else:
                    blocks.append({"type": "text", "text": piece.value})
            elif piece.kind == "calls":
                blocks.extend(anthropic_tool_uses(piece.value))
            elif piece.kind == "error":
                return anthropic_error(piece.value)
            elif piece.kind == "cancelled":
                return JSONResponse({}, status_code=499)
            elif piece.kind == "done":
                done = piece.value
    finally:
        watcher.cancel()
    body = PA.MessageResponse(id=rid, model=worker.model_name, content=blocks, stop_reason=_stop_reason(done),
                             stop_sequence=done["stop_sequence"], usage=_anthropic_usage(done["usage"]))
    return JSONResponse(body.model_dump())


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def anthropic_stream(worker: "Worker", job: "Job", rid):
    """Anthropic's event sequence: message_start, content blocks (start, deltas, stop),
    message_delta (stop reason, usage), message_stop."""
    n_prompt = len(job.request.prompt_ids)
    index, open_text = -1, False
    try:
        yield _event("message_start", {"type": "message_start", "message": {
            "id": rid, "type": "message", "role": "assistant", "model": worker.model_name, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
        async for piece in answer_pieces(worker, job):
            if piece.kind in ("calls", "done") and open_text:
                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                open_text = False
            if piece.kind == "text" and piece.value:
                if not open_text:
                    index += 1
                    open_text = True
                    yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                         "content_block": {"type": "text", "text": ""}})
                yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                     "delta": {"type": "text_delta", "text": piece.value}})
            elif piece.kind == "calls":
                for use in anthropic_tool_uses(piece.value):
                    index += 1
                    yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                         "content_block": dict(use, input={})})
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(use["input"], ensure_ascii=False)}})
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
            elif piece.kind == "error":
                yield _event("error", piece.value.anthropic_body())
                break
            elif piece.kind == "cancelled":
                break
            elif piece.kind == "done":
                done = piece.value
                yield _event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": _stop_reason(done), "stop_sequence": done["stop_sequence"]},
                    "usage": _anthropic_usage(done["usage"])})
                yield _event("message_stop", {"type": "message_stop"})
    finally:
        job.cancel()


async def _watch_disconnect(request, job: "Job"):
    """Cancel `job` when the client goes away (the body is read: the next message says so)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


def openai_error(err: RequestError):
    return JSONResponse(err.openai_body(), status_code=err.status, headers=err.headers())


def anthropic_error(err: RequestError):
    return JSONResponse(err.anthropic_body(), status_code=err.status, headers=err.headers())
