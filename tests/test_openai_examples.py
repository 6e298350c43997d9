"""The OpenAI Python SDK's own examples for function calling and structured output, run
against Baton serving the real default model (SmolLM2-135M): the tool call comes back with
arguments that fit the schema, and `parse` returns the pydantic object."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from gateway_harness import Served, serving
from pydantic import BaseModel

from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.models.default_model import default_model_path
from baton_serve.router.gateway.gateway import GatewaySettings

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    settings = GatewaySettings(MODEL, str(default_model_path()), n_ctx=2048)
    with serving(settings, EngineConfig(n_ctx=2048, n_slots=1, n_threads=2)) as served:
        yield served


def _client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def test_function_calling_example(served: Served) -> None:
    """From the SDK's function-calling guide (with `tool_choice="required"`, and greedy: at
    temperature 1 a 135M model sometimes writes the location until the context is full),
    then the tool's result sent back as the guide does."""
    client = _client(served)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get current temperature for a given location.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "location": {
                            "type": "string",
                            "description": "City and country e.g. Bogotá, Colombia",
                        }
                    },
                    "required": ["location"],
                    "additionalProperties": False,
                },
                "strict": True,
            },
        }
    ]
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    completion = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, tool_choice="required", temperature=0
    )
    tool_call = completion.choices[0].message.tool_calls[0]
    args = json.loads(tool_call.function.arguments)
    jsonschema.validate(args, tools[0]["function"]["parameters"])
    messages.append(completion.choices[0].message)
    messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "14 degrees"})
    follow_up = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, max_completion_tokens=40
    )
    assert follow_up.choices[0].finish_reason in {"stop", "length", "tool_calls"}
    assert follow_up.usage.prompt_tokens_details.cached_tokens > 0


class CalendarEvent(BaseModel):
    name: str
    date: str
    participants: list[str]


def test_structured_output_example(served: Served) -> None:
    """From the SDK's structured-output guide: `parse` with a pydantic model; greedy, so
    the run is repeatable (sampled at the default temperature 1, a 135M model sometimes
    writes one string until the context is full)."""
    completion = _client(served).chat.completions.parse(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Extract the event information."},
            {"role": "user", "content": "Alice and Bob are going to a science fair on Friday."},
        ],
        response_format=CalendarEvent,
        temperature=0,
    )
    event = completion.choices[0].message.parsed
    assert isinstance(event, CalendarEvent)
