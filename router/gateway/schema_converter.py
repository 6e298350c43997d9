"""llama-cpp-python's JSON-schema → GBNF converter, with the keywords it lacks.

`schema_check.prepare` hands this converter a checked schema in which these nodes carry
keywords the base converter would drop; they get their own rules here, everything else is
the base converter's:

- integers with `minimum`/`maximum` (inclusive integers, either side) and numbers with
  `minimum`/`maximum`/`exclusiveMinimum`/`exclusiveMaximum`: `number_ranges`;
- strings with a `format` from `string_formats.FORMATS`;
- arrays with `uniqueItems` over an `enum` of values: the values in the enum's order, each
  at most once (a narrowing: every such array is unique), within `minItems`/`maxItems`.

The grammar is counted as its rules are added: building stops (`GrammarTooLarge`) once it
is longer than the caller's bound, so no schema makes the converter write much more.
"""

from __future__ import annotations

from typing import Any

from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

from baton_serve.router.gateway.grammar_limits import GrammarTooLarge
from baton_serve.router.gateway.number_ranges import Bound, decimal, integer_range, number_range
from baton_serve.router.gateway.string_formats import FORMATS


def schema_to_gbnf(schema: dict[str, Any], prop_order: list[str], max_chars: int) -> str:
    """The grammar (root rule `root`) for a schema `prepare` returned; `GrammarTooLarge`
    once it is longer than `max_chars`."""
    converter = _Converter({name: i for i, name in enumerate(prop_order)}, max_chars)
    converter.visit(converter.resolve_refs(schema, "stdin"), "")
    return converter.format_grammar()


class _Converter(SchemaConverter):
    def __init__(self, prop_order: dict[str, int], max_chars: int) -> None:
        self._max_chars = max_chars
        self._chars = 0  # written so far: each rule as `name ::= rule` and a newline
        super().__init__(prop_order=prop_order, allow_fetch=False, dotall=False, raw_pattern=False)

    def _add_rule(self, name: str, rule: str) -> str:
        known = len(self._rules)
        key = super()._add_rule(name, rule)
        if len(self._rules) > known:  # a new rule (a name already added keeps its rule)
            self._chars += len(key) + len(rule) + 6
            if self._chars > self._max_chars:
                raise GrammarTooLarge(self._chars, self._max_chars, at_least=True)
        return key

    def visit(self, schema: dict[str, Any], name: str) -> str:
        body = self._own_rule(schema, name)
        if body is None:
            return super().visit(schema, name)
        return self._add_rule(name + "-" if name in RESERVED_NAMES else name or "root", body)

    def _own_rule(self, schema: dict[str, Any], name: str) -> str | None:
        kind = schema.get("type")
        if kind == "integer" and ("minimum" in schema or "maximum" in schema):
            return f"({integer_range(schema.get('minimum'), schema.get('maximum'))}) space"
        if kind == "number" and len(schema) > 1:
            return f"({number_range(_bound(schema, 'minimum'), _bound(schema, 'maximum'))}) space"
        if kind == "string" and "format" in schema:
            body = self._add_rule(f"format-{schema['format']}", FORMATS[schema["format"]][0])
            return f'"\\"" {body} "\\"" space'
        if kind == "array" and schema.get("uniqueItems"):
            return self._unique_items(schema, name)
        return None

    def _unique_items(self, schema: dict[str, Any], name: str) -> str:
        """Arrays of distinct enum values, in the enum's order: after value i as the c-th
        item come a later value, or the end once c >= minItems (counts are tracked only
        when `minItems` > 1 or `maxItems` is below the number of values)."""
        values = [self._generate_constant_rule(v) for v in schema["items"]["enum"]]
        count = len(values)
        low = schema.get("minItems", 0)
        high = min(schema.get("maxItems", count), count)
        counted = low > 1 or high < count
        tails: dict[tuple[int, int], str] = {}  # (i, c) -> what may follow: a rule or ""
        for c in range(high, 0, -1) if counted else (0,):
            for i in range(count - 1, -1, -1):
                if counted and c < low and count - 1 - i < low - c:
                    continue  # too few values left to reach minItems
                step = c + 1 if counted else 0
                nexts = [
                    f'"," space {values[j]} {tails[j, step]}'.rstrip()
                    for j in range(i + 1, count)
                    if (j, step) in tails
                ]
                ends = not counted or c >= low
                rule = " | ".join(nexts)
                if nexts and ends:
                    rule = f"({rule})?"
                tails[i, c] = (
                    self._add_rule(f"{name or 'root'}-unique-{i}-{c}", rule) if rule else ""
                )
        first = 1 if counted else 0
        firsts = [
            f"{values[i]} {tails[i, first]}".rstrip() for i in range(count) if (i, first) in tails
        ]
        body = f"({' | '.join(firsts)})" + ("?" if low == 0 else "")
        return f'"[" space {body} "]" space'


def _bound(schema: dict[str, Any], side: str) -> Bound | None:
    exclusive = "exclusive" + side[0].upper() + side[1:]
    if side in schema:
        return Bound(decimal(schema[side]))
    if exclusive in schema:
        return Bound(decimal(schema[exclusive]), exclusive=True)
    return None
