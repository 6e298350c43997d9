"""The bounds on the grammars a request gives its reply (defaults here; `BatonConfig`'s
fields give their reasons).

A raw `grammar` and every grammar the gateway builds from client input (`guided_choice`,
the JSON schemas of `response_format`, `guided_json` and `json_schema`, a forced tool call)
is at most `max_chars` long and nests its groups at most `max_nesting` deep; one place of a
grammar offers at most `max_choices` alternatives (`guided_choice`'s strings, an `enum`'s
values, an `anyOf`'s or a pattern's branches), counted before anything is built. Building
runs off the event loop, and a request waits for it at most `timeout_s` (`reply_grammar`);
so do the checks of a reply's strict tool calls (`strict_calls`).
"""

from __future__ import annotations

from dataclasses import dataclass

from baton_serve.replicas.engine.grammar_nesting import DEFAULT_MAX_GRAMMAR_NESTING

MAX_GRAMMAR_CHARS = 64 << 10
MAX_GRAMMAR_CHOICES = 256
SCHEMA_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class GrammarLimits:
    max_chars: int = MAX_GRAMMAR_CHARS
    max_nesting: int = DEFAULT_MAX_GRAMMAR_NESTING
    max_choices: int = MAX_GRAMMAR_CHOICES
    timeout_s: float = SCHEMA_TIMEOUT_S


class GrammarTooLarge(ValueError):
    """A grammar, or the one a field would build, over `max_chars` characters."""

    def __init__(self, size: int, limit: int, *, at_least: bool = False) -> None:
        has = f"at least {size}" if at_least else str(size)
        super().__init__(
            f"the grammar is {has} characters; this server takes at most {limit} "
            "(its max_grammar_chars setting)"
        )
