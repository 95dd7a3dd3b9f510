"""Tool calls: which of mlx-lm's tool parsers a tokenizer uses, and the calls in a streamed answer.

The parser is inferred as mlx-lm infers it when it loads a tokenizer (the
tokenizer config's `tool_parser_type`, else mlx-lm's own guess from the chat
template and vocabulary), so packaged, GGUF and folder models agree with
mlx-lm. The calls are found in the answer text between the parser's
`tool_call_start` and `tool_call_end` markers (mlx-lm's `TextStateMachine`) and
parsed by the parser itself; nothing here reads a call's syntax.
"""

import importlib
import json
from typing import Any, Dict, List, Optional, Tuple

from mlx_lm import tokenizer_utils
from mlx_lm.generate import TextStateMachine
from mlx_lm.tokenizer_utils import TokenizerWrapper


def tool_calling_kwargs(hf_tokenizer) -> Dict[str, Any]:
    """`TokenizerWrapper` arguments for `hf_tokenizer`'s tool parser (empty: none)."""
    config = getattr(hf_tokenizer, "init_kwargs", None) or {}
    kind = config.get("tool_parser_type") or tokenizer_utils._infer_tool_parser(hf_tokenizer)
    if kind is None:
        return {}
    module = importlib.import_module(f"mlx_lm.tool_parsers.{kind}")
    return dict(tool_parser=module.parse_tool_call, tool_call_start=module.tool_call_start,
                tool_call_end=module.tool_call_end)


def with_tool_calling(tokenizer: TokenizerWrapper) -> TokenizerWrapper:
    """`tokenizer`, or the same tokenizer wrapped again with the tool parser it lacks."""
    if tokenizer.has_tool_calling:
        return tokenizer
    kwargs = tool_calling_kwargs(tokenizer._tokenizer)
    if not kwargs:
        return tokenizer
    detokenizer = tokenizer.detokenizer
    return TokenizerWrapper(tokenizer._tokenizer, lambda _: detokenizer, eos_token_ids=tokenizer.eos_token_ids,
                            chat_template=getattr(tokenizer, "_chat_template", None), **kwargs)


class ToolCallParseError(ValueError):
    pass


def parse_calls(tokenizer: TokenizerWrapper, text: str, tools) -> List[Dict[str, Any]]:
    """The calls in one tool-call span, as [{"name", "arguments": dict}], by the tokenizer's parser."""
    try:
        parsed = tokenizer.tool_parser(text, tools)
    except Exception as e:  # each parser raises its own kind
        raise ToolCallParseError(f"{type(e).__name__}: {e}") from None
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ToolCallParseError(f"the parser returned {call!r}")
        args = call.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                raise ToolCallParseError(f"arguments are not JSON: {e}") from None
        out.append({"name": call["name"], "arguments": args if isinstance(args, dict) else {"value": args}})
    return out


class ToolCallStream:
    """Splits streamed answer text into plain text and parsed tool calls.

    `feed(text)` and `finish()` return events: ("text", str) or ("calls", [call, ...]).
    Text that may be the start of a marker is held back until it is known. A
    span the parser cannot read is given back as text (markers included), so no
    output is ever dropped; so is a span cut off by the end of the answer.
    """

    def __init__(self, tokenizer: TokenizerWrapper, tools):
        self.tokenizer, self.tools = tokenizer, tools
        self.start, self.end = tokenizer.tool_call_start, tokenizer.tool_call_end
        transitions = {"normal": [(self.start, "tool")], "tool": [(self.end, "normal")] if self.end else []}
        self.state = TextStateMachine(transitions).make_state("normal")
        self.span = ""  # text of the tool-call span being read
        self.n_calls = 0

    def feed(self, text: str) -> List[Tuple[str, Any]]:
        self.state, segments = TextStateMachine.split(self.state, text)
        events = []
        for i, (state, piece) in enumerate(segments):
            closed = i + 1 < len(segments)  # a later segment follows: this one's marker was seen
            if state == "normal":
                if piece:
                    events.append(("text", piece))
            else:
                self.span += piece
                if closed:
                    events.append(self._close(complete=True))
        return events

    def finish(self) -> List[Tuple[str, Any]]:
        self.state, rest, state = TextStateMachine.flush(self.state)
        if state != "tool":
            return [("text", rest)] if rest else []
        self.span += rest
        # a parser without an end marker (the call runs to the end of the answer) is complete here
        return [self._close(complete=not self.end)]

    def _close(self, complete: bool):
        span, self.span = self.span, ""
        raw = self.start + span + (self.end if complete else "")
        if not complete:
            return ("text", raw)
        try:
            calls = parse_calls(self.tokenizer, span, self.tools)
        except ToolCallParseError:
            return ("text", raw)
        self.n_calls += len(calls)
        return ("calls", calls)


def template_tools(tools) -> Optional[List[dict]]:
    """Tools as chat templates expect them (OpenAI's form: {"type": "function", "function": {...}})."""
    return [t if "function" in t else {"type": "function", "function": t} for t in tools] if tools else None
