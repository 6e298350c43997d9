"""Which JSON-schema keywords Baton enforces, and the schema rewritten for the converter.

llama-cpp-python's `json_schema_to_gbnf` picks one branch per schema node (`$ref`, `anyOf`,
a type list, `const`, `enum`, object, array, pattern, format, string length, primitive) and
silently drops every keyword that branch does not read. `prepare` walks the schema the same
way with an explicit allow-list per branch: a keyword the grammar would not enforce is a
`SchemaError` naming it and its JSON pointer. Annotations are dropped. It also works around
the converter's bugs (each noted where it is handled) and rewrites bounded integers
(`minimum`/`maximum`/`exclusive*`/`multipleOf`, at most `MAX_INTEGER_CHOICES` values) into
an `enum`, which the converter does enforce.
"""

from __future__ import annotations

import math
import re
from typing import Any

from baton_serve.router.schema_pattern import (
    MAX_REPEAT,
    PatternError,
    is_safe_char,
    rewrite_pattern,
)

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
        "discriminator",
    }
)
TYPES = ("string", "number", "integer", "boolean", "null", "array", "object")
FORMATS = frozenset(
    {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
)
MAX_INTEGER_CHOICES = 256
MAX_DEPTH = 64
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_RULE_CHARS = re.compile(r"[^a-zA-Z0-9-]+")  # the converter's rule-name escaping


class SchemaError(ValueError):
    """A schema Baton cannot enforce: `keyword` at JSON pointer `path`."""

    def __init__(self, keyword: str, path: str, reason: str) -> None:
        self.keyword, self.path = keyword, path
        super().__init__(
            f"JSON schema keyword '{keyword}' at '{path or '/'}' is not supported: {reason}"
        )


def prepare(schema: Any) -> dict[str, Any]:
    """`schema` as the converter should see it; `SchemaError` for what it cannot enforce."""
    if not isinstance(schema, dict):
        raise SchemaError("schema", "", "the schema must be a JSON object")
    return _Walker(schema).root()


def _pointer(path: str, key: str | int) -> str:
    return f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"


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
    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        defs: dict[str, Any] = {}
        for key in ("$defs", "definitions"):
            found = schema.get(key, {})
            if not isinstance(found, dict):
                raise SchemaError(key, _pointer("", key), "must be an object of schemas")
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
                self.names[ref]: self.visit(sub, _pointer(_pointer("", key), name), 1)
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
            raise SchemaError("type", _pointer(path, "type"), f"unknown or repeated type {kind!r}")
        allowed, out = self._branch(node, kind, path, depth)
        for key in node:
            if key not in allowed:
                raise SchemaError(key, _pointer(path, key), self._why(key, node, kind))
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
            return {"$ref"}, {"$ref": self._ref(node["$ref"], _pointer(path, "$ref"))}
        for key in ("anyOf", "oneOf"):  # oneOf is enforced as anyOf: see structured_output
            if key in node:
                alts = node[key]
                if not isinstance(alts, list) or not alts:
                    raise SchemaError(key, _pointer(path, key), "must be a non-empty list")
                items = [
                    self.visit(a, _pointer(_pointer(path, key), i), sub) for i, a in enumerate(alts)
                ]
                return {key}, {key: items}
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
                return {"type", "pattern"}, {**node, "pattern": rewrite_pattern(node["pattern"])}
            except PatternError as exc:
                raise SchemaError("pattern", _pointer(path, "pattern"), str(exc)) from None
        if kind in (None, "string") and "format" in node:
            if node["format"] not in FORMATS:
                supported = ", ".join(sorted(FORMATS))
                reason = f"format {node['format']!r} (supported: {supported})"
                raise SchemaError("format", _pointer(path, "format"), reason)
            return {"type", "format"}, dict(node)
        if kind == "string" and ("minLength" in node or "maxLength" in node):
            lengths = self._bounds(node, "minLength", "maxLength", path)
            return {"type", "minLength", "maxLength"}, {"type": "string", **lengths}
        if kind == "integer" and any(k in node for k in _BOUNDS):
            return set(_BOUNDS) | {"type"}, {"enum": self._integers(node, path)}
        if kind == "object":
            return {"type", "additionalProperties"}, {"type": "object"}
        return ({"type"}, dict(node)) if kind else (set(), {})

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
        where = _pointer(path, key)
        if not isinstance(values, list) or not values:
            raise SchemaError(key, where, "must be a non-empty list")
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
            raise SchemaError("properties", _pointer(path, "properties"), "must be an object")
        for name in props:
            if not _safe_literal(name):
                reason = f"property name {name!r} has '\"', '\\' or control characters"
                raise SchemaError("properties", _pointer(path, "properties"), reason)
        if not isinstance(required, list) or not all(r in props for r in required):
            reason = "must list properties defined in 'properties' (others are never generated)"
            raise SchemaError("required", _pointer(path, "required"), reason)
        out: dict[str, Any] = {
            "type": "object",
            "properties": {
                name: self.visit(s, _pointer(_pointer(path, "properties"), name), sub)
                for name, s in props.items()
            },
        }
        if required:
            out["required"] = list(dict.fromkeys(required))
        if extra is not None and extra is not False:
            value = (
                True
                if extra is True
                else self.visit(extra, _pointer(path, "additionalProperties"), sub)
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
                raise SchemaError("prefixItems", _pointer(path, "prefixItems"), reason)
            where = _pointer(path, "prefixItems")
            tuple_items = [self.visit(s, _pointer(where, i), sub) for i, s in enumerate(prefix)]
            return {"type", "prefixItems", "items"}, {"type": "array", "prefixItems": tuple_items}
        if not isinstance(items, dict) or not items:
            reason = "must be a non-empty schema (leave it out for an array of any values)"
            raise SchemaError("items", _pointer(path, "items"), reason)
        out = self._bounds(node, "minItems", "maxItems", path)
        out.update(type="array", items=self.visit(items, _pointer(path, "items"), sub))
        return {"type", "items", "minItems", "maxItems"}, out

    def _bounds(self, node: dict[str, Any], low: str, high: str, path: str) -> dict[str, int]:
        """The length bounds, as integers (large ones overflow llama.cpp's grammar parser)."""
        for key in (low, high):
            value = node.get(key, 0)
            if not _has_type(value, "integer") or not 0 <= value <= MAX_REPEAT:
                raise SchemaError(key, _pointer(path, key), f"must be an integer 0..{MAX_REPEAT}")
        if high in node and node.get(low, 0) > node[high]:
            raise SchemaError(low, _pointer(path, low), f"is greater than '{high}'")
        return {key: int(node[key]) for key in (low, high) if key in node}

    def _integers(self, node: dict[str, Any], path: str) -> list[int]:
        """The integers a bounded integer schema allows (the converter ignores bounds)."""
        for key in _BOUNDS:
            if key in node and not _has_type(node[key], "number"):
                raise SchemaError(key, _pointer(path, key), "must be a number")
        lows = [math.ceil(node["minimum"])] if "minimum" in node else []
        lows += [math.floor(node["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in node else []
        highs = [math.floor(node["maximum"])] if "maximum" in node else []
        highs += [math.ceil(node["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in node else []
        step = node.get("multipleOf", 1)
        if not lows or not highs:
            key = next(k for k in _BOUNDS if k in node)
            reason = "an integer needs both a lower and an upper bound"
            raise SchemaError(key, _pointer(path, key), reason)
        if not _has_type(step, "integer") or step < 1:
            raise SchemaError("multipleOf", _pointer(path, "multipleOf"), "must be an integer >= 1")
        low, high, step = max(lows), min(highs), int(step)
        first = -(-low // step) * step
        count = (high - first) // step + 1 if high >= first else 0
        if not 0 < count <= MAX_INTEGER_CHOICES:
            key = "minimum" if "minimum" in node else next(k for k in _BOUNDS if k in node)
            reason = f"the bounds allow {count} integers (1..{MAX_INTEGER_CHOICES} are supported)"
            raise SchemaError(key, _pointer(path, key), reason)
        return list(range(first, high + 1, step))
