"""OpenAI tool calling bodies: the tools a request offers, how it lets the model choose, the
calls in a reply (whole, and as stream deltas)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


def _is_none(value: object) -> bool:
    return value is None


# ---- requests ------------------------------------------------------------------------------


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="a JSON Schema; its arguments are constrained to it when a call is forced",
    )
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming one function: the reply is a call to it."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"arguments must be JSON text: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object")
        return value


class ToolCall(BaseModel):
    """A call in an assistant message, sent back in a conversation's history, or in a reply."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_view(self) -> dict[str, Any]:
        """The call as chat templates read it: arguments as an object (Hugging Face's and
        vLLM's convention), whatever else as OpenAI sends it."""
        function = {"name": self.function.name, "arguments": json.loads(self.function.arguments)}
        return {"id": self.id, "type": self.type, "function": function}


# ---- stream deltas -------------------------------------------------------------------------


class FunctionCallDelta(BaseModel):
    name: str | None = Field(default=None, exclude_if=_is_none)
    arguments: str | None = Field(default=None, exclude_if=_is_none)


class ToolCallDelta(BaseModel):
    """A piece of a streamed call: the first names it (id, type, function name), the next
    carries its arguments; the OpenAI SDK joins them by `index`."""

    index: int
    id: str | None = Field(default=None, exclude_if=_is_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_is_none)
    function: FunctionCallDelta


def call_deltas(index: int, call: ToolCall) -> list[ToolCallDelta]:
    """A whole call as the two deltas OpenAI streams for it."""
    return [
        ToolCallDelta(
            index=index,
            id=call.id,
            type="function",
            function=FunctionCallDelta(name=call.function.name, arguments=""),
        ),
        ToolCallDelta(index=index, function=FunctionCallDelta(arguments=call.function.arguments)),
    ]
