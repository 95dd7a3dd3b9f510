"""The server's wire protocol: request and response bodies as pydantic models.

OpenAI's chat/completions, completions and models here, with the bases both APIs
share (`Body`, `Out`, `Refusal`); Anthropic's messages in `protocol_anthropic`.
FastAPI validates requests with these models (strict types: a string is not a
number, `true` is not 1) and builds `/openapi.json` from them. Unknown fields are
ignored; known fields that would change the output but are not honoured here
are refused by `refusals()` with a message that names them, never silently
dropped.
"""

from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

# -- shared -----------------------------------------------------------------------


class Body(BaseModel):
    """A request body or part of one: strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class Out(BaseModel):
    """A response body or part of one."""

    model_config = ConfigDict(extra="allow")


class Refusal(Exception):
    """A field set to something this server does not do: (message, param)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


# -- OpenAI requests -----------------------------------------------------------------


class TextPart(Body):
    type: Literal["text"]
    text: str


Content = Union[str, List[TextPart]]


class FunctionCall(Body):
    name: str
    arguments: str = Field(description="the arguments as a JSON object in a string, as OpenAI sends them")


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(Body):
    role: Literal["system", "developer"]
    content: Content
    name: Optional[str] = None


class UserMessage(Body):
    role: Literal["user"]
    content: Content
    name: Optional[str] = None


class AssistantMessage(Body):
    role: Literal["assistant"]
    content: Optional[Content] = None
    tool_calls: Optional[List[ToolCall]] = None
    name: Optional[str] = None


class ToolMessage(Body):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


ChatMessage = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage], Field(discriminator="role")]


class FunctionDef(Body):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Body):
    include_usage: Optional[bool] = None


class ResponseFormat(Body):
    type: str


class DFlashOptions(Body):
    """This server's own request field, `dflash` (OpenAI's client: `extra_body={"dflash": {...}}`)."""

    global_copies: Optional[bool] = Field(
        None, description="false: this request neither copies from earlier requests' prompts and answers nor "
        "adds its own to them (privacy between users of one server); default true")


class Sampling(Body):
    """Fields chat and completions requests share."""

    model: Optional[str] = Field(None, description="the served model's id (GET /v1/models); may be left out")
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2, description="0: greedy (so is anything below 1e-5, "
                                         "its limit)")
    top_p: Optional[float] = Field(None, gt=0, le=1, description="below 1e-6: greedy (its limit)")
    top_k: Optional[int] = Field(None, ge=0, description="mlx-lm's extension; 0: off")
    min_p: Optional[float] = Field(None, ge=0, le=1, description="mlx-lm's extension; 0: off")
    xtc_probability: Optional[float] = Field(None, ge=0, le=1, description="mlx-lm's extension (XTC): the share "
                                             "of steps that drop every token above xtc_threshold but the least "
                                             "likely of them (not a newline or an end token); 0: off")
    xtc_threshold: Optional[float] = Field(None, ge=0, le=0.5, description="mlx-lm's extension (default 0.1)")
    seed: Optional[int] = Field(None, ge=0, lt=2**64)
    stop: Optional[Union[str, List[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(None, description="must be 1 (one choice per request)")
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2, description="subtracted from a token's logit "
                                               "for each time it occurs in the last frequency_context_size tokens")
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2, description="subtracted from a token's logit "
                                              "where it occurs in the last presence_context_size tokens")
    logit_bias: Optional[Dict[str, float]] = Field(None, description="token id (a string of digits) -> a bias "
                                                   "in [-100, 100] added to its logit at every step")
    repetition_penalty: Optional[float] = Field(None, ge=0, description="mlx-lm's extension: a token's logit in "
                                                "the last repetition_context_size tokens divided by it (> 1: rarer)")
    repetition_context_size: Optional[int] = Field(None, ge=1, description="mlx-lm's extension (default 20)")
    presence_context_size: Optional[int] = Field(None, ge=1, description="mlx-lm's extension (default 20)")
    frequency_context_size: Optional[int] = Field(None, ge=1, description="mlx-lm's extension (default 20)")
    user: Optional[str] = None  # changes nothing here
    metadata: Optional[Dict[str, Any]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    dflash: Optional[DFlashOptions] = None

    def stop_strings(self) -> List[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def common_refusals(self):
        if self.n not in (None, 1):
            yield Refusal(f"'n' must be 1 (one choice per request), got {self.n}", "n")
        for token, bias in (self.logit_bias or {}).items():
            if not token.isdigit() or not -100 <= bias <= 100:
                yield Refusal(f"'logit_bias' maps token ids (strings of digits) to biases in [-100, 100], got "
                              f"{token!r}: {bias!r}", "logit_bias")
                break
        if any(not s for s in self.stop_strings()):
            yield Refusal("'stop' must be a non-empty string or a list of non-empty strings", "stop")


class ChatCompletionRequest(Sampling):
    messages: List[ChatMessage] = Field(min_length=1, description="at least one message")
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = Field(
        None, description="'auto' (the default with tools) or 'none'; 'required' and a named function are refused: "
        "the server does not constrain generation")
    parallel_tool_calls: Optional[bool] = Field(None, description="false: generation ends after the first call")
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    response_format: Optional[ResponseFormat] = Field(None, description="only {'type': 'text'}")
    functions: Optional[List[Dict[str, Any]]] = Field(None, description="deprecated by OpenAI: use 'tools'")
    function_call: Optional[Union[str, Dict[str, Any]]] = Field(
        None, description="deprecated by OpenAI: use 'tool_choice'")
    modalities: Optional[List[str]] = Field(None, description="only ['text']")
    audio: Optional[Dict[str, Any]] = Field(None, description="not supported")
    chat_template_kwargs: Optional[Dict[str, Any]] = Field(
        None, description="mlx-lm's and vLLM's extension: arguments for the model's chat template, e.g. "
        "{'enable_thinking': false} (over the server's --chat-template-args)")

    def refusals(self):
        yield from self.common_refusals()
        if self.functions or self.function_call is not None:
            name = "functions" if self.functions else "function_call"
            yield Refusal(f"'{name}' is OpenAI's deprecated form: send 'tools' (and 'tool_choice') instead", name)
        if self.response_format is not None and self.response_format.type != "text":
            yield Refusal(f"'response_format' {self.response_format.type!r} is not supported: the server does not "
                          "constrain output to JSON; leave it out (or use {'type': 'text'})", "response_format")
        if self.modalities is not None and list(self.modalities) != ["text"]:
            yield Refusal("'modalities' must be ['text']: this server generates text only", "modalities")
        if self.audio is not None:
            yield Refusal("'audio' is not supported: this server generates text only", "audio")
        if self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice):
            yield Refusal("'tool_choice' 'required' or a named function is not supported: the server cannot force "
                          "a call; use 'auto' (the default) or 'none'", "tool_choice")
        for i, tool in enumerate(self.tools or []):
            if tool.function.strict:
                yield Refusal(f"tools[{i}].function.strict is true, but the server does not constrain arguments to "
                              "the schema: set it to false or leave it out", f"tools[{i}].function.strict")
        if self.top_logprobs and not self.logprobs:
            yield Refusal("'top_logprobs' needs 'logprobs': true", "top_logprobs")


class CompletionRequest(Sampling):
    prompt: Union[str, List[str], List[int]] = Field(description="a string, or a list of token ids")
    logprobs: Optional[int] = Field(None, ge=0, le=20, description="log-probabilities of the chosen token and this "
                                    "many top alternatives per position")
    echo: Optional[bool] = Field(None, description="not supported: false or left out")
    best_of: Optional[int] = Field(None, description="must be 1")
    suffix: Optional[str] = Field(None, description="not supported: empty or left out")

    def refusals(self):
        yield from self.common_refusals()
        if self.echo:
            yield Refusal("'echo' is not supported by this server: leave it out", "echo")
        if self.best_of not in (None, 1):
            yield Refusal(f"'best_of' must be 1, got {self.best_of}", "best_of")
        if self.suffix:
            yield Refusal("'suffix' (insertion) is not supported by this server: leave it out", "suffix")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            yield Refusal("'prompt' as a list of strings must hold exactly one (one choice per request)", "prompt")


# -- OpenAI responses ------------------------------------------------------------------


class OpenAIErrorDetail(Out):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class OpenAIError(Out):
    error: OpenAIErrorDetail


class TopLogprob(Out):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: List[TopLogprob] = []


class ChoiceLogprobs(Out):
    content: Optional[List[TokenLogprob]] = None


class CompletionLogprobs(Out):
    tokens: List[str]
    token_logprobs: List[float]
    top_logprobs: Optional[List[Dict[str, float]]] = None
    text_offset: List[int]


class PromptTokensDetails(Out):
    cached_tokens: int


class Usage(Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None
    dflash: Optional[Dict[str, Any]] = Field(None, description="speculative decoding statistics")


class ResponseFunctionCall(Out):
    name: str
    arguments: str


class ResponseToolCall(Out):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ResponseMessage(Out):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[List[ResponseToolCall]] = None


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(Out):
    index: int = 0
    message: ResponseMessage
    finish_reason: Optional[FinishReason] = None
    logprobs: Optional[ChoiceLogprobs] = None


class ChatCompletion(Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: List[ChatChoice]
    usage: Usage


class DeltaFunctionCall(Out):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(Out):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall


class Delta(Out):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[List[DeltaToolCall]] = None


class ChunkChoice(Out):
    index: int = 0
    delta: Delta
    finish_reason: Optional[FinishReason] = None
    logprobs: Optional[ChoiceLogprobs] = None


class ChatCompletionChunk(Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: List[ChunkChoice]
    usage: Optional[Usage] = None


class CompletionChoice(Out):
    index: int = 0
    text: str
    finish_reason: Optional[Literal["stop", "length"]] = None
    logprobs: Optional[CompletionLogprobs] = None


class Completion(Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Optional[Usage] = None


class ModelCard(Out):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "dflash-mlx"


class ModelList(Out):
    object: Literal["list"] = "list"
    data: List[ModelCard]
