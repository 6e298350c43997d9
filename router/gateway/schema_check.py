"""Which JSON-schema keywords Baton enforces, and the schema rewritten for the converter.

llama-cpp-python's `json_schema_to_gbnf` picks one branch per schema node (`$ref`, `anyOf`,
a type list, `const`, `enum`, object, array, pattern, format, string length, primitive) and
silently drops every keyword that branch does not read; `schema_converter` adds branches for
what it lacks. `prepare` walks the schema the same way with an explicit allow-list per
branch: a keyword the grammar would not enforce is a `SchemaError` naming it and its JSON
pointer. Annotations are dropped. It also works around the converter's bugs (each noted
where it is handled), normalises numeric bounds (`schema_numbers`), checks `format`s
(`string_formats`; a length keyword only where the format implies it), lists the values of
`uniqueItems` arrays (items with at most `MAX_UNIQUE_VALUES` values), and checks that a
`discriminator`'s alternatives are disjoint, so that enforcing `oneOf` as `anyOf` is exact.
Each place offers at most the caller's bound of alternatives (an `enum`'s values, `anyOf` /
`oneOf` branches, a `pattern`'s `|` branches, an object's optional properties): llama.cpp's
matcher follows each at every token. The walk stops once what the grammar must hold (a
character a node, names twice, literals and patterns as written) passes the size bound.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from baton_serve.router.gateway.schema_error import SchemaError, pointer
from baton_serve.router.gateway.schema_numbers import BOUNDS, integer_node, number_node
from baton_serve.router.gateway.schema_pattern import (
    MAX_REPEAT,
    PatternError,
    is_safe_char,
    rewrite_pattern,
)
from baton_serve.router.gateway.string_formats import ANY_STRING, FORMATS

ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "examples",
        "default",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
TYPES = ("string", "number", "integer", "boolean", "null", "array", "object")
MAX_DEPTH = 64
MAX_UNIQUE_VALUES = 16  # uniqueItems: the item's possible values, in canonical order
_RULE_CHARS = re.compile(r"[^a-zA-Z0-9-]+")  # the converter's rule-name escaping


def prepare(schema: Any, *, max_alternatives: int, max_chars: int) -> dict[str, Any]:
    """`schema` as the converter should see it; `SchemaError` for what it cannot enforce,
    for more than `max_alternatives` alternatives in one place, or for a grammar sure to be
    longer than `max_chars`."""
    if not isinstance(schema, dict):
        raise SchemaError("schema", "", "the schema must be a JSON object")
    return _Walker(schema, max_alternatives, max_chars).root()


def _has_type(value: Any, kind: str) -> bool:
    checks = {
        "string": isinstance(value, str),
        "boolean": isinstance(value, bool),
        "null": value is None,
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "integer": isinstance(value, int)
        and not isinstance(value, bool)
        or isinstance(value, float)
        and value.is_integer(),
    }
    return checks[kind]


def _safe_literal(value: Any) -> bool:
    """A value the converter writes as a correct GBNF literal (it escapes only `"` and
    newlines of the JSON text, so strings with `"`, `\\` or control characters break)."""
    if isinstance(value, str):
        return all(is_safe_char(c) for c in value)
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(map(_safe_literal, value))
    if isinstance(value, dict):
        return all(_safe_literal(k) and _safe_literal(v) for k, v in value.items())
    return True


class _Walker:
    def __init__(self, schema: dict[str, Any], max_alternatives: int, max_chars: int) -> None:
        self.schema = schema
        self.max_alternatives = max_alternatives
        self.max_chars = max_chars
        self.least_chars = 0  # of the grammar, from what has been walked
        defs: dict[str, Any] = {}
        for key in ("$defs", "definitions"):
            found = schema.get(key, {})
            if not isinstance(found, dict):
                raise SchemaError(key, pointer("", key), "must be an object of schemas")
            defs.update({f"#/{key}/{name}": (key, name, sub) for name, sub in found.items()})
        self.defs = defs
        # Converter bug: it resolves a `$ref` to any existing rule with the definition's name
        # (a property's, a primitive's), so definitions get names no property rule starts with.
        prefix = "ref"
        while any(name.startswith(prefix) for name in self._property_rule_names(schema)):
            prefix += "x"
        self.names = {ref: f"{prefix}-{i}" for i, ref in enumerate(defs)}

    @staticmethod
    def _property_rule_names(schema: Any) -> set[str]:
        """Every property name, as the converter escapes it into a rule name."""
        names: set[str] = set()
        pending = [schema]
        while pending:
            node = pending.pop()
            if isinstance(node, dict):
                if isinstance(node.get("properties"), dict):
                    names.update(_RULE_CHARS.sub("-", str(k)) for k in node["properties"])
                pending.extend(node.values())
            elif isinstance(node, list):
                pending.extend(node)
        return names

    def root(self) -> dict[str, Any]:
        out = self.visit(self.schema, "", 0, is_root=True)
        if self.defs:
            out["$defs"] = {
                self.names[ref]: self.visit(sub, pointer(pointer("", key), name), 1)
                for ref, (key, name, sub) in self.defs.items()
            }
            # Converter bug: a root `$ref` stops it resolving the `$ref`s inside `$defs`.
            if "$ref" in out:
                out = {"$defs": out["$defs"], "anyOf": [{"$ref": out["$ref"]}]}
        return out

    def visit(self, node: Any, path: str, depth: int, is_root: bool = False) -> dict[str, Any]:
        """The node's converter branch, checked keyword by keyword, as a new dict."""
        if depth > MAX_DEPTH:
            raise SchemaError("schema", path, f"nested deeper than {MAX_DEPTH} levels")
        if not isinstance(node, dict):
            raise SchemaError("schema", path, "subschemas must be JSON objects (no booleans)")
        self._grammar_holds(1, "schema", path)
        node = {k: v for k, v in node.items() if k not in ANNOTATIONS}
        if is_root:
            node = {k: v for k, v in node.items() if k not in ("$defs", "definitions")}
        kind = node.get("type")
        names = kind if isinstance(kind, list) else [kind]
        if kind is not None and (
            not names
            or len(set(map(repr, names))) != len(names)
            or not all(n in TYPES for n in names)
        ):
            raise SchemaError("type", pointer(path, "type"), f"unknown or repeated type {kind!r}")
        allowed, out = self._branch(node, kind, path, depth)
        for key in node:
            if key not in allowed:
                raise SchemaError(key, pointer(path, key), self._why(key, node, kind))
        return out

    def _why(self, key: str, node: dict[str, Any], kind: Any) -> str:
        if key in ("$defs", "definitions"):
            return "definitions are only supported at the schema's root"
        if any(k in node for k in ("$ref", "anyOf", "oneOf")):
            return "it would be ignored beside '$ref', 'anyOf' or 'oneOf'"
        if kind is None:
            return "Baton's grammar cannot enforce it here (is a 'type' missing?)"
        return f"Baton's grammar cannot enforce it for type {kind!r}"

    def _branch(
        self, node: dict[str, Any], kind: Any, path: str, depth: int
    ) -> tuple[set[str], dict[str, Any]]:
        """The keywords the converter reads for this node, and their rewritten values."""
        sub = depth + 1
        if "$ref" in node:
            return {"$ref"}, {"$ref": self._ref(node["$ref"], pointer(path, "$ref"))}
        for key in ("anyOf", "oneOf"):  # oneOf is enforced as anyOf: see structured_output
            if key in node:
                alts = node[key]
                if not isinstance(alts, list) or not alts:
                    raise SchemaError(key, pointer(path, key), "must be a non-empty list")
                self._alternatives(len(alts), key, pointer(path, key))
                items = [
                    self.visit(a, pointer(pointer(path, key), i), sub) for i, a in enumerate(alts)
                ]
                if "discriminator" in node:
                    self._discriminator(node["discriminator"], alts, pointer(path, "discriminator"))
                return {key, "discriminator"}, {key: items}
        if "const" in node or "enum" in node:  # before a type list, which the converter would
            return self._literals(node, kind, path)  # take instead, dropping the values
        if isinstance(kind, list):
            return {"type"}, {"type": list(kind)}
        if kind in (None, "object") and (
            "properties" in node or node.get("additionalProperties", True) is not True
        ):
            return self._object(node, path, sub)
        if kind in (None, "array") and ("items" in node or "prefixItems" in node):
            return self._array(node, path, sub)
        if kind in (None, "string") and "pattern" in node:
            try:
                if not isinstance(node["pattern"], str):
                    raise PatternError("must be a string")
                self._grammar_holds(len(node["pattern"]), "pattern", pointer(path, "pattern"))
                rewritten = rewrite_pattern(node["pattern"])
            except PatternError as exc:
                raise SchemaError("pattern", pointer(path, "pattern"), str(exc)) from None
            self._alternatives(rewritten.alternatives, "pattern", pointer(path, "pattern"))
            return {"type", "pattern"}, {**node, "pattern": rewritten.pattern}
        if kind in (None, "string") and "format" in node:
            return self._format(node, path)
        if kind == "string" and ("minLength" in node or "maxLength" in node):
            lengths = self._bounds(node, "minLength", "maxLength", path)
            return {"type", "minLength", "maxLength"}, {"type": "string", **lengths}
        if kind == "integer" and any(k in node for k in BOUNDS):
            return set(BOUNDS) | {"type"}, integer_node(node, path)
        if kind == "number" and any(k in node for k in BOUNDS):
            return set(BOUNDS) | {"type"}, number_node(node, path)
        if kind == "object":
            return {"type", "additionalProperties"}, {"type": "object"}
        return ({"type"}, dict(node)) if kind else (set(), {})

    def _format(self, node: dict[str, Any], path: str) -> tuple[set[str], dict[str, Any]]:
        """A string format; length bounds only where the format already implies them."""
        name = node["format"]
        if name in ANY_STRING:  # pydantic's types for these accept any string
            lengths = self._bounds(node, "minLength", "maxLength", path)
            return {"type", "format", "minLength", "maxLength"}, {"type": "string", **lengths}
        if name not in FORMATS:
            supported = ", ".join(sorted(FORMATS.keys() | ANY_STRING))
            reason = f"format {name!r} (supported: {supported})"
            raise SchemaError("format", pointer(path, "format"), reason)
        _, shortest, longest = FORMATS[name]
        for key, fits in (("minLength", lambda n: n <= shortest), ("maxLength", longest.__le__)):
            if key in node and not (_has_type(node[key], "integer") and fits(node[key])):
                reason = f"format {name!r} writes {shortest}..{longest} characters"
                raise SchemaError(key, pointer(path, key), reason)
        return {"type", "format", "minLength", "maxLength"}, {"type": "string", "format": name}

    def _discriminator(self, spec: Any, alts: list[Any], path: str) -> None:
        """Checks each alternative requires the discriminator property with its own
        literals: then the alternatives are disjoint and `anyOf` enforces `oneOf`."""
        name = spec.get("propertyName") if isinstance(spec, dict) else None
        if not isinstance(name, str):
            raise SchemaError("discriminator", path, "needs a string 'propertyName'")
        seen: set[str] = set()
        for alt in map(self._target, alts):
            prop = self._target(alt.get("properties", {}).get(name, {}))
            values = [prop["const"]] if "const" in prop else prop.get("enum")
            if name not in alt.get("required", ()) or not isinstance(values, list):
                reason = f"every alternative must require {name!r} as a const or enum"
                raise SchemaError("discriminator", path, reason)
            keys = {json.dumps(v, sort_keys=True) for v in values}
            if keys & seen:
                raise SchemaError("discriminator", path, f"alternatives share a {name!r} value")
            seen |= keys

    def _target(self, node: Any) -> dict[str, Any]:
        """`node`, or the definition its `$ref` names (checked where it is visited)."""
        for _ in range(MAX_DEPTH):
            if not isinstance(node, dict) or node.get("$ref") not in self.defs:
                break
            node = self.defs[node["$ref"]][2]
        return node if isinstance(node, dict) else {}

    def _unique_values(self, items: Any, path: str) -> list[Any]:
        """The values an item of a `uniqueItems` array can take (few, or refused)."""
        node = self._target(items)
        kind = node.get("type")
        values: Any = None
        if "const" in node or "enum" in node:
            values = [node["const"]] if "const" in node else node["enum"]
        elif kind == "boolean":
            values = [False, True]
        elif kind == "null":
            values = [None]
        elif kind == "integer" and any(k in node for k in BOUNDS):
            bounded = integer_node(node, pointer(path, "items"))
            low, high = bounded.get("minimum"), bounded.get("maximum")
            if "enum" in bounded:
                values = bounded["enum"]
            elif low is not None and high is not None and high - low < MAX_UNIQUE_VALUES:
                values = list(range(low, high + 1))
        if not isinstance(values, list):
            values = []
        values = list({json.dumps(v, sort_keys=True): v for v in values}.values())
        if not 0 < len(values) <= MAX_UNIQUE_VALUES:
            reason = (
                f"enforced only for items with 1..{MAX_UNIQUE_VALUES} possible values "
                "(an enum, const, boolean or small integer range)"
            )
            raise SchemaError("uniqueItems", pointer(path, "uniqueItems"), reason)
        return values

    def _grammar_holds(self, chars: int, keyword: str, path: str) -> None:
        """The grammar will hold at least `chars` more characters for `keyword`."""
        self.least_chars += chars
        if self.least_chars > self.max_chars:
            reason = (
                f"the grammar made from the schema would be longer than {self.max_chars} "
                "characters (this server's max_grammar_chars setting)"
            )
            raise SchemaError(keyword, path, reason)

    def _alternatives(self, count: int, keyword: str, path: str) -> None:
        if count > self.max_alternatives:
            reason = (
                f"{count} alternatives; this server takes at most {self.max_alternatives} "
                "in one place of a grammar (its max_grammar_choices setting)"
            )
            raise SchemaError(keyword, path, reason)

    def _ref(self, ref: Any, path: str) -> str:
        if ref not in self.defs:
            reason = "only '#/$defs/NAME' and '#/definitions/NAME' at the root are supported"
            raise SchemaError("$ref", path, f"{ref!r}: {reason}")
        return f"#/$defs/{self.names[ref]}"

    def _literals(
        self, node: dict[str, Any], kind: Any, path: str
    ) -> tuple[set[str], dict[str, Any]]:
        key = "const" if "const" in node else "enum"
        values = [node["const"]] if key == "const" else node["enum"]
        where = pointer(path, key)
        if not isinstance(values, list) or not values:
            raise SchemaError(key, where, "must be a non-empty list")
        self._alternatives(len(values), key, where)
        self._grammar_holds(sum(len(json.dumps(v)) for v in values), key, where)
        if not all(map(_safe_literal, values)):
            reason = "strings with '\"', '\\', control characters or characters past U+FFFF"
            raise SchemaError(key, where, reason)
        kinds = kind if isinstance(kind, list) else [kind] if kind else list(TYPES)
        if not all(any(_has_type(v, k) for k in kinds) for v in values):
            raise SchemaError(key, where, f"a value is not of type {kind!r}")
        return {key, "type"}, {key: node[key]}

    def _object(self, node: dict[str, Any], path: str, sub: int) -> tuple[set[str], dict]:
        props = node.get("properties", {})
        required = node.get("required", [])
        extra = node.get("additionalProperties")
        if not isinstance(props, dict):
            raise SchemaError("properties", pointer(path, "properties"), "must be an object")
        for name in props:
            if not _safe_literal(name):
                reason = f"property name {name!r} has '\"', '\\' or control characters"
                raise SchemaError("properties", pointer(path, "properties"), reason)
            self._grammar_holds(2 * len(name), "properties", pointer(path, "properties"))
        if not isinstance(required, list) or not all(r in props for r in required):
            reason = "must list properties defined in 'properties' (others are never generated)"
            raise SchemaError("required", pointer(path, "required"), reason)
        # Any optional property may come first: each is an alternative after the `{`.
        optional = len(props) - len(set(required))
        self._alternatives(optional, "properties", pointer(path, "properties"))
        out: dict[str, Any] = {
            "type": "object",
            "properties": {
                name: self.visit(s, pointer(pointer(path, "properties"), name), sub)
                for name, s in props.items()
            },
        }
        if required:
            out["required"] = list(dict.fromkeys(required))
        if extra is not None and extra is not False:
            value = (
                True
                if extra is True
                else self.visit(extra, pointer(path, "additionalProperties"), sub)
            )
            # Converter bug: it writes no ',' between an optional property and the extra ones,
            # so beside optional properties none are generated (a narrowing: still valid).
            if set(props) <= set(required):
                out["additionalProperties"] = value
        return {"type", "properties", "required", "additionalProperties"}, out

    def _array(self, node: dict[str, Any], path: str, sub: int) -> tuple[set[str], dict]:
        items = node.get("items")
        if "prefixItems" in node:
            prefix = node["prefixItems"]
            if not isinstance(prefix, list) or items not in (None, False):
                reason = "a list, with 'items' absent or false (exactly these items are generated)"
                raise SchemaError("prefixItems", pointer(path, "prefixItems"), reason)
            where = pointer(path, "prefixItems")
            tuple_items = [self.visit(s, pointer(where, i), sub) for i, s in enumerate(prefix)]
            lengths = self._bounds(node, "minItems", "maxItems", path)
            if (
                not lengths.get("minItems", 0)
                <= len(prefix)
                <= lengths.get("maxItems", len(prefix))
            ):
                reason = f"exactly the {len(prefix)} 'prefixItems' are generated"
                raise SchemaError("minItems", pointer(path, "minItems"), reason)
            allowed = {"type", "prefixItems", "items", "minItems", "maxItems"}
            return allowed, {"type": "array", "prefixItems": tuple_items}
        if not isinstance(items, dict) or not items:
            reason = "must be a non-empty schema (leave it out for an array of any values)"
            raise SchemaError("items", pointer(path, "items"), reason)
        out: dict[str, Any] = self._bounds(node, "minItems", "maxItems", path)
        out.update(type="array", items=self.visit(items, pointer(path, "items"), sub))
        if node.get("uniqueItems", False) is not False:
            values = self._unique_values(items, path)
            if node["uniqueItems"] is not True or out.get("minItems", 0) > len(values):
                reason = f"must be true, with 'minItems' at most the {len(values)} values"
                raise SchemaError("uniqueItems", pointer(path, "uniqueItems"), reason)
            out.update(uniqueItems=True, items={"enum": values})
        return {"type", "items", "minItems", "maxItems", "uniqueItems"}, out

    def _bounds(self, node: dict[str, Any], low: str, high: str, path: str) -> dict[str, int]:
        """The length bounds, as integers (large ones overflow llama.cpp's grammar parser)."""
        for key in (low, high):
            value = node.get(key, 0)
            if not _has_type(value, "integer") or not 0 <= value <= MAX_REPEAT:
                raise SchemaError(key, pointer(path, key), f"must be an integer 0..{MAX_REPEAT}")
        if high in node and node.get(low, 0) > node[high]:
            raise SchemaError(low, pointer(path, low), f"is greater than '{high}'")
        return {key: int(node[key]) for key in (low, high) if key in node}
