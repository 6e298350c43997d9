"""Forced tool calls always arrive: with `tool_choice` "required" or a named function, every
reply carries at least one call whose arguments fit the function's schema — at temperature
0 and 1, streamed and not, with a small `max_tokens` — and no call markup reaches `content`.

Through the gateway over real HTTP with the official OpenAI client, on the default model
(SmolLM2-135M, `DEFAULT_MODEL_REQUESTS` per temperature) and on generated random-weight
models (fewer: they prove every format's grammar ends, not what a trained model chooses).
Reading replies cut off by `max_tokens` is checked directly on the parser.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import openai
import pytest
from gateway_harness import Served, serving

from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.sampling import TokenSampler
from baton_serve.replicas.models.default_model import default_model_path
from baton_serve.router.gateway.gateway import GatewaySettings
from baton_serve.router.gateway.openai_tools import Tool
from baton_serve.router.gateway.structured_output import schema_grammar
from baton_serve.router.gateway.tool_calls import (
    HERMES_CLOSE,
    MARKERS,
    ToolFormat,
    call_schema,
    parse_tool_calls,
    wrap_call_grammar,
)

TEMPLATES = Path(__file__).parent / "chat_templates"
MODEL = "forced"
# Forced requests per temperature on SmolLM2, every one checked: 24 send each of the six
# mixes of forcing mode (required, named, one call) and streamed or not 4 times, each of
# the five questions 4 or 5 times.
DEFAULT_MODEL_REQUESTS = 24


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": schema},
    }


# Strings are bounded as pydantic's `max_length` writes them: a random-weight model at
# temperature 1 rarely closes an unbounded string within a small max_tokens.
WEATHER = _tool(
    "get_weather",
    "Current weather for a city.",
    {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
)
TIME = _tool(
    "get_time",
    "The local time in a time zone.",
    {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
)
SEARCH = _tool(
    "search_flights",
    "Flights between two airports.",
    {
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
        "nonstop": {"type": "boolean"},
    },
)
TOOLS = [WEATHER, TIME, SEARCH]
OFFERED = [Tool.model_validate(t) for t in TOOLS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CITIES = ["Oslo", "Paris", "Lima", "Tokyo", "Cairo", "Berlin", "Quito", "Seoul", "Perth", "Rome"]
ASKS = [
    "What is the weather in {city}?",
    "What time is it in {city} right now?",
    "Find me a flight from {city} to London for two people.",
    "Is it raining in {city}, and what time is it there?",
    "I am flying to {city} next week. Check the weather.",
]


@dataclass
class Outcome:
    """One forced request's reply, streamed or not, as the client saw it."""

    finish_reason: str | None = None
    completion_tokens: int = 0
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments)


def _request(i: int, temperature: float, max_tokens: int) -> tuple[dict[str, Any], str | None]:
    """Request `i` of a run (mixing forcing modes and questions), and the function it names."""
    ask = ASKS[i % len(ASKS)].format(city=CITIES[i // len(ASKS) % len(CITIES)])
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": ask}],
        "tools": TOOLS,
        "temperature": temperature,
        "seed": i,
        "max_tokens": max_tokens,
        "tool_choice": "required",
    }
    mode = i % 3
    named = None
    if mode == 1:
        named = TOOLS[i % len(TOOLS)]["function"]["name"]
        request["tool_choice"] = {"type": "function", "function": {"name": named}}
    elif mode == 2:
        request["parallel_tool_calls"] = False
    return request, named


def _send(client: openai.OpenAI, request: dict[str, Any], stream: bool) -> Outcome:
    if not stream:
        reply = client.chat.completions.create(**request)
        choice = reply.choices[0]
        calls = choice.message.tool_calls or []
        return Outcome(
            choice.finish_reason,
            reply.usage.completion_tokens,
            choice.message.content or "",
            [(c.function.name, c.function.arguments) for c in calls],
        )
    outcome = Outcome()
    parts: dict[int, list[str]] = {}
    options = {"include_usage": True}
    for chunk in client.chat.completions.create(**request, stream=True, stream_options=options):
        if chunk.usage is not None:
            outcome.completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            outcome.content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                name_and_arguments = parts.setdefault(delta.index, ["", ""])
                name_and_arguments[0] += delta.function.name or ""
                name_and_arguments[1] += delta.function.arguments or ""
            outcome.finish_reason = choice.finish_reason or outcome.finish_reason
    outcome.calls = [(name, arguments) for name, arguments in parts.values()]
    return outcome


def _problem(outcome: Outcome, named: str | None, one_call: bool, max_tokens: int) -> str | None:
    """What is wrong with a forced request's outcome, if anything: it must hold a valid
    call (one only where one was asked for), and end on its own ("tool_calls") unless it
    used every token it was allowed ("length")."""
    if not outcome.calls:
        return "no tool call"
    if any(marker in outcome.content for marker in (*MARKERS, HERMES_CLOSE)):
        return f"call markup in content: {outcome.content!r}"
    if one_call and len(outcome.calls) != 1:
        return f"{len(outcome.calls)} calls where one was asked for"
    cut = outcome.completion_tokens == max_tokens
    if outcome.finish_reason != ("length" if cut else "tool_calls"):
        return f"finish_reason {outcome.finish_reason!r} after {outcome.completion_tokens} tokens"
    for name, arguments in outcome.calls:
        if named is not None and name != named:
            return f"called {name}, not the named {named}"
        try:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        except (KeyError, ValueError, jsonschema.ValidationError) as exc:
            return f"{name}({arguments}): {exc}"
    return None


def _run_forced(served: Served, count: int, temperature: float, max_tokens: int) -> list[str]:
    """`count` forced requests, half of them streamed, four at a time; their problems."""
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)

    def one(i: int) -> str | None:
        request, named = _request(i, temperature, max_tokens)
        one_call = named is not None or request.get("parallel_tool_calls") is False
        outcome = _send(client, request, stream=i % 2 == 1)
        problem = _problem(outcome, named, one_call, max_tokens)
        return None if problem is None else f"request {i}: {problem}"

    with ThreadPoolExecutor(4) as pool:
        return [p for p in pool.map(one, range(count)) if p is not None]


@contextlib.contextmanager
def _serve(model: Path, template: str | None) -> Iterator[Served]:
    source = None if template is None else (TEMPLATES / template).read_text()
    settings = GatewaySettings(MODEL, str(model), n_ctx=2048, chat_template=source)
    with serving(settings, EngineConfig(n_ctx=2048, n_slots=4, n_threads=2)) as served:
        yield served


@pytest.fixture(scope="module")
def smollm2() -> Iterator[Served]:
    with _serve(default_model_path(), None) as served:
        yield served


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_default_model_always_calls(smollm2: Served, temperature: float) -> None:
    """`DEFAULT_MODEL_REQUESTS` forced requests on SmolLM2, whose template cannot show
    tools (Hermes calls taught in the system message): each returns a valid call, none leaks
    markup."""
    problems = _run_forced(smollm2, DEFAULT_MODEL_REQUESTS, temperature, max_tokens=64)
    assert not problems, problems


@pytest.mark.parametrize(
    ("arch", "template"),
    [
        ("qwen35", "hermes_think.jinja"),
        ("llama", "mistral_calls.jinja"),
        ("llama", "llama3_json.jinja"),
    ],
    ids=["qwen35-hermes", "llama-mistral", "llama-llama3"],
)
def test_generated_models_always_call(
    tiny_model: Callable[[str], Path], arch: str, template: str | None
) -> None:
    """Random weights under each format's call grammar, at temperature 0 and 1: the grammar
    alone brings every reply to a valid call and to its end."""
    with _serve(tiny_model(arch), template) as served:
        problems = [
            f"temperature {temperature}, {problem}"
            for temperature in (0.0, 1.0)
            for problem in _run_forced(served, 8, temperature, max_tokens=96)
        ]
    assert not problems, problems


# ---- where a forced reply may end ----------------------------------------------------------

ONE_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"utc_offset": 2}}\n</tool_call>'


@pytest.mark.parametrize(
    ("parallel", "reply", "may_end"),
    [
        (False, ONE_CALL, True),
        (False, ONE_CALL[:-3], False),  # inside the call
        (True, ONE_CALL, True),
        (True, ONE_CALL + "\n", True),  # where Hermes-trained models head for another call
        (True, ONE_CALL + "\n<tool_call>", False),
        (True, f"{ONE_CALL}\n{ONE_CALL}", True),
    ],
)
def test_the_call_grammar_lets_the_reply_end_after_a_call(
    parallel: bool, reply: str, may_end: bool
) -> None:
    """End-of-generation is allowed exactly where the forced calls are complete."""
    with LlamaModel(default_model_path(), vocab_only=True) as model:
        rules = schema_grammar(call_schema(OFFERED, ToolFormat.HERMES), prop_order=["name"])
        grammar = wrap_call_grammar(rules, ToolFormat.HERMES, parallel=parallel)
        sampler = TokenSampler(SamplingParams(grammar=grammar), model.n_vocab, vocab=model.vocab)
        for token in model.tokenize(reply):
            sampler.accept(token)
        logits = np.full(model.n_vocab, -1e9, dtype=np.float32)
        logits[model.eos_token] = 0.0  # the model wants to end: the grammar decides
        assert (sampler(logits) == model.eos_token) is may_end
        sampler.close()


# ---- replies cut off by max_tokens ---------------------------------------------------------

OSLO = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
CUT = '{"name": "get_weather", "arguments": {"city": "Os'


@pytest.mark.parametrize(
    "text",
    [
        f"<tool_call>\n{OSLO}\n</tool_call>\n<tool_call>\n{CUT}",
        f"[TOOL_CALLS][{OSLO}, {CUT}",
        f"<|python_tag|>{OSLO}; {CUT}",
        f"{OSLO}\n{CUT}",
    ],
    ids=["hermes", "mistral", "llama-python-tag", "bare-json"],
)
def test_complete_calls_survive_a_cut_off_reply(text: str) -> None:
    """The calls before the one max_tokens cut are returned; the cut one is dropped."""
    parsed = parse_tool_calls(text, OFFERED, truncated=True)
    assert [c.function.name for c in parsed.calls] == ["get_weather"]
    assert parsed.content == ""


def test_markup_of_calls_that_cannot_be_read_is_not_content() -> None:
    """A marked call that is not valid (cut off, bad JSON, a function not offered) is
    dropped; the words around it stay content."""
    text = (
        "Checking.\n<tool_call>\n{oops}\n</tool_call>\n"
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call>\n<tool_call>\n{"na'
    )
    parsed = parse_tool_calls(text, OFFERED)
    assert parsed.calls == [] and parsed.content == "Checking."
