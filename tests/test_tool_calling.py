"""Tool calling and reasoning: reading calls out of replies in each model family's format,
forcing calls with a grammar on real llama.cpp, and the whole loop through the gateway with
the official OpenAI client — on generated models with chat templates written for these
tests in the style of Qwen3 (Hermes calls, <think>), Llama 3.1 and Mistral, and SmolLM2's
own template, which cannot show tools."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from gateway_harness import Served, serving

from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.prompt import ChatTemplate
from baton_serve.router.gateway.chat_plan import TemplateTools
from baton_serve.router.gateway.gateway import GatewaySettings
from baton_serve.router.gateway.openai_tools import Tool
from baton_serve.router.gateway.reply_parser import ReplyParser
from baton_serve.router.gateway.structured_output import schema_grammar
from baton_serve.router.gateway.tool_calls import (
    ToolFormat,
    call_schema,
    parse_tool_calls,
    wrap_call_grammar,
)

TEMPLATES = Path(__file__).parent / "chat_templates"
MODEL = "baton-tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {
                "zone": {"type": "integer"},
                "label": {"type": "string", "pattern": "^[A-Z]{3}$"},
            },
            "required": ["zone", "label"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(CLOCK)]
SCHEMAS = {t.function.name: t.function.parameters for t in TOOLS}


# ---- reading calls -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
            '{"zone": 1, "label": "CET"}}\n</tool_call>',
            "Let me look.",
        ),
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": '
            '"celsius"}}, {"name": "get_time", "arguments": {"zone": 1, "label": "CET"}}]',
            "",
        ),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": '
            '"celsius"}}; {"name": "get_time", "parameters": {"zone": 1, "label": "CET"}}',
            "",
        ),
        (
            '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}\n'
            '{"name": "get_time", "arguments": "{\\"zone\\": 1, \\"label\\": \\"CET\\"}"}',
            "",
        ),
        (
            '{"tool_calls": [{"type": "function", "function": {"name": "get_weather", '
            '"arguments": {"city": "Oslo", "unit": "celsius"}}}, {"name": "get_time", '
            '"arguments": {"zone": 1, "label": "CET"}}]}',
            "",
        ),
    ],
    ids=["hermes", "mistral", "llama-python-tag", "bare-json", "tool_calls-object"],
)
def test_calls_are_read_in_every_format(text: str, content: str) -> None:
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}),
        ("get_time", {"zone": 1, "label": "CET"}),
    ]
    assert len({c.id for c in parsed.calls}) == 2


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("Just words.", "Just words."),
        ('{"city": "Oslo"}', '{"city": "Oslo"}'),  # JSON, but no call
        # Marked, but not a valid call: the markup is dropped, never content.
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>', ""),
        ('Hm. <tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>', "Hm."),
    ],
)
def test_what_is_not_a_valid_call_is_no_call(text: str, content: str) -> None:
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.calls == [] and parsed.content == content


def test_strict_functions_and_one_call_only() -> None:
    """A `strict` function's call whose arguments break its schema is no call (strict
    calls returned always validate, forced or not); without parallel calls, only the first
    call counts."""
    strict = Tool.model_validate({**WEATHER, "function": {**WEATHER["function"], "strict": True}})
    wrong_unit = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "K"}}</tool_call>'
    )
    assert parse_tool_calls(wrong_unit, [strict]).calls == []
    assert len(parse_tool_calls(wrong_unit, TOOLS).calls) == 1  # not strict: the model's call
    two = (
        '<tool_call>{"name": "get_time", "arguments": {"zone": 1, "label": "CET"}}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {"zone": 2, "label": "EET"}}</tool_call>'
    )
    assert len(parse_tool_calls(two, TOOLS).calls) == 2
    (only,) = parse_tool_calls(two, TOOLS, parallel=False).calls
    assert json.loads(only.function.arguments)["zone"] == 1


REPLY = (
    "<think>\nThe user wants weather.\n</think>\n\nChecking <now>.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 1000])
def test_reply_parser_splits_the_same_however_the_text_arrives(size: int) -> None:
    """Reasoning, content and the held-back tool section come out the same for any chunking;
    no marker leaks into content."""
    parser = ReplyParser(reasoning=True, in_reasoning=False, tools=True)
    pieces = []
    for start in range(0, len(REPLY), size):
        pieces += parser.feed(REPLY[start : start + size])
    pieces += parser.finish()
    reasoning = "".join(p.text for p in pieces if p.part.value == "reasoning")
    content = "".join(p.text for p in pieces if p.part.value == "content")
    assert reasoning == "\nThe user wants weather.\n"
    assert content == "Checking <now>.\n"
    assert parser.tool_text.startswith("<tool_call>")
    assert len(parse_tool_calls(parser.tool_text, TOOLS).calls) == 1


def test_reply_parser_starts_inside_reasoning_and_passes_plain_text() -> None:
    opened = ReplyParser(reasoning=True, in_reasoning=True, tools=False)
    pieces = opened.feed("step one</th") + opened.feed("ink>\n\nAnswer") + opened.finish()
    assert [(p.part.value, p.text) for p in pieces] == [
        ("reasoning", "step one"),
        ("content", "Answer"),
    ]
    plain = ReplyParser(reasoning=False, in_reasoning=False, tools=False)
    assert [p.text for p in plain.feed("  {not a call}")] == ["  {not a call}"]


# ---- templates and forced calls on real llama.cpp ------------------------------------------


def _template(name: str) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / name).read_text(), bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("hermes_think.jinja", ToolFormat.HERMES),
        ("llama3_json.jinja", ToolFormat.LLAMA3),
        ("mistral_calls.jinja", ToolFormat.MISTRAL),
    ],
)
def test_templates_are_probed_for_tool_support(name: str, fmt: ToolFormat) -> None:
    caps = TemplateTools.probe(_template(name))
    assert caps.format is fmt and caps.renders_tools and caps.renders_calls
    assert caps.reasoning == (name == "hermes_think.jinja")


def _call_grammar(fmt: ToolFormat, tools: list[Tool], *, parallel: bool) -> str:
    rules = schema_grammar(call_schema(tools, fmt), prop_order=["name", fmt.arguments_key])
    return wrap_call_grammar(rules, fmt, parallel=parallel)


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_forced_calls_parse_and_match_their_schema(fmt: ToolFormat, tiny_model, make_engine):
    """Random weights at temperature 1, constrained by the call grammar: every reply is a
    call (or several) to an offered function, with arguments valid for its schema."""
    engine = make_engine(tiny_model("llama"))
    prompt = engine.text_prompt("Call a function:")
    grammar = _call_grammar(fmt, TOOLS, parallel=fmt is not ToolFormat.LLAMA3)
    for seed in range(4):
        sampling = SamplingParams(temperature=1.0, seed=seed, grammar=grammar, max_tokens=400)
        done = engine.generate(prompt, sampling)
        assert done.finish_reason == "stop", done.text
        parsed = parse_tool_calls(done.text, TOOLS)
        assert parsed.calls and parsed.content == "", done.text
        for call in parsed.calls:
            arguments = json.loads(call.function.arguments)
            jsonschema.validate(arguments, SCHEMAS[call.function.name])


def test_a_schema_referring_to_its_root_cannot_be_forced() -> None:
    with pytest.raises(ValueError, match="root"):
        wrap_call_grammar('root ::= "[" root? "]"', ToolFormat.HERMES, parallel=False)


# ---- through the gateway, with the OpenAI client -------------------------------------------


def _served(tiny_model: Callable[[str], Path], template: str | None) -> Iterator[Served]:
    source = None if template is None else (TEMPLATES / template).read_text()
    settings = GatewaySettings(MODEL, str(tiny_model("qwen35")), n_ctx=2048, chat_template=source)
    with serving(settings, EngineConfig(n_ctx=2048, n_slots=2, n_threads=2)) as served:
        yield served


@pytest.fixture(scope="module")
def hermes(tiny_model: Callable[[str], Path]) -> Iterator[Served]:
    yield from _served(tiny_model, "hermes_think.jinja")


@pytest.fixture(scope="module")
def no_tool_template(tiny_model: Callable[[str], Path]) -> Iterator[Served]:
    """SmolLM2's own template: it cannot show tools."""
    yield from _served(tiny_model, None)


def _client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.mark.parametrize("server", ["hermes", "no_tool_template"])
def test_required_call_round_trip_reuses_the_cache(server: str, request) -> None:
    """The OpenAI docs' loop: a forced call, its result appended, the next turn — which
    reuses the cached conversation."""
    served: Served = request.getfixturevalue(server)
    client = _client(served)
    messages: list = list(QUESTION)
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        temperature=1.0,
        seed=3,
        max_completion_tokens=300,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    messages.append(choice.message.model_dump(exclude_none=True))
    for call in calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "12 degrees"})
    second = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER, CLOCK],
        max_completion_tokens=8,
        temperature=0,
    )
    assert second.choices[0].finish_reason in {"stop", "length"}
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 8, (cached, first.usage.prompt_tokens)


def test_named_function_and_streamed_calls(hermes: Served) -> None:
    """A named tool_choice calls exactly that function; streamed, the SDK's accumulated
    deltas give the same kind of call."""
    client = _client(hermes)
    request = {
        "model": MODEL,
        "messages": QUESTION,
        "tools": [WEATHER, CLOCK],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "parallel_tool_calls": False,
        "temperature": 1.0,
        "seed": 5,
        "max_completion_tokens": 200,
    }
    reply = client.chat.completions.create(**request)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])

    with client.chat.completions.stream(**request) as stream:
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls
    assert streamed.function.name == "get_time"
    assert json.loads(streamed.function.arguments) == json.loads(call.function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_and_bad_choices(hermes: Served) -> None:
    client = _client(hermes)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice="none",
        max_completion_tokens=6,
        temperature=0,
    )
    assert reply.choices[0].message.tool_calls is None
    assert isinstance(reply.choices[0].message.content, str)
    for kwargs, param in [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"extra_body": {"chat_template_kwargs": {"tools": []}}}, "chat_template_kwargs"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=QUESTION, **kwargs)
        assert caught.value.body["param"].startswith(param), caught.value.body


def test_history_as_agents_send_it(hermes: Served) -> None:
    """An assistant message with null content and tool_calls, and tool results, are
    accepted; a tool message without its id is refused."""
    client = _client(hermes)
    call = {
        "id": "call_abc123def",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
    }
    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc123def", "content": "12 degrees"},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], max_completion_tokens=4, temperature=0
    )
    assert reply.choices[0].finish_reason in {"stop", "length", "tool_calls"}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[*history[:2], {"role": "tool", "content": "x"}]
        )
    bad_arguments = {**call, "function": {"name": "get_weather", "arguments": "{oops"}}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL,
            messages=[
                *QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [bad_arguments]},
            ],
        )


def test_reasoning_is_returned_apart(hermes: Served) -> None:
    """`chat_template_kwargs` reach the template: with `reasoning_opened` (a variable of the
    test template, as DeepSeek-R1's opens <think> itself) the whole reply is reasoning, whole
    and streamed; with `enable_thinking: false` (Qwen3's) the template closes the block."""
    client = _client(hermes)
    opened = {"chat_template_kwargs": {"reasoning_opened": True}}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_completion_tokens=6,
        temperature=0,
        extra_body={**opened, "ignore_eos": True},
    )
    message = reply.choices[0].message
    assert message.content == "" and message.reasoning_content
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_completion_tokens=6,
        temperature=0,
        stream=True,
        extra_body={**opened, "ignore_eos": True},
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert streamed == message.reasoning_content
    assert not "".join(d.content or "" for d in deltas)

    off = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_completion_tokens=6,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True},
    )
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert off.choices[0].message.content
