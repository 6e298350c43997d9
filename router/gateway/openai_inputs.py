"""The input shapes of OpenAI requests: message content given as parts, stop sequences,
prompts in their four forms, one message of a conversation, and the stream options."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from baton_serve.cache_store.wire.prompt_types import AudioFormat
from baton_serve.router.gateway.list_bounds import counted_in_total
from baton_serve.router.gateway.openai_tools import ToolCall

MAX_STOP_SEQUENCES = 4


def nulls_dropped(data: Any) -> Any:
    """A body with its null fields left out: a null means "not sent" (OpenAI clients send
    nulls for options they leave unset)."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(
        default=False, description="A last chunk (choices: []) carries the usage."
    )
    continuous_usage_stats: bool = Field(
        default=False,
        description="vLLM: with include_usage, every chunk also carries the usage so far "
        "(prompt, cached and completion tokens of its choice).",
    )

    _nulls_are_unset = model_validator(mode="before")(nulls_dropped)


def _as_list(value: object) -> object:
    return [value] if isinstance(value, str) else value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, description="a base64 data: URL")
    detail: Literal["auto", "low", "high"] = Field(
        default="auto",
        description="Accepted; every image is read at the resolution its projector takes.",
    )


def _url_object(value: object) -> object:
    return {"url": value} if isinstance(value, str) else value


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["image_url"]
    image_url: Annotated[ImageURL, BeforeValidator(_url_object)]


class InputAudio(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data: str = Field(min_length=1, description="the clip's file, base64")
    format: AudioFormat


class AudioPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["input_audio"]
    input_audio: InputAudio


MediaPart = ImagePart | AudioPart
ContentPart = Annotated[TextPart | ImagePart | AudioPart, Field(discriminator="type")]


_PARTS: TypeAdapter[list[TextPart | ImagePart | AudioPart]] = TypeAdapter(list[ContentPart])


def _joined_text_parts(value: object) -> object:
    """Message content given as parts: the text parts joined with newlines, where all are
    text; the parts themselves where an image (or audio) is among them."""
    if not isinstance(value, list):
        if not isinstance(value, str):
            raise ValueError("content is a string or a list of content parts")
        return value
    known = ("text", "image_url", "input_audio")
    for part in value:
        if not isinstance(part, dict) or part.get("type") not in known:
            raise ValueError(
                'a content part is {"type": "text", "text": ...}, '
                '{"type": "image_url", "image_url": {"url": "data:..."}} or '
                '{"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav"}}'
            )
    if all(part["type"] == "text" for part in value):
        texts = [part.get("text") for part in value]
        if not all(isinstance(text, str) for text in texts):
            raise ValueError('a text content part is {"type": "text", "text": "..."}')
        return "\n".join(texts)
    try:
        return _PARTS.validate_python(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
        raise ValueError(f"content{where}: {error['msg']}") from None


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
    str | list[ContentPart],
    Field(union_mode="left_to_right"),
    BeforeValidator(_joined_text_parts, json_schema_input_type=str | list[dict[str, Any]]),
    counted_in_total("content"),  # parts counted first (the last before-validator runs first)
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


class InputMessage(BaseModel):
    """A message of the conversation. An assistant message may carry `tool_calls` and no
    content; a `tool` message answers the call named by `tool_call_id`."""

    model_config = ConfigDict(extra="forbid")

    role: str = Field(min_length=1)
    content: MessageContent | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], counted_in_total("tool_calls")] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @property
    def text(self) -> str | None:
        """The content as text: the gateway has put a marker in place of each image
        (`media_parts`) before anything reads it."""
        if isinstance(self.content, list):
            raise TypeError("a message's images are not resolved yet")
        return self.content

    @model_validator(mode="after")
    def _shape_fits_role(self) -> InputMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages may carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant's tool calls may omit it)")
        return self
