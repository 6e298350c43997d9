"""Clients nobody here wrote drive Baton, unmodified, each through its own main path:
LangChain's `ChatOpenAI`, LiteLLM, pydantic-ai and the OpenAI Agents SDK. Each gets a structured
reply as a pydantic model (with the bounds pydantic writes: `ge`, `gt`, `le`), a forced
tool call whose arguments fit the schema, and a streamed chat whose usage adds up — from
the gateway serving the real default model (SmolLM2-135M) over real HTTP. Greedy, and with
few tokens: a 135M model is quick, and at temperature 0 the run repeats."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

import agents
import jsonschema
import pytest
from gateway_harness import Served, serving
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from pydantic import BaseModel, Field
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import RunUsage

from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.models.default_model import default_model_path
from baton_serve.router.gateway.gateway import GatewaySettings

MODEL = "SmolLM2-135M-Instruct.Q4_1"
STREAM_TOKENS = 12
PERSON_PROMPT = "Ada is 36 years old and 1.65 metres tall. Who is she?"
WEATHER_PROMPT = "What is the weather like in Paris today?"


class Person(BaseModel):
    """A pydantic model as real code writes it: one-sided and exclusive bounds."""

    name: str = Field(max_length=16)
    age: int = Field(ge=0)
    height_m: float = Field(gt=0, le=3)


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=20)


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    settings = GatewaySettings(MODEL, str(default_model_path()), n_ctx=2048)
    with serving(settings, EngineConfig(n_ctx=2048, n_slots=1, n_threads=2)) as served:
        yield served


@pytest.fixture(scope="module")
def litellm() -> ModuleType:
    """LiteLLM, imported with its bundled price list (it would fetch one from the web)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        import litellm

    return litellm


def _chat_openai(served: Served, **settings: Any) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL,
        base_url=f"{served.url}/v1",
        api_key="unused",
        temperature=0,
        max_retries=0,
        **settings,
    )


# ---- LangChain -----------------------------------------------------------------------------


def test_langchain_structured_output(served: Served) -> None:
    """`with_structured_output`'s default method: `response_format` json_schema, parsed."""
    person = (
        _chat_openai(served, max_tokens=80).with_structured_output(Person).invoke(PERSON_PROMPT)
    )
    assert isinstance(person, Person)


def test_langchain_forced_tool_call(served: Served) -> None:
    bound = _chat_openai(served, max_tokens=60).bind_tools([GetWeather], tool_choice="GetWeather")
    message = bound.invoke(WEATHER_PROMPT)
    assert [call["name"] for call in message.tool_calls] == ["GetWeather"]
    GetWeather.model_validate(message.tool_calls[0]["args"])


def test_langchain_stream_with_usage(served: Served) -> None:
    chunks = list(
        _chat_openai(served, max_tokens=STREAM_TOKENS, stream_usage=True).stream("Say hello.")
    )
    assert sum(1 for chunk in chunks if chunk.content) > 1
    reply = sum(chunks[1:], chunks[0])
    usage = reply.usage_metadata  # from Baton's usage chunk only: LangChain estimates none
    assert reply.content and usage is not None
    assert usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= STREAM_TOKENS
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


# ---- LiteLLM -------------------------------------------------------------------------------


def _litellm_call(litellm: ModuleType, served: Served, prompt: str, **params: Any) -> Any:
    return litellm.completion(
        model=f"openai/{MODEL}",
        api_base=f"{served.url}/v1",
        api_key="unused",
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        **params,
    )


def test_litellm_stream_with_usage(litellm: ModuleType, served: Served) -> None:
    chunks = list(
        _litellm_call(
            litellm,
            served,
            "Say hello.",
            max_tokens=STREAM_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    # Baton's usage chunk, last: without it `stream_chunk_builder` would estimate a usage.
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details.cached_tokens is not None
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= STREAM_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    reply = litellm.stream_chunk_builder(chunks)
    assert reply.choices[0].message.content
    assert reply.usage.prompt_tokens == usage.prompt_tokens


def test_litellm_forced_tool_call(litellm: ModuleType, served: Served) -> None:
    reply = _litellm_call(
        litellm,
        served,
        WEATHER_PROMPT,
        max_tokens=60,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    calls = reply.choices[0].message.tool_calls
    assert [call.function.name for call in calls] == ["get_weather"]
    arguments = json.loads(calls[0].function.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])


def test_litellm_response_format(litellm: ModuleType, served: Served) -> None:
    """A pydantic model as `response_format`: LiteLLM sends it as a strict json_schema."""
    reply = _litellm_call(litellm, served, PERSON_PROMPT, max_tokens=80, response_format=Person)
    Person.model_validate_json(reply.choices[0].message.content)


# ---- pydantic-ai ---------------------------------------------------------------------------


def _pydantic_ai_model(served: Served) -> OpenAIChatModel:
    provider = OpenAIProvider(base_url=f"{served.url}/v1", api_key="unused")
    return OpenAIChatModel(MODEL, provider=provider)


def test_pydantic_ai_tool_output(served: Served) -> None:
    """An `output_type` model, the default way: an output tool, forced (`tool_choice:
    "required"`)."""
    agent = Agent(_pydantic_ai_model(served), output_type=Person, retries=0)
    result = agent.run_sync(PERSON_PROMPT, model_settings={"temperature": 0, "max_tokens": 80})
    assert isinstance(result.output, Person)
    call = result.all_messages()[1].parts[0]
    assert call.part_kind == "tool-call" and call.tool_name == "final_result"


def test_pydantic_ai_native_output(served: Served) -> None:
    """`NativeOutput`: the model's schema as `response_format`."""
    agent = Agent(_pydantic_ai_model(served), output_type=NativeOutput(Person), retries=0)
    result = agent.run_sync(PERSON_PROMPT, model_settings={"temperature": 0, "max_tokens": 80})
    assert isinstance(result.output, Person)


def test_pydantic_ai_stream_usage(served: Served) -> None:
    """Streamed text with usage. With `openai_continuous_usage_stats` (vLLM's
    `continuous_usage_stats`) every chunk carries the usage so far, which pydantic-ai reads
    as cumulative: the totals are the same either way."""
    agent = Agent(_pydantic_ai_model(served))

    async def run(continuous: bool) -> tuple[str, RunUsage]:
        settings = {"temperature": 0, "max_tokens": STREAM_TOKENS}
        if continuous:
            settings["openai_continuous_usage_stats"] = True
        async with agent.run_stream("Say hello.", model_settings=settings) as result:
            return await result.get_output(), result.usage

    text, usage = asyncio.run(run(continuous=False))
    assert text
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= STREAM_TOKENS
    continuous_text, continuous_usage = asyncio.run(run(continuous=True))
    assert continuous_text == text
    assert (continuous_usage.input_tokens, continuous_usage.output_tokens) == (
        usage.input_tokens,
        usage.output_tokens,
    )


# ---- OpenAI Agents SDK (its forced tool call: tests/test_agents_sdk.py) ---------------------


@contextlib.asynccontextmanager
async def _agent(
    served: Served, output_type: type | None = None, **settings: Any
) -> AsyncIterator[agents.Agent]:
    """An agent on Baton; its HTTP client is closed on the loop that used it."""
    agents.set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI
    async with AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0) as client:
        yield agents.Agent(
            name="assistant",
            model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
            model_settings=agents.ModelSettings(temperature=0.0, **settings),
            output_type=output_type,
        )


def test_agents_sdk_output_type(served: Served) -> None:
    """An `output_type` model: the SDK sends its strict schema as `response_format`."""

    async def run() -> agents.RunResult:
        async with _agent(served, output_type=Person, max_tokens=80) as agent:
            return await agents.Runner.run(agent, PERSON_PROMPT, max_turns=1)

    assert isinstance(asyncio.run(run()).final_output, Person)


def test_agents_sdk_streamed_usage(served: Served) -> None:
    async def run() -> tuple[list[str], agents.RunResultStreaming]:
        async with _agent(served, max_tokens=STREAM_TOKENS, include_usage=True) as agent:
            result = agents.Runner.run_streamed(agent, "Say hello.", max_turns=1)
            deltas = [
                event.data.delta
                async for event in result.stream_events()
                if event.type == "raw_response_event"
                and event.data.type == "response.output_text.delta"
            ]
            return deltas, result

    deltas, result = asyncio.run(run())
    assert len(deltas) > 1 and result.final_output == "".join(deltas)
    usage = result.context_wrapper.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= STREAM_TOKENS
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
