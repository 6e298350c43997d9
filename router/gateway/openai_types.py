"""OpenAI API bodies: the requests Baton accepts and the responses it sends.

Requests take OpenAI's fields and the widely used extensions of vLLM (and a few of
llama-server's); every field says in its description what it does, and fields described
"No effect" are the client's bookkeeping. Fields they do not know are refused (a 400 naming
the field, with the reason `refused_fields` gives: a feature Baton does not serve is never
silently dropped); an explicit `null` means "not set". docs/api-fields.md is the table of
all of them (`python -m baton_serve.router.gateway.api_fields`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from baton_serve.router.gateway import refused_fields
from baton_serve.router.gateway.list_bounds import counted
from baton_serve.router.gateway.openai_inputs import (
    InputMessage,
    Prompts,
    StopSequences,
    StreamOptions,
    nulls_dropped,
)
from baton_serve.router.gateway.openai_tools import Tool, ToolCall, ToolCallDelta, ToolChoice
from baton_serve.router.gateway.structured_output import ResponseFormat

MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16
# Fields that each give the reply a grammar: at most one per request.
GUIDES = ("guided_json", "guided_choice", "json_schema", "grammar")

FinishReason = Literal["stop", "length", "tool_calls"]


def _is_none(value: object) -> bool:
    return value is None


# ---- requests ------------------------------------------------------------------------------

NO_EFFECT = "No effect"  # how a field accepted only as the client's bookkeeping is described
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class _GenerationRequest(BaseModel):
    """The fields chat and text completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The served model's name (GET /v1/models).")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0: greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling.")
    top_k: int = Field(default=0, ge=-1, description="vLLM: 0 or -1 disables it.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="vLLM: min-p sampling.")
    typical_p: float = Field(
        default=1.0, gt=0.0, le=1.0, description="llama-server: locally typical sampling."
    )
    top_n_sigma: float = Field(
        default=-1.0,
        allow_inf_nan=False,
        description="llama-server: logits within n sigmas of the top (≤ 0: off).",
    )
    xtc_probability: float = Field(
        default=0.0, ge=0.0, le=1.0, description="llama-server: XTC's chance per step."
    )
    xtc_threshold: float = Field(
        default=0.1, ge=0.0, le=1.0, description="llama-server: XTC's cut (> 0.5: off)."
    )
    mirostat: Literal[0, 1, 2] = Field(
        default=0, description="llama-server: mirostat 1 or 2 instead of top-k/p, min-p, XTC."
    )
    mirostat_tau: float = Field(
        default=5.0, ge=0.0, allow_inf_nan=False, description="llama-server: its target."
    )
    mirostat_eta: float = Field(
        default=0.1, ge=0.0, allow_inf_nan=False, description="llama-server: its rate."
    )
    seed: int | None = Field(
        default=None, ge=0, le=MAX_SEED, description="Reproducible sampling (choice i: seed + i)."
    )
    stop: StopSequences = Field(default=[], description="Up to 4 strings that end the reply.")
    include_stop_str_in_output: bool = Field(
        default=False, description="vLLM: the reply keeps the stop string that ended it."
    )
    ignore_eos: bool = Field(
        default=False, description="vLLM: generate past end-of-generation tokens."
    )
    min_tokens: int = Field(
        default=0,
        ge=0,
        description="vLLM: no end-of-generation token, stop token id or stop string "
        "before this many tokens.",
    )
    stop_token_ids: Annotated[
        list[Annotated[int, Field(ge=0)]], counted("stop_token_ids", as_sent=True)
    ] = Field(default=[], description="vLLM: token ids that end the reply (not returned).")
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, description="Choices; at most the slots.")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="Reply tokens.")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="Reply tokens.")
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, le=10.0, description="vLLM: counts prompt and reply tokens."
    )
    logit_bias: Annotated[
        dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
        counted("logit_bias", as_sent=True),
    ] = Field(default={}, description="Token id (as a string) → a bias added to its logit.")
    guided_json: dict[str, Any] | None = Field(
        default=None, description="vLLM: the reply is JSON valid against this schema."
    )
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, min_length=1, description="vLLM: the reply is exactly one of these."
    )
    json_schema: dict[str, Any] | None = Field(
        default=None, description="llama-server: the same as guided_json."
    )
    grammar: str | None = Field(  # its size and nesting: the gateway's grammar_limits
        default=None,
        min_length=1,
        description="llama-server: a llama.cpp GBNF grammar (rule `root`) the reply follows.",
    )
    skip_special_tokens: bool = Field(
        default=False,
        description="vLLM (default true there): control tokens are left out of the text. "
        "Baton shows them by default, so the reply parser sees reasoning and tool markers.",
    )
    spaces_between_special_tokens: bool = Field(
        default=True,
        description=f"{NO_EFFECT}: llama.cpp's detokenizer never adds spaces between them.",
    )
    priority: Literal[0] = Field(
        default=0, description="vLLM: only 0, as vLLM without priority scheduling."
    )
    # Accepted and without effect on the reply: identifiers and bookkeeping for the client.
    request_id: str | None = Field(
        default=None, max_length=256, description="vLLM: the reply's id is made from it."
    )
    user: str | None = Field(default=None, description=f"{NO_EFFECT}: an end-user id.")
    metadata: dict[str, str] | None = Field(default=None, description=f"{NO_EFFECT}: tags.")
    store: Literal[False] | None = Field(
        default=None, description="Only false: Baton stores nothing."
    )
    service_tier: Literal["auto", "default"] | None = Field(
        default=None, description=f"{NO_EFFECT}: one tier."
    )
    safety_identifier: str | None = Field(default=None, description=f"{NO_EFFECT}: a user id.")
    prompt_cache_key: str | None = Field(
        default=None, description=f"{NO_EFFECT}: cached prefixes are found by their tokens."
    )
    prompt_cache_retention: Literal["in-memory", "24h"] | None = Field(
        default=None, description=f"{NO_EFFECT}: the replicas' caches decide."
    )
    cache_prompt: bool | None = Field(
        default=None, description=f"{NO_EFFECT} (llama-server): prefixes are always reused."
    )
    session_id: str | None = Field(default=None, description=f"{NO_EFFECT} (vLLM).")
    stream: bool = Field(default=False, description="Server-sent events.")
    stream_options: StreamOptions | None = Field(default=None, description="Only with stream.")

    _nulls_are_unset = model_validator(mode="before")(nulls_dropped)

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator(*GUIDES[1:])
    @classmethod
    def _one_guide(cls, value: object, info: ValidationInfo) -> object:
        earlier = [name for name in GUIDES if info.data.get(name) is not None]
        if value is not None and earlier:
            raise ValueError(f"send one of {', '.join(GUIDES)}, not {earlier[0]} and this")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM: only together with include_usage)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


class ChatCompletionRequest(_GenerationRequest):
    model_config = ConfigDict(json_schema_extra={"x-refused-fields": refused_fields.CHAT})

    messages: Annotated[list[InputMessage], counted("messages", as_sent=True)] = Field(
        min_length=1, description="The conversation."
    )
    tools: Annotated[list[Tool], counted("tools", as_sent=True)] | None = Field(
        default=None, description="Functions the model may call."
    )
    tool_choice: ToolChoice | None = Field(
        default=None, description='"none", "auto", "required" or a named function.'
    )
    parallel_tool_calls: bool = Field(default=True, description="More than one call allowed.")
    response_format: ResponseFormat | None = Field(
        default=None, description="text, json_object or json_schema (enforced by a grammar)."
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default={}, description="vLLM: more variables for the chat template."
    )
    add_generation_prompt: bool = Field(
        default=True, description="vLLM: end the prompt with the assistant's turn opening."
    )
    continue_final_message: bool = Field(
        default=False,
        description="vLLM: the reply continues the last message (send "
        "add_generation_prompt false with it).",
    )
    reasoning_effort: ReasoningEffort | None = Field(
        default=None,
        description="A chat template variable, as in vLLM (with enable_thinking: effort is "
        "not none, unless chat_template_kwargs sets it); templates that do not read them "
        "are unaffected.",
    )
    documents: Annotated[list[dict[str, str]], counted("documents", as_sent=True)] | None = Field(
        default=None, description="vLLM: a chat template variable (for RAG templates)."
    )
    include_reasoning: bool = Field(
        default=True, description="vLLM: false leaves reasoning_content out of the reply."
    )
    modalities: list[Literal["text"]] | None = Field(default=None, description="Only text.")
    max_tokens: int | None = Field(default=None, ge=1, description="Deprecated by OpenAI.")
    max_completion_tokens: int | None = Field(
        default=None, ge=1, description="The most tokens to generate (default: the context)."
    )
    logprobs: bool = Field(default=False, description="Log-probabilities of the reply tokens.")
    top_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_TOP_LOGPROBS, description="Alternatives per token."
    )

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs is only allowed when logprobs is true")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _one_ending(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt", True):
            raise ValueError("continue_final_message needs add_generation_prompt false")
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
    model_config = ConfigDict(json_schema_extra={"x-refused-fields": refused_fields.COMPLETIONS})

    prompt: Annotated[Prompts, counted("prompt")] = Field(
        description="Text, texts, token ids, or lists of token ids."
    )
    max_tokens: int = Field(default=16, ge=1, description="The most tokens to generate.")
    echo: bool = Field(
        default=False, description="The prompt's text comes first in the reply's text."
    )
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_TOP_LOGPROBS, description="Alternatives per reply token."
    )

    @field_validator("logprobs")
    @classmethod
    def _not_with_echo(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("echo"):
            raise ValueError("with echo it needs prompt log-probabilities, which are not computed")
        return value

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
    modalities: list[Literal["text", "image", "audio"]] = Field(
        default=["text"], description="what a chat's messages may hold for this model"
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
