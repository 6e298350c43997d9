"""vLLM's and llama-server's request extensions that shape the reply, as llama.cpp sees them:
`guided_json`, `guided_choice`, `json_schema` and `grammar` as grammars, and the chat
template variables vLLM fills from request fields (`reasoning_effort`, `documents`)."""

from __future__ import annotations

from typing import Any

from baton_serve.router.gateway import openai_types as api
from baton_serve.router.gateway.errors import invalid_request
from baton_serve.router.gateway.structured_output import SchemaNotEnforceable, schema_grammar


def guided_grammar(body: api.ChatCompletionRequest | api.CompletionRequest) -> str | None:
    """The grammar `guided_json`, `guided_choice` or llama-server's `json_schema` or
    `grammar` ask for (None: none was sent). A raw grammar is parsed by the engine, which
    refuses one llama.cpp cannot parse."""
    if body.grammar is not None:
        return body.grammar
    if body.guided_choice is not None:
        if any(_has_surrogate(choice) for choice in body.guided_choice):
            raise invalid_request(
                "guided_choice: a lone surrogate is not text", param="guided_choice"
            )
        return "root ::= " + " | ".join(_literal(choice) for choice in body.guided_choice)
    schema, param = (
        (body.guided_json, "guided_json")
        if body.guided_json is not None
        else (body.json_schema, "json_schema")
    )
    if schema is None:
        return None
    try:
        return schema_grammar(schema)
    except SchemaNotEnforceable as exc:
        raise invalid_request(str(exc), param=param) from None


def _has_surrogate(text: str) -> bool:
    return any("\ud800" <= c <= "\udfff" for c in text)


def _literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    escaped = (
        f"\\{c}" if c in '"\\' else f"\\x{ord(c):02X}" if ord(c) < 0x20 or c == "\x7f" else c
        for c in text
    )
    return '"' + "".join(escaped) + '"'


def template_variables(body: api.ChatCompletionRequest, extras: dict[str, Any]) -> dict[str, Any]:
    """`extras` plus what vLLM passes its chat templates from the request: `documents`,
    `reasoning_effort`, and `enable_thinking` (effort not "none") unless the client's
    `chat_template_kwargs` set it."""
    variables = dict(extras)
    if body.documents is not None:
        variables["documents"] = body.documents
    if body.reasoning_effort is not None:
        variables["reasoning_effort"] = body.reasoning_effort
        variables.setdefault("enable_thinking", body.reasoning_effort != "none")
    return variables
