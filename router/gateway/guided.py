"""vLLM's and llama-server's request extensions that shape the reply, as llama.cpp sees them:
`guided_json`, `guided_choice`, `json_schema` and `grammar` as grammars, and the chat
template variables vLLM fills from request fields (`reasoning_effort`, `documents`)."""

from __future__ import annotations

from typing import Any

from baton_serve.replicas.engine.grammar_nesting import GrammarTooDeep, check_grammar_nesting
from baton_serve.router.gateway import openai_types as api
from baton_serve.router.gateway.errors import invalid_request
from baton_serve.router.gateway.grammar_cost import GrammarCostly, check_grammar_cost
from baton_serve.router.gateway.grammar_limits import GrammarLimits, GrammarTooLarge
from baton_serve.router.gateway.structured_output import SchemaNotEnforceable, schema_grammar

_CHOICE_CHARS = len(' | ""')  # what each choice adds to its grammar besides its text


def guided_field(body: api.ChatCompletionRequest | api.CompletionRequest) -> str | None:
    """The field that gives the reply a grammar (at most one is sent), if any."""
    return next((name for name in api.GUIDES if getattr(body, name) is not None), None)


def guided_grammar(
    body: api.ChatCompletionRequest | api.CompletionRequest,
    limits: GrammarLimits = GrammarLimits(),
) -> str | None:
    """The grammar `guided_json`, `guided_choice` or llama-server's `json_schema` or
    `grammar` ask for (None: none was sent), within `limits`. A raw grammar is parsed by
    the engine, which refuses one llama.cpp cannot parse, and first checked here for what
    makes llama.cpp's matcher slow (`grammar_cost`)."""
    if body.grammar is not None:
        return _raw_grammar(body.grammar, limits)
    if body.guided_choice is not None:
        return _choice_grammar(body.guided_choice, limits)
    schema, param = (
        (body.guided_json, "guided_json")
        if body.guided_json is not None
        else (body.json_schema, "json_schema")
    )
    if schema is None:
        return None
    try:
        return schema_grammar(schema, limits=limits)
    except SchemaNotEnforceable as exc:
        raise invalid_request(str(exc), param=param) from None


def check_grammar(grammar: str, param: str, limits: GrammarLimits) -> str:
    """`grammar`, the one field `param` gives the reply, if it is text within `limits`."""
    try:
        if len(grammar) > limits.max_chars:
            raise GrammarTooLarge(len(grammar), limits.max_chars)
        check_grammar_nesting(grammar, limits.max_nesting)
        grammar.encode()
    except (GrammarTooLarge, GrammarTooDeep) as exc:
        raise invalid_request(f"{param}: {exc}.", param=param) from None
    except UnicodeEncodeError:
        raise invalid_request(f"{param}: a lone surrogate is not text", param=param) from None
    return grammar


def _raw_grammar(grammar: str, limits: GrammarLimits) -> str:
    """A client's own grammar, within `limits` and not slow for llama.cpp to apply."""
    check_grammar(grammar, "grammar", limits)
    try:
        check_grammar_cost(grammar, limits.max_choices)
    except GrammarCostly as exc:
        raise invalid_request(f"grammar: {exc}.", param="grammar") from None
    return grammar


def _choice_grammar(choices: list[str], limits: GrammarLimits) -> str:
    """`root ::= "a" | "b" | …`, its size bounded before it is written."""
    if len(choices) > limits.max_choices:
        raise invalid_request(
            f"guided_choice: {len(choices)} choices; this server takes at most "
            f"{limits.max_choices} (its max_grammar_choices setting).",
            param="guided_choice",
        )
    least = sum(len(choice) + _CHOICE_CHARS for choice in choices)
    if least > limits.max_chars:
        error = GrammarTooLarge(least, limits.max_chars, at_least=True)
        raise invalid_request(f"guided_choice: {error}.", param="guided_choice")
    grammar = "root ::= " + " | ".join(_literal(choice) for choice in choices)
    return check_grammar(grammar, "guided_choice", limits)


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
