"""An agent framework nobody here wrote drives Baton: the OpenAI Agents SDK, with a tool and
`tool_choice="required"`, over the whole Serve app (real Ray, two replicas of a generated
hybrid model, Baton's router). The agent calls the tool, feeds the result back and finishes;
the follow-up turn reuses the cached conversation."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from typing import Annotated

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from pydantic import Field

from baton_serve.deploy.config import BatonConfig
from baton_serve.loadtests.serve_app import serve_app
from baton_serve.replicas.engine.engine_config import EngineConfig


@pytest.fixture(scope="module")
def app(serve_port, tiny_model) -> Iterator[tuple[str, BatonConfig]]:
    config = BatonConfig(
        model=str(tiny_model("qwen35")),
        replicas=2,
        num_cpus_per_replica=0.5,
        engine=EngineConfig(n_ctx=2048, n_slots=1, n_threads=1),
        heartbeat_s=0.2,
        hmac_key=secrets.token_hex(16),
    )
    with serve_app(config, "agents", serve_port) as url:
        yield url, config


def test_agent_calls_a_tool_and_finishes(app) -> None:
    url, config = app
    set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI
    looked_up: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """The current weather in a city."""
        looked_up.append(city)
        return f"It is 12 degrees in {city}."

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="forecaster",
        instructions="Answer weather questions with the get_weather tool.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model=config.served_model_name, openai_client=client),
        model_settings=ModelSettings(tool_choice="required", temperature=0.0, max_tokens=120),
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Oslo?", max_turns=4))

    assert len(looked_up) >= 1 and all(0 < len(city) <= 12 for city in looked_up)
    assert isinstance(result.final_output, str)
    responses = result.raw_responses
    assert len(responses) >= 2  # the forced call, then the answer after the tool's result
    follow_up = responses[-1].usage
    assert follow_up.input_tokens_details.cached_tokens >= responses[0].usage.input_tokens - 8
