"""OpenAI API bodies: the requests Baton accepts and the responses it sends.

Requests refuse fields they do not know (a 400 naming the field: a feature Baton does not
serve is never silently dropped), accept a few that have no effect on the reply (`user`,
`metadata`, `store`, `service_tier`, `safety_identifier`, `prompt_cache_key`), treat an
explicit `null` as "not set", and reject values Baton does not serve (`echo`). `top_k`,
`min_p`, `repetition_penalty`, `stop_token_ids` and `ignore_eos` are extensions (as in vLLM).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationInfo,
    field_validator,
    model_validator,
)

from baton_serve.router.openai_tools import Tool, ToolCall, ToolCallDelta, ToolChoice
from baton_serve.router.structured_output import ResponseFormat

MAX_STOP_SEQUENCES = 4
MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16

FinishReason = Literal["stop", "length", "tool_calls"]


def _is_none(value: object) -> bool:
    return value is None


def _as_list(value: object) -> object:
    return [value] if isinstance(value, str) else value


def _joined_text_parts(value: object) -> object:
    """Message content given as parts: the text parts, joined with newlines."""
    if not isinstance(value, list):
        return value
    texts = []
    for part in value:
        text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
        if not isinstance(text, str):
            raise ValueError(
                'only text content parts ({"type": "text", "text": "..."}) are supported'
            )
        texts.append(text)
    return "\n".join(texts)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_list(value: object) -> list[str | list[int]]:
    """`prompt` in any of its four OpenAI forms, as a list of prompts (text or token ids)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return list(value)
        if all(_is_token_id(item) for item in value):
            return [list(value)]
        if all(isinstance(item, list) and item and all(map(_is_token_id, item)) for item in value):
            return [list(item) for item in value]
    raise ValueError(
        "prompt must be a string, a list of strings, a list of token ids, "
        "or a list of non-empty lists of token ids"
    )


MessageContent = Annotated[
    str, BeforeValidator(_joined_text_parts, json_schema_input_type=str | list[dict[str, str]])
]
StopSequences = Annotated[
    list[Annotated[str, Field(min_length=1)]],
    BeforeValidator(_as_list, json_schema_input_type=str | list[str]),
    Field(max_length=MAX_STOP_SEQUENCES),
]
Prompts = Annotated[
    list[str | list[int]],
    PlainValidator(
        _prompt_list, json_schema_input_type=str | list[str] | list[int] | list[list[int]]
    ),
]


# ---- requests ------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """The fields chat and text completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, description="extension; 0 or -1 disables it")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="extension")
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: StopSequences = []
    ignore_eos: bool = Field(default=False, description="extension")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default=[], description="extension: token ids that end the reply (not returned)"
    )
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, description="at most the replica's slots")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, le=10.0, description="extension; counts prompt and reply tokens"
    )
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] = Field(
        default={}, description="token id (as a string) → a bias added to its logit"
    )
    # Accepted and without effect on the reply: identifiers and bookkeeping for the client.
    user: str | None = Field(default=None, description="no effect: an end-user id")
    metadata: dict[str, str] | None = Field(default=None, description="no effect: tags")
    store: Literal[False] | None = Field(default=None, description="Baton stores nothing")
    service_tier: Literal["auto", "default"] | None = Field(
        default=None, description="no effect: one tier"
    )
    safety_identifier: str | None = Field(default=None, description="no effect: an end-user id")
    prompt_cache_key: str | None = Field(
        default=None, description="no effect: Baton finds cached prefixes by their tokens"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class InputMessage(BaseModel):
    """A message of the conversation. An assistant message may carry `tool_calls` and no
    content; a `tool` message answers the call named by `tool_call_id`."""

    model_config = ConfigDict(extra="forbid")

    role: str = Field(min_length=1)
    content: MessageContent | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _shape_fits_role(self) -> InputMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages may carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant's tool calls may omit it)")
        return self


class ChatCompletionRequest(_GenerationRequest):
    messages: list[InputMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] = Field(
        default={}, description="extension: more variables for the chat template"
    )
    max_tokens: int | None = Field(default=None, ge=1, description="deprecated by OpenAI")
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs is only allowed when logprobs is true")
        return value

    @property
    def logprobs_count(self) -> int | None:
        """How many alternatives to report per token (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_tokens(self) -> int | None:
        """The most tokens to generate, if the client said (None: up to the context)."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class CompletionRequest(_GenerationRequest):
    prompt: Prompts
    max_tokens: int = Field(default=16, ge=1)
    echo: Literal[False] = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def requested_tokens(self) -> int:
        return self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs


# ---- responses -----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_is_none)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)
    reasoning_content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_is_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(default=None, exclude_if=_is_none)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class TextCompletion(BaseModel):
    """A text completion, or one chunk of a streamed one (same object, as in OpenAI's API)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(default=None, exclude_if=_is_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "baton"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
