"""Structured output: OpenAI's `response_format`, enforced by a llama.cpp grammar.

`json_object` uses llama-cpp-python's JSON grammar (rooted at an object); `json_schema` uses
its JSON-Schema-to-GBNF converter. That converter enforces only some keywords and silently
skips the rest, so a schema is first walked against the list of what it enforces: a schema
using anything else (`minimum`, `uniqueItems`, `format: email`, …) is refused with a 400
naming the keyword and where it is, instead of producing replies that break it.

Objects get only the properties they declare unless `additionalProperties` allows more
(with or without `strict`: that is the converter's reading, and OpenAI's strict mode).
`oneOf` is enforced as `anyOf` (branches that overlap could match twice).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf
from pydantic import BaseModel, ConfigDict, Field

ANNOTATIONS = frozenset(
    {"title", "description", "examples", "default", "$schema", "$id", "$comment", "deprecated",
     "readOnly", "writeOnly"}
)  # fmt: skip
ENFORCED = frozenset(
    {"type", "properties", "required", "additionalProperties", "items", "prefixItems",
     "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs",
     "definitions", "pattern", "format", "minLength", "maxLength"}
)  # fmt: skip
FORMATS = frozenset(
    {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
)
TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
SCHEMA_MAPS = ("properties", "$defs", "definitions")  # keywords whose values map names → schemas
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


class SchemaNotEnforceable(ValueError):
    """A JSON Schema uses something the grammar cannot enforce."""


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


def response_grammar(response_format: ResponseFormat | None) -> str | None:
    """The GBNF grammar a reply must follow (None: free text)."""
    if response_format is None or isinstance(response_format, TextFormat):
        return None
    if isinstance(response_format, JsonObjectFormat):
        return JSON_GBNF
    return schema_grammar(response_format.json_schema.json_schema)


def schema_grammar(schema: dict[str, Any], prop_order: list[str] | None = None) -> str:
    """A grammar for JSON that `schema` accepts; `SchemaNotEnforceable` if it cannot be.
    `prop_order`: properties written first, in this order (others follow as declared)."""
    for path, keyword, problem in _problems(schema, "$"):
        raise SchemaNotEnforceable(f"{keyword} at {path}: {problem}")
    try:
        grammar = json_schema_to_gbnf(json.dumps(schema), prop_order=prop_order)
    except Exception as exc:  # the converter reports bad input with asserts and KeyErrors
        raise SchemaNotEnforceable(f"the schema cannot be turned into a grammar: {exc!r}") from None
    # The converter lets a string hold raw control characters, which JSON forbids.
    return grammar.replace(_LOOSE_CHAR, _JSON_CHAR)


_LOOSE_CHAR = r'char ::= [^"\\]'
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F]'


def _problems(schema: Any, path: str) -> Iterator[tuple[str, str, str]]:
    """(path, keyword, why) for each part of `schema` the grammar would not enforce."""
    if isinstance(schema, bool):
        if schema is False:
            yield path, "false", "a schema that accepts nothing cannot be generated"
        return
    if not isinstance(schema, dict):
        yield path, "schema", "must be an object"
        return
    constraints = set(schema) - ANNOTATIONS - {"$defs", "definitions"}
    for combined in ("anyOf", "oneOf", "$ref"):
        if combined in schema and constraints - {combined}:
            others = ", ".join(sorted(constraints - {combined}))
            yield (
                path,
                combined,
                f"its sibling keywords ({others}) would be ignored; move them inside",
            )
    if isinstance(schema.get("type"), list) and constraints - {"type", "enum", "const"}:
        yield path, "type", "a list of types ignores the other keywords; use anyOf"
    for keyword, value in schema.items():
        where = f"{path}.{keyword}"
        if keyword in ANNOTATIONS:
            continue
        if keyword not in ENFORCED:
            yield path, keyword, "not enforced by Baton's grammar (remove it or use another)"
        elif keyword == "format" and value not in FORMATS:
            yield path, f"format: {value}", f"only {', '.join(sorted(FORMATS))} are enforced"
        elif keyword == "type":
            kinds = value if isinstance(value, list) else [value]
            if not kinds or any(kind not in TYPES for kind in kinds):
                yield path, "type", f"must be one of {', '.join(sorted(TYPES))}"
        elif keyword == "pattern" and (problem := pattern_problem(value)):
            yield path, "pattern", problem
        elif keyword == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            yield path, "$ref", "only references inside the schema (#/…) are resolved"
        elif keyword in SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from _problems(sub, f"{where}.{name}")
        elif keyword in SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from _problems(sub, f"{where}[{i}]")
        elif keyword in ("items", "additionalProperties") and not isinstance(value, bool):
            yield from _problems(value, where)
    if "allOf" in schema and not all(
        isinstance(part, dict) and ("properties" in part or "$ref" in part)
        for part in schema["allOf"]
    ):
        yield path, "allOf", "only objects (with properties or a $ref) can be combined"


# Regular expressions the converter turns into exact grammars: anchored, made of literal
# letters, digits and plain punctuation, positive character classes, groups, alternation and
# quantifiers. (It writes `\w` as the two characters `\w`, and lets `.` and negated classes
# match a quote or a control character, which would break the JSON string.)
_LITERAL = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-:/,@#=+!%&~<>;'")
_SYNTAX = set("()|?*+{}")


def pattern_problem(pattern: object) -> str | None:
    """Why a `pattern` cannot be enforced exactly, if it cannot."""
    if not (isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$")):
        return "must be anchored with ^ and $ to be enforced"
    body, in_class = pattern[1:-1], False
    for i, char in enumerate(body):
        if in_class:
            if char == "]":
                in_class = False
            elif char == "^" and body[i - 1] == "[":
                return "negated character classes are not enforced exactly"
            elif char not in _LITERAL | {"."}:
                return f"{char!r} inside a character class is not enforced exactly"
        elif char == "[":
            in_class = True
        elif char not in _LITERAL | _SYNTAX:
            return f"{char!r} (escapes, '.', anchors inside) is not enforced exactly"
    return "an unclosed character class" if in_class else None
