"""JSON Schemas for structured-output tests: what Baton's grammar enforces, and what it
refuses. A generated model samples at random, so every string in the generation corpus is
bounded (maxLength, enum, pattern or format) and so is every array: an unbounded string from
random weights rarely closes its quote."""

from __future__ import annotations

from typing import Any

S = {"type": "string", "maxLength": 8}  # a short free string

GENERATED: dict[str, dict[str, Any]] = {
    "flat-object": {
        "type": "object",
        "properties": {"name": S, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "optional-properties": {
        "type": "object",
        "properties": {"a": S, "b": {"type": "integer"}, "c": {"type": "boolean"}},
        "required": ["a"],
    },
    "all-optional": {"type": "object", "properties": {"x": {"type": "number"}, "y": S}},
    "nested-objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": S,
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                    },
                },
                "required": ["id", "address"],
            }
        },
        "required": ["user"],
    },
    "array-of-integers": {"type": "array", "items": {"type": "integer"}, "maxItems": 5},
    "array-bounds": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
    "array-of-objects": {
        "type": "array",
        "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                "qty": {"type": "integer"},
            },
            "required": ["sku", "qty"],
        },
    },
    "nested-arrays": {
        "type": "array",
        "maxItems": 3,
        "items": {"type": "array", "maxItems": 3, "items": {"type": "number"}},
    },
    "string-enum": {"type": "string", "enum": ["red", "green", "blue"]},
    "mixed-enum": {"enum": ["auto", 1, 2.5, True, None]},
    "enum-property": {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "value": {"type": "number"}},
        "required": ["unit", "value"],
    },
    "const": {
        "type": "object",
        "properties": {"version": {"const": 2}, "kind": {"const": "event"}},
        "required": ["version", "kind"],
    },
    "string-lengths": {"type": "string", "minLength": 2, "maxLength": 6},
    "pattern-date-like": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    "pattern-alternatives": {"type": "string", "pattern": "^(yes|no|maybe)$"},
    "pattern-classes": {"type": "string", "pattern": "^[a-f0-9]{8}$"},
    "format-date": {"type": "string", "format": "date"},
    "format-time": {"type": "string", "format": "time"},
    "format-date-time": {"type": "string", "format": "date-time"},
    "format-uuid": {"type": "string", "format": "uuid"},
    "booleans-and-null": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "error": {"type": "null"}},
        "required": ["ok", "error"],
    },
    "nullable": {
        "type": "object",
        "properties": {
            "note": {"anyOf": [S, {"type": "null"}]},
            "flag": {"type": ["boolean", "null"]},
        },
        "required": ["note"],
    },
    "any-of": {"anyOf": [{"type": "integer"}, S]},
    "one-of-disjoint": {
        "oneOf": [
            {
                "type": "object",
                "properties": {"circle": {"type": "number"}},
                "required": ["circle"],
            },
            {
                "type": "object",
                "properties": {"square": {"type": "number"}},
                "required": ["square"],
            },
        ]
    },
    "ref-and-defs": {
        "type": "object",
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "definitions-keyword": {
        "definitions": {"tag": {"type": "string", "enum": ["a", "b"]}},
        "type": "array",
        "maxItems": 3,
        "items": {"$ref": "#/definitions/tag"},
    },
    "all-of-objects": {
        "allOf": [
            {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
            {"type": "object", "properties": {"label": S}, "required": ["label"]},
        ]
    },
    "additional-properties-false": {
        "type": "object",
        "properties": {"only": {"type": "integer"}},
        "required": ["only"],
        "additionalProperties": False,
    },
    "prefix-items-tuple": {
        "type": "array",
        "prefixItems": [
            {"type": "integer"},
            {"type": "string", "enum": ["x", "y"]},
            {"type": "boolean"},
        ],
        "maxItems": 3,
    },
    "annotations-ignored": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Annotated",
        "description": "annotations only describe",
        "type": "object",
        "properties": {"n": {"type": "integer", "description": "a count", "examples": [3]}},
        "required": ["n"],
    },
    "deep-nesting": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {
                            "c": {"type": "array", "maxItems": 2, "items": {"enum": [1, 2, 3]}}
                        },
                        "required": ["c"],
                    }
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    "order-report": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
            "status": {"enum": ["open", "shipped", "closed"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"sku": S, "price": {"type": "number"}},
                    "required": ["sku", "price"],
                },
            },
            "gift": {"type": "boolean"},
        },
        "required": ["order_id", "status", "items"],
    },
}

# (schema, keyword the refusal names)
UNSUPPORTED: list[tuple[dict[str, Any], str]] = [
    ({"type": "integer", "minimum": 0}, "minimum"),
    ({"type": "number", "maximum": 10}, "maximum"),
    ({"type": "integer", "exclusiveMinimum": 0}, "exclusiveMinimum"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "format": "email"}, "format: email"),
    ({"type": "object", "patternProperties": {"^x": {"type": "string"}}}, "patternProperties"),
    ({"not": {"type": "string"}}, "not"),
    ({"if": {"type": "string"}, "then": {"maxLength": 3}}, "if"),
    ({"type": "string", "pattern": "[a-z]+"}, "pattern"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 1}}}, "minimum"),
    ({"$ref": "https://example.com/schema.json"}, "$ref"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "date"}, "type"),
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "allOf"),
    ({"type": ["string", "null"], "maxLength": 8}, "type"),
    ({"anyOf": [{"type": "string"}], "maxLength": 3}, "anyOf"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}, "maxLength": 3}, "$ref"),
    ({"type": "string", "pattern": "^\\w+$"}, "pattern"),
    ({"type": "string", "pattern": "^a.b$"}, "pattern"),
    ({"type": "string", "pattern": "^[^x]+$"}, "pattern"),
]
