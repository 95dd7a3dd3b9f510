"""The server's requests: OpenAI and Anthropic request bodies (`dflash_mlx.serve.protocol`,
`dflash_mlx.serve.protocol_anthropic`) turned into one `GenerationRequest` (chat template, tools,
sampling options, window check), request errors in each API's shape, and stop strings matched
across streamed pieces. "Worker" annotations name `dflash_mlx.serve.worker.Worker` (not imported:
that module imports this one)."""

import json
from dataclasses import dataclass, field, replace
from typing import List, Optional

from dflash_mlx.serve import protocol as P
from dflash_mlx.serve import protocol_anthropic as PA
from dflash_mlx.options import PENALTY_FIELDS, GenerationOptions
from dflash_mlx.tool_calls import template_tools

# -- requests -------------------------------------------------------------------


class RequestError(Exception):
    """A request the server refuses; shown in the shape of the API it came to (`openai_body`, `anthropic_body`)."""

    def __init__(self, message, param=None, status=400, code=None, type="invalid_request_error",
                 retry_after: Optional[int] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type
        self.retry_after = retry_after  # seconds, sent as Retry-After (429, 503)

    def headers(self) -> dict:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}

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
    global_copies: bool = True  # copies from earlier requests, and this one kept for later ones


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


def anthropic_chat_messages(body: PA.AnthropicPrompt) -> List[dict]:
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
            if isinstance(block, PA.AnthropicText):
                text.append(block.text)
            elif isinstance(block, PA.AnthropicToolUse):
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})
            else:
                flush()
                content = _text(block.content, "tool_result")
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": ("Error: " + content) if block.is_error else content})
        flush()
    return out


def anthropic_tools(tools: Optional[List[PA.AnthropicTool]]) -> Optional[List[dict]]:
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in tools]


def sampling_options(worker: "Worker", body, max_tokens: Optional[int]) -> GenerationOptions:
    sampling = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed", "xtc_probability",
                                              "xtc_threshold") + PENALTY_FIELDS
                if getattr(body, k, None) is not None}
    if getattr(body, "logit_bias", None):  # (protocol checked the ids are digits)
        sampling["logit_bias"] = {int(token): bias for token, bias in body.logit_bias.items()}
        outside = [t for t in sampling["logit_bias"] if t >= worker.vocab_size]
        if outside:
            raise RequestError(f"'logit_bias' names token id {outside[0]}, outside the model's vocabulary of "
                               f"{worker.vocab_size} tokens", param="logit_bias")
    options = replace(worker.options, max_tokens=max_tokens or worker.options.max_tokens, **sampling)
    try:
        return options.check()
    except ValueError as e:
        raise RequestError(str(e)) from None


def global_copies(body) -> bool:
    """The request's `dflash.global_copies` (default true)."""
    return not (body.dflash is not None and body.dflash.global_copies is False)


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
                param: str = "messages", check_window: bool = True, template_kwargs: Optional[dict] = None):
    """(prompt ids, tools to look for in the answer) of a chat (`template_kwargs`: the request's own
    arguments for the chat template, over the server's)."""
    if tools and not worker.tokenizer.has_tool_calling:
        raise RequestError(
            f"the model's chat template has no tool support (mlx-lm finds no tool parser for {worker.model_name}): "
            "leave 'tools' out or serve a tool-capable model", param="tools")
    render_tools = None if tool_choice_none else tools
    ids = worker.encode_chat(messages, tools=render_tools, template_kwargs=template_kwargs)
    if check_window:
        _check_window(worker, ids, param)
    return ids, render_tools


def openai_chat_request(worker: "Worker", body: P.ChatCompletionRequest) -> GenerationRequest:
    _check_model(worker, body.model)
    _refuse(body)
    ids, tools = chat_prompt(worker, openai_chat_messages(body.messages), template_tools(
        [t.model_dump(exclude_none=True) for t in body.tools or []]), body.tool_choice == "none",
        template_kwargs=body.chat_template_kwargs)
    return GenerationRequest(
        "chat", ids, sampling_options(worker, body, body.max_completion_tokens or body.max_tokens),
        stop=body.stop_strings(), logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        stream=body.stream, include_usage=bool(body.stream_options and body.stream_options.include_usage),
        tools=tools, parallel_tool_calls=body.parallel_tool_calls is not False, global_copies=global_copies(body),
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
        global_copies=global_copies(body),
    )


def anthropic_prompt(worker: "Worker", body: PA.AnthropicPrompt, check_window: bool = True):
    _check_model(worker, body.model)
    _refuse(body)
    none = body.tool_choice is not None and body.tool_choice.type == "none"
    return chat_prompt(worker, anthropic_chat_messages(body), anthropic_tools(body.tools), none,
                       check_window=check_window)


def messages_request(worker: "Worker", body: PA.MessagesRequest) -> GenerationRequest:
    ids, tools = anthropic_prompt(worker, body)
    parallel = not (body.tool_choice and body.tool_choice.disable_parallel_tool_use)
    return GenerationRequest("chat", ids, sampling_options(worker, body, body.max_tokens),
                             stop=list(body.stop_sequences or []), stream=body.stream, tools=tools,
                             parallel_tool_calls=parallel, global_copies=global_copies(body))


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
