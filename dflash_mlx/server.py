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
from typing import Any, Dict, List, Optional

import mlx.core as mx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
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
from dflash_mlx.tool_calls import ToolCallStream, template_tools, with_tool_calling

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
SCHEDULING = "one request at a time, first come first served, from a bounded queue"
DEFAULT_PROMPT_CACHE_BYTES = 1 << 30  # snapshots kept for prefix reuse: 1 GiB


# -- requests -------------------------------------------------------------------


class RequestError(Exception):
    """A request the server refuses; shown in the shape of the API it came to (`openai_body`, `anthropic_body`)."""

    def __init__(self, message, param=None, status=400, code=None, type="invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type

    def body(self) -> dict:
        return self.openai_body()

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        kind = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


@dataclass
class GenerationRequest:
    """What the worker runs: API-neutral."""

    kind: str  # "chat" | "completion" (a completion keeps the first token's leading space)
    prompt_ids: List[int]
    options: GenerationOptions  # the engine's arguments: the server's block size, the request's sampling
    stop: List[str] = field(default_factory=list)
    logprobs: Optional[int] = None  # None: off; k: each token's log-probability and k alternatives
    stream: bool = False
    include_usage: bool = False
    tools: Optional[List[dict]] = None  # in the chat template's form; None: no tool calls are looked for
    parallel_tool_calls: bool = True


def _refuse(body):
    for refusal in body.refusals():
        raise RequestError(refusal.message, param=refusal.param)


def _text(content, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def _arguments(text: str, param: str):
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise RequestError(f"{param} is not JSON ({e.msg} at column {e.colno}): send the arguments the "
                           "server returned", param=param) from None


def openai_chat_messages(messages: List[P.ChatMessage]) -> List[dict]:
    """OpenAI messages as chat templates read them (arguments as objects, as mlx-lm passes them)."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if isinstance(m, P.SystemMessage):
            out.append({"role": "system", "content": _text(m.content, where)})
        elif isinstance(m, P.UserMessage):
            out.append({"role": "user", "content": _text(m.content, where)})
        elif isinstance(m, P.ToolMessage):
            out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": _text(m.content, where)})
        else:
            msg = {"role": "assistant", "content": _text(m.content, where)}
            if m.tool_calls:
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {
                        "name": c.function.name,
                        "arguments": _arguments(c.function.arguments, f"{where}.tool_calls[{j}].function.arguments"),
                    }} for j, c in enumerate(m.tool_calls)
                ]
            out.append(msg)
    return out


def anthropic_chat_messages(body: P.AnthropicPrompt) -> List[dict]:
    """Anthropic messages as chat templates read them: tool_result blocks become "tool" messages,
    tool_use blocks the assistant's tool_calls."""
    out = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system, "system")})
    for m in body.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls = [], []

        def flush():
            if text or (m.role == "assistant" and calls):
                msg = {"role": m.role, "content": "".join(text)}
                if calls:
                    msg["tool_calls"] = list(calls)
                out.append(msg)
            text.clear()
            calls.clear()

        for block in m.content:
            if isinstance(block, P.AnthropicText):
                text.append(block.text)
            elif isinstance(block, P.AnthropicToolUse):
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})
            else:
                flush()
                content = _text(block.content, "tool_result")
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": ("Error: " + content) if block.is_error else content})
        flush()
    return out


def anthropic_tools(tools: Optional[List[P.AnthropicTool]]) -> Optional[List[dict]]:
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in tools]


def sampling_options(worker: "Worker", body, max_tokens: Optional[int]) -> GenerationOptions:
    sampling = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed")
                if getattr(body, k, None) is not None}
    options = replace(worker.options, max_tokens=max_tokens or worker.options.max_tokens, **sampling)
    try:
        return options.check()
    except ValueError as e:
        raise RequestError(str(e)) from None


def _check_model(worker: "Worker", model: Optional[str]):
    if model is not None and model not in worker.model_ids:
        raise RequestError(f"model '{model}' is not served here: use '{worker.model_name}' (GET /v1/models)",
                           param="model", status=404, code="model_not_found", type="not_found_error")


def _check_window(worker: "Worker", prompt_ids: List[int], param: str):
    if not prompt_ids:
        raise RequestError("the prompt encodes to no tokens", param=param)
    window = worker.context_window
    if window and len(prompt_ids) >= window:
        raise RequestError(
            f"the prompt is {len(prompt_ids)} tokens, past the model's context window of {window} tokens: "
            "shorten it", param=param, code="context_length_exceeded",
        )


def chat_prompt(worker: "Worker", messages: List[dict], tools: Optional[List[dict]], tool_choice_none: bool,
                param: str = "messages", check_window: bool = True):
    """(prompt ids, tools to look for in the answer) of a chat."""
    if tools and not worker.tokenizer.has_tool_calling:
        raise RequestError(
            f"the model's chat template has no tool support (mlx-lm finds no tool parser for {worker.model_name}): "
            "leave 'tools' out or serve a tool-capable model", param="tools")
    render_tools = None if tool_choice_none else tools
    ids = worker.encode_chat(messages, tools=render_tools)
    if check_window:
        _check_window(worker, ids, param)
    return ids, render_tools


def openai_chat_request(worker: "Worker", body: P.ChatCompletionRequest) -> GenerationRequest:
    _check_model(worker, body.model)
    _refuse(body)
    ids, tools = chat_prompt(worker, openai_chat_messages(body.messages), template_tools(
        [t.model_dump(exclude_none=True) for t in body.tools or []]), body.tool_choice == "none")
    return GenerationRequest(
        "chat", ids, sampling_options(worker, body, body.max_completion_tokens or body.max_tokens),
        stop=body.stop_strings(), logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        stream=body.stream, include_usage=bool(body.stream_options and body.stream_options.include_usage),
        tools=tools, parallel_tool_calls=body.parallel_tool_calls is not False,
    )


def completion_request(worker: "Worker", body: P.CompletionRequest) -> GenerationRequest:
    _check_model(worker, body.model)
    _refuse(body)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        vocab = worker.vocab_size
        if not prompt or not all(0 <= t < vocab for t in prompt):
            raise RequestError(f"'prompt' as a list must be one string or token ids in [0, {vocab})", param="prompt")
        ids = list(prompt)
    else:
        if not prompt:
            raise RequestError("'prompt' is empty: give some text", param="prompt")
        ids = worker.encode_text(prompt)
    _check_window(worker, ids, "prompt")
    return GenerationRequest(
        "completion", ids, sampling_options(worker, body, body.max_tokens), stop=body.stop_strings(),
        logprobs=body.logprobs, stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )


def anthropic_prompt(worker: "Worker", body: P.AnthropicPrompt, check_window: bool = True):
    _check_model(worker, body.model)
    _refuse(body)
    none = body.tool_choice is not None and body.tool_choice.type == "none"
    return chat_prompt(worker, anthropic_chat_messages(body), anthropic_tools(body.tools), none,
                       check_window=check_window)


def messages_request(worker: "Worker", body: P.MessagesRequest) -> GenerationRequest:
    ids, tools = anthropic_prompt(worker, body)
    parallel = not (body.tool_choice and body.tool_choice.disable_parallel_tool_use)
    return GenerationRequest("chat", ids, sampling_options(worker, body, body.max_tokens),
                             stop=list(body.stop_sequences or []), stream=body.stream, tools=tools,
                             parallel_tool_calls=parallel)


# -- stop strings ---------------------------------------------------------------


class StopMatcher:
    """Cuts streamed text at the first stop string, also one spread over several tokens.

    Text that could still be the start of a stop string is held back until the
    next piece shows whether it is.
    """

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.matched: Optional[str] = None  # the stop string found

    def feed(self, text: str):
        """(text safe to send now, whether a stop string matched)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            self.matched = min((s for s in self.stops if s in buf), key=buf.find)
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


# -- answers: the worker's events as text, tool calls and an end ---------------------


@dataclass
class Piece:
    kind: str  # "text" | "calls" | "done" | "error" | "cancelled"
    value: Any = None
    logprobs: Optional[list] = None  # TokenLogprobs of the tokens up to this piece


async def answer_pieces(worker: "Worker", job: Job):
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


def _call_id(prefix: str) -> str:
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
        c = {"id": _call_id("call_"), "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
        if streaming_from is not None:
            c["index"] = streaming_from + i
        out.append(c)
    return out


async def openai_complete(worker: "Worker", request: Request, job: Job, rid, created):
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
                return _openai_error(piece.value)
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


async def openai_stream(worker: "Worker", job: Job, rid, created):
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
    return [{"type": "tool_use", "id": _call_id("toolu_"), "name": c["name"], "input": c["arguments"]} for c in calls]


async def anthropic_complete(worker: "Worker", request: Request, job: Job, rid):
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
                return _anthropic_error(piece.value)
            elif piece.kind == "cancelled":
                return JSONResponse({}, status_code=499)
            elif piece.kind == "done":
                done = piece.value
    finally:
        watcher.cancel()
    body = P.MessageResponse(id=rid, model=worker.model_name, content=blocks, stop_reason=_stop_reason(done),
                             stop_sequence=done["stop_sequence"], usage=_anthropic_usage(done["usage"]))
    return JSONResponse(body.model_dump())


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def anthropic_stream(worker: "Worker", job: Job, rid):
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


async def _watch_disconnect(request, job: Job):
    """Cancel `job` when the client goes away (the body is read: the next message says so)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


# -- the HTTP app ---------------------------------------------------------------


def _openai_error(err: RequestError):
    return JSONResponse(err.openai_body(), status_code=err.status)


def _anthropic_error(err: RequestError):
    return JSONResponse(err.anthropic_body(), status_code=err.status)


def _error_for(request: Request, err: RequestError):
    """Each API's own error shape: Anthropic's on /v1/messages, OpenAI's everywhere else."""
    return (_anthropic_error if request.url.path.startswith("/v1/messages") else _openai_error)(err)


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
        rid = _call_id(prefix)
        if req.stream:
            return StreamingResponse(stream_respond(job, rid), media_type="text/event-stream")
        return await respond(request, job, rid)

    def openai_routes(request, build, body, prefix):
        created = int(time.time())
        return run(request, build, body, lambda rq, job, rid: openai_complete(worker, rq, job, rid, created),
                   lambda job, rid: openai_stream(worker, job, rid, created), _openai_error, prefix)

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
                         lambda job, rid: anthropic_stream(worker, job, rid), _anthropic_error, "msg_")

    @app.post("/v1/messages/count_tokens", response_model=P.TokenCount, responses=_ANTHROPIC_ERRORS)
    async def count_tokens(body: P.AnthropicPrompt):
        try:
            ids, _ = anthropic_prompt(worker, body, check_window=False)  # a count, also past the window
        except RequestError as e:
            return _anthropic_error(e)
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
