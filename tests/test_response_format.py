"""Structured output through Baton's own path: every corpus schema (tests/json_schemas.py)
enforced by the engine's sampler chain (a generated hybrid model at temperature 1: each
reply parses and validates with `jsonschema`), and `response_format` through the gateway
with the official OpenAI client. Conversion and refusals: test_structured_output_corpus."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from gateway_harness import Served, serving
from json_schemas import SUPPORTED

from baton_serve.cache_store.wire.protocol import GenerationRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.router.gateway.gateway import GatewaySettings
from baton_serve.router.gateway.structured_output import schema_grammar

MODEL = "baton-tiny"
SEEDS = (0, 1)
CLOSING_BIAS = 8.0  # on tokens that start with `"`, `]` or `}`: see below


def test_the_corpus_is_large_enough() -> None:
    assert len(SUPPORTED) >= 30


def test_every_reply_validates(tiny_model, make_engine) -> None:
    """Random weights at temperature 1 under each schema's grammar: every reply is JSON the
    schema accepts, ended by the grammar (not the token limit). Random weights almost never
    close a string among the ~49,000 tokens a grammar allows inside it, so closing tokens
    get a logit bias — through the request's own `logit_bias`; the grammar still decides."""
    engine = make_engine(tiny_model("qwen35"), n_slots=4, n_ctx=2048)
    closing = tuple(
        (token, CLOSING_BIAS)
        for token in range(engine.model.n_vocab)
        if engine.model.token_bytes(token)[:1] in (b'"', b"]", b"}")
    )
    prompt = engine.text_prompt("JSON:")
    handles = {
        (name, seed): engine.submit(
            GenerationRequest(
                prompt=prompt,
                sampling=SamplingParams(
                    temperature=1.0,
                    seed=seed,
                    max_tokens=1500,
                    grammar=schema_grammar(schema),
                    logit_bias=closing,
                ),
            )
        )
        for name, schema in SUPPORTED.items()
        for seed in SEEDS
    }
    for (name, seed), handle in handles.items():
        done = handle.result(timeout=300)
        assert done.finish_reason == "stop", (name, seed, done.text[-200:])
        jsonschema.validate(json.loads(done.text), SUPPORTED[name])


# ---- through the gateway ------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_model: Callable[[str], Path]) -> Iterator[Served]:
    settings = GatewaySettings(MODEL, str(tiny_model("qwen35")), n_ctx=2048)
    with serving(settings, EngineConfig(n_ctx=2048, n_slots=2, n_threads=2)) as served:
        yield served


def _client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


ASK = [{"role": "user", "content": "Give me an order as JSON."}]


def test_json_schema_and_json_object_replies(served: Served) -> None:
    client = _client(served)
    schema = SUPPORTED["nested_objects"]
    for seed in SEEDS:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            temperature=1.0,
            seed=seed,
            max_completion_tokens=1500,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "order", "schema": schema, "strict": True},
            },
        )
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=0,
        max_completion_tokens=1500,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize(
    ("response_format", "needle"),
    [
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "n",
                    "schema": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                },
            },
            "uniqueItems",
        ),
        ({"type": "json_schema", "json_schema": {"name": "n"}}, "schema"),
        ({"type": "xml"}, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}}, "name"),
    ],
)
def test_bad_response_formats_get_400(served: Served, response_format: dict, needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _client(served).chat.completions.create(
            model=MODEL, messages=ASK, response_format=response_format
        )
    assert needle in caught.value.body["message"] + str(caught.value.body["param"])
    assert caught.value.body["param"].startswith("response_format")


def test_response_format_with_callable_tools_is_refused(served: Served) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        _client(served).chat.completions.create(
            model=MODEL, messages=ASK, tools=[tool], response_format={"type": "json_object"}
        )
