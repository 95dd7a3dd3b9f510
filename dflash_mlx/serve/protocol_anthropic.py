"""The server's wire protocol for Anthropic's Messages API: /v1/messages and
/v1/messages/count_tokens bodies as pydantic models.

Built on `protocol`'s bases, with the same rules: strict types, unknown fields
ignored, known fields this server does not honour refused by `refusals()` with a
message that names them.
"""

from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import Field

from dflash_mlx.serve.protocol import Body, DFlashOptions, Out, Refusal

# -- Anthropic requests ------------------------------------------------------------------


class Block(Body):
    cache_control: Optional[Dict[str, Any]] = None  # prompt-caching hints: the server caches prefixes anyway


class AnthropicText(Block):
    type: Literal["text"]
    text: str


class AnthropicToolUse(Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: Dict[str, Any]


class AnthropicToolResult(Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Optional[Union[str, List[AnthropicText]]] = None
    is_error: Optional[bool] = None


AnthropicBlock = Annotated[Union[AnthropicText, AnthropicToolUse, AnthropicToolResult], Field(discriminator="type")]


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: Union[str, List[AnthropicBlock]]


class AnthropicTool(Body):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: Dict[str, Any]
    type: Optional[Literal["custom"]] = None
    cache_control: Optional[Dict[str, Any]] = None


class AnthropicToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class ThinkingConfig(Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None


class AnthropicPrompt(Body):
    """What /v1/messages and /v1/messages/count_tokens share: the prompt."""

    model: str = Field(description="the served model's id (GET /v1/models)")
    messages: List[AnthropicMessage] = Field(min_length=1)
    system: Optional[Union[str, List[AnthropicText]]] = None
    tools: Optional[List[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[ThinkingConfig] = Field(
        None, description="extended thinking is not supported: disabled or left out")

    def refusals(self):
        if self.tool_choice is not None and self.tool_choice.type in ("any", "tool"):
            yield Refusal(f"tool_choice {self.tool_choice.type!r} is not supported: the server cannot force a call; "
                          "use 'auto' or 'none'", "tool_choice")
        if self.thinking is not None and self.thinking.type != "disabled":
            yield Refusal("extended thinking is not supported by this server: leave 'thinking' out", "thinking")


class MessagesRequest(AnthropicPrompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[List[str]] = None
    stream: bool = False
    temperature: Optional[float] = Field(None, ge=0, le=1, description="0: greedy (so is anything below 1e-5)")
    top_p: Optional[float] = Field(None, gt=0, le=1, description="below 1e-6: greedy")
    top_k: Optional[int] = Field(None, ge=0)
    metadata: Optional[Dict[str, Any]] = None
    service_tier: Optional[str] = None
    dflash: Optional[DFlashOptions] = None

    def refusals(self):
        yield from super().refusals()
        if any(not s for s in self.stop_sequences or ()):
            yield Refusal("'stop_sequences' must hold non-empty strings", "stop_sequences")


# -- Anthropic responses ------------------------------------------------------------------


class AnthropicErrorDetail(Out):
    type: str
    message: str


class AnthropicError(Out):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


class AnthropicUsage(Out):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: Optional[int] = None
    cache_creation_input_tokens: Optional[int] = None


class TextOut(Out):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(Out):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: Dict[str, Any]


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(Out):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: List[Union[TextOut, ToolUseOut]]
    stop_reason: Optional[StopReason] = None
    stop_sequence: Optional[str] = None
    usage: AnthropicUsage


class TokenCount(Out):
    input_tokens: int
