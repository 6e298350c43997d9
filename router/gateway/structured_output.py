"""Structured output: OpenAI's `response_format`, and JSON-Schema grammars for it and for
forced tool calls, enforced by llama.cpp's grammar sampler.

`{"type": "text"}` needs no grammar; `{"type": "json_object"}` gets llama-cpp-python's
`JSON_GBNF` (its root is an object, as OpenAI's JSON mode promises); `{"type":
"json_schema", ...}` gets `schema_converter`'s grammar for the schema (llama-cpp-python's
converter plus Baton's rules for numeric bounds, string formats and `uniqueItems`), after
`schema_check.prepare` has refused every keyword that grammar would not enforce (and worked
around the converter's defects: colliding `$ref` names, a root `$ref`, missing commas beside
optional properties, unsafe patterns and literals, bounds llama.cpp's parser crashes on).
Strings never hold raw control characters (the converter's string rule allowed them). A
grammar llama.cpp cannot parse is refused too, and so is one beyond the server's
`GrammarLimits` (enum values, the grammar's size and nesting), before it is built whole.
Every refusal names the keyword and where, or the limit.

Baton enforces every schema it accepts, whatever `strict` says: objects never get properties
their schema does not list unless `additionalProperties` allows them (OpenAI's strict rule,
and a narrowing, so replies also validate against non-strict schemas). `oneOf` is enforced
as `anyOf`: exact with a `discriminator` (checked disjoint); otherwise give it disjoint
alternatives. The enforced keywords are listed in `schema_check`'s docstring and docs/api.md.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Literal

from llama_cpp.llama_grammar import JSON_GBNF
from pydantic import BaseModel, ConfigDict, Field

from baton_serve.replicas.engine.sampling import grammar_problem
from baton_serve.router.gateway.grammar_limits import GrammarLimits, GrammarTooLarge
from baton_serve.router.gateway.schema_check import SchemaError, prepare
from baton_serve.router.gateway.schema_converter import schema_to_gbnf

# Converter defect: its JSON string character admits raw control characters.
_LOOSE_CHAR = r'char ::= [^"\\] | '
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] | '


class SchemaNotEnforceable(ValueError):
    """A JSON Schema the grammar cannot enforce (the message names keyword and place)."""


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_object"]


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


def response_grammar(
    response_format: ResponseFormat | None, limits: GrammarLimits = GrammarLimits()
) -> str | None:
    """The GBNF grammar a reply must follow (None: free text)."""
    if response_format is None or isinstance(response_format, TextFormat):
        return None
    if isinstance(response_format, JsonObjectFormat):
        return JSON_GBNF
    return schema_grammar(response_format.json_schema.json_schema, limits=limits)


def schema_grammar(
    schema: dict[str, Any],
    prop_order: list[str] | None = None,
    limits: GrammarLimits = GrammarLimits(),
) -> str:
    """A grammar (root rule `root`) for JSON that `schema` accepts; `SchemaNotEnforceable`
    if it cannot be, or not within `limits`. `prop_order`: properties written first, in
    this order."""
    return _grammar(json.dumps(schema, sort_keys=True), tuple(prop_order or ()), limits)


@functools.lru_cache(maxsize=256)  # clients send the same schemas on every request
def _grammar(schema_json: str, prop_order: tuple[str, ...], limits: GrammarLimits) -> str:
    try:
        prepared = prepare(
            json.loads(schema_json),
            max_alternatives=limits.max_choices,
            max_chars=limits.max_chars,
        )
    except SchemaError as exc:
        raise SchemaNotEnforceable(str(exc)) from None
    try:
        grammar = schema_to_gbnf(prepared, list(prop_order), limits.max_chars)
    except GrammarTooLarge as exc:
        raise SchemaNotEnforceable(f"the schema: {exc}") from None
    except Exception as exc:  # the converter reports what it cannot read with asserts
        raise SchemaNotEnforceable(f"the schema cannot be turned into a grammar: {exc!r}") from None
    grammar = grammar.replace(_LOOSE_CHAR, _JSON_CHAR)
    if (problem := grammar_problem(grammar, max_nesting=limits.max_nesting)) is not None:
        raise SchemaNotEnforceable(f"the grammar made from the schema: {problem}")
    return grammar
