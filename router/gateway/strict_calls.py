"""A `strict` function's calls checked against its JSON Schema, in linear time.

The check is jsonschema-rs with Rust's `regex` engine for `pattern` and `patternProperties`:
no backtracking, so `^(a|aa)+$` against 40 `a`s and a `!` takes microseconds (Python's `re`,
which the `jsonschema` package uses, took minutes and froze the gateway). That engine has
no lookaround or backreferences; a strict schema that needs them, that is invalid, or that
is longer than the server's bound is refused when the request arrives (`strict_problem`),
so every call can be checked. Formats are annotations, as the `jsonschema` package left
them; references never leave the schema (no retrieval).

jsonschema-rs holds the GIL while it checks, so a slow check would stall the event loop on
any thread: what bounds it is the schema's size and the reply's length (a 55 KB schema of
1,800 patterns against 2,000 strings: 0.4 s). A reply's checks together get `timeout_s`
once they start; a call not checked by then counts as not matching its schema, as one its
schema rejects.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import jsonschema_rs

_LINEAR_PATTERNS = jsonschema_rs.RegexOptions()


def strict_problem(schema: dict[str, Any], max_chars: int) -> str | None:
    """Why calls cannot be checked against `schema`, if they cannot."""
    text = json.dumps(schema, sort_keys=True)
    if len(text) > max_chars:
        return (
            f"a strict function's parameters are {len(text)} characters of JSON; this server "
            f"checks calls against at most {max_chars} (its max_grammar_chars setting)"
        )
    try:
        _validator(text)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError) as exc:
        return f"a strict function's parameters cannot be checked: {str(exc).splitlines()[0]}"
    return None


class StrictCalls:
    """Checks the calls of one reply; after `timeout_s` from the first check, no call
    matches."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._deadline: float | None = None

    def match(self, schema: dict[str, Any], arguments: dict[str, Any]) -> bool:
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self._timeout_s
        if now > self._deadline:
            return False
        try:
            validator = _validator(json.dumps(schema, sort_keys=True))
        except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError):
            return False  # refused on arrival by `strict_problem` (this is a reader's own use)
        return validator.is_valid(arguments)


@functools.lru_cache(maxsize=256)  # clients send the same tools on every request
def _validator(schema_json: str) -> jsonschema_rs.Validator:
    return jsonschema_rs.Draft202012Validator(
        json.loads(schema_json),
        validate_formats=False,
        pattern_options=_LINEAR_PATTERNS,
        offline=True,
    )
