"""Structured output: `response_format` → GBNF grammar, checked in real llama.cpp.

Every corpus schema (tests/json_schemas.py) converts and its grammar parses with a real
vocabulary; every unsupported one is a 400 naming the keyword and its JSON pointer; and a
generated model, sampling at temperature 1 through llama.cpp's grammar sampler, writes JSON
that validates against each schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from grammar_sampler import MAX_TOKENS, GrammarSampler
from json_schemas import SUPPORTED, UNSUPPORTED
from jsonschema import Draft202012Validator, FormatChecker
from llama_cpp.llama_grammar import JSON_GBNF
from pydantic import TypeAdapter, ValidationError

from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.sampling import grammar_problem
from baton_serve.router.gateway.structured_output import (
    JsonSchemaFormat,
    ResponseFormat,
    SchemaNotEnforceable,
    response_grammar,
)

RESPONSE_FORMAT: TypeAdapter[Any] = TypeAdapter(ResponseFormat)
SEEDS = 3


def _format(schema: Any, strict: bool | None = None) -> JsonSchemaFormat:
    spec = {"name": "answer", "schema": schema, **({} if strict is None else {"strict": strict})}
    parsed = RESPONSE_FORMAT.validate_python({"type": "json_schema", "json_schema": spec})
    assert isinstance(parsed, JsonSchemaFormat)
    return parsed


@pytest.fixture(scope="module")
def model(tiny_model: Callable[[str], Path]) -> Iterator[LlamaModel]:
    with LlamaModel(tiny_model("llama")) as loaded:
        yield loaded


# ---- conversion ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", SUPPORTED)
def test_supported_schema_converts_and_parses(name: str, model: LlamaModel) -> None:
    grammar = response_grammar(_format(SUPPORTED[name]))
    assert grammar and re.search(r"^root ::= ", grammar, re.MULTILINE)
    assert grammar_problem(grammar, model.vocab) is None


@pytest.mark.parametrize(
    ("name", "schema", "keyword", "path"), UNSUPPORTED, ids=[case[0] for case in UNSUPPORTED]
)
def test_unsupported_schema_is_refused(name: str, schema: Any, keyword: str, path: str) -> None:
    """Refused naming the keyword and its JSON pointer (the gateway answers a 400 with
    `param: response_format`, tested in test_response_format)."""
    with pytest.raises(SchemaNotEnforceable) as caught:
        response_grammar(_format(schema))
    assert f"'{keyword}' at '{path}'" in str(caught.value)


def test_json_object_is_an_object_rooted_grammar(model: LlamaModel) -> None:
    grammar = response_grammar(RESPONSE_FORMAT.validate_python({"type": "json_object"}))
    assert grammar == JSON_GBNF
    assert re.search(r"^root\s+::= object$", grammar, re.MULTILINE)
    assert grammar_problem(grammar, model.vocab) is None


def test_text_needs_no_grammar() -> None:
    assert response_grammar(RESPONSE_FORMAT.validate_python({"type": "text"})) is None
    assert response_grammar(None) is None


@pytest.mark.parametrize(
    "body",
    [
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "a"}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": True}},
        {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "extra": 1}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "maybe"}},
        {"type": "text", "json_schema": {"name": "a", "schema": {}}},
        {"type": "json_object", "schema": {}},
        {"json_schema": {"name": "a", "schema": {}}},
    ],
)
def test_invalid_response_formats_are_refused(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        RESPONSE_FORMAT.validate_python(body)


@pytest.mark.parametrize("strict", [None, False, True])
def test_unlisted_properties_are_never_generated(strict: bool | None) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    grammar = response_grammar(_format(schema, strict))
    assert grammar and "additional" not in grammar and "object" not in grammar
    open_schema = {**schema, "required": ["a"], "additionalProperties": True}
    assert "additional-kv" in (response_grammar(_format(open_schema, strict)) or "")


def test_strings_exclude_control_characters() -> None:
    """Works around the converter's `char` rule, which admits raw control characters."""
    grammar = response_grammar(_format({"type": "string"})) or ""
    assert re.search(r'^char ::= \[\^"\\\\\\x7F\\x00-\\x1F\] \|', grammar, re.MULTILINE), grammar


def test_a_grammar_llama_cpp_cannot_parse_is_refused() -> None:
    assert grammar_problem('root ::= "\\d"') is not None
    assert grammar_problem("root ::= undefined-rule") is not None


# ---- sampling ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampler(model: LlamaModel) -> Iterator[GrammarSampler]:
    made = GrammarSampler(model)
    yield made
    made.close()


_FORMATS = FormatChecker(formats=["uuid", "ipv4", "ipv6", "email"])
_DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{3})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
for _name, _regex in (("date", _DATE), ("time", _TIME), ("date-time", f"{_DATE}T{_TIME}")):
    # RFC 3339's shape; the grammar does not know month lengths (it allows 2023-02-31)
    _FORMATS.checks(_name)(
        lambda value, r=_regex: not isinstance(value, str) or bool(re.fullmatch(r, value))
    )


@pytest.mark.parametrize("name", SUPPORTED)
def test_sampled_output_validates(name: str, sampler: GrammarSampler) -> None:
    grammar = response_grammar(_format(SUPPORTED[name])) or ""
    validator = Draft202012Validator(SUPPORTED[name], format_checker=_FORMATS)
    for seed in _seeds(name):
        text, ended = sampler.generate(grammar, seed)
        assert ended, f"seed {seed}: no end of generation within {MAX_TOKENS} tokens: {text!r}"
        validator.validate(json.loads(text))


def _seeds(name: str) -> range:
    start = sum(map(ord, name))
    return range(start, start + SEEDS)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_sampled_json_object_is_an_object(seed: int, sampler: GrammarSampler) -> None:
    text, ended = sampler.generate(JSON_GBNF, seed)
    assert ended, f"no end of generation within {MAX_TOKENS} tokens: {text!r}"
    assert isinstance(json.loads(text), dict)
