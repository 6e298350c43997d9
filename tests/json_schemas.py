"""JSON schemas for structured output: ones Baton enforces, and ones it refuses.

`SUPPORTED`: name → schema. Strings and arrays are mostly bounded (`maxLength`, `maxItems`,
enums, formats) because the sampling test runs them on a random-weight model, which at
temperature 1 rarely chooses to close an unbounded string; a few unbounded ones remain.
`UNSUPPORTED`: (name, schema, keyword, JSON pointer) — the keyword and where the 400 names it.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

_NAME = {"type": "string", "maxLength": 10}
_SHORT = {"type": "string", "maxLength": 6}

SUPPORTED: dict[str, Schema] = {
    "flat_object": {
        "type": "object",
        "properties": {"name": _NAME, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"],
    },
    "optional_properties": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "nick": _SHORT, "score": {"type": "number"}},
        "required": ["id"],
    },
    "no_required": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": _SHORT}},
    "nested_objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": _NAME,
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": _NAME,
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["user"],
    },
    "array_bounds": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": _SHORT, "minItems": 1, "maxItems": 3},
            "pair": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
        },
        "required": ["tags", "pair"],
    },
    "array_unbounded_items": {"type": "array", "items": {"type": "boolean"}},
    "enum_strings": {
        "type": "object",
        "properties": {"status": {"type": "string", "enum": ["open", "closed", "on hold"]}},
        "required": ["status"],
    },
    "enum_mixed": {"enum": ["a", 1, 2.5, True, None, {"k": [1, 2]}, [3, "x"]]},
    "nullable_enum": {"type": ["string", "null"], "enum": ["low", "high", None]},
    "enum_unicode": {"enum": ["café", "naïve", "日本"]},
    "const_values": {
        "type": "object",
        "properties": {"v": {"const": 2}, "kind": {"const": "point"}, "o": {"const": {"a": [1]}}},
        "required": ["v", "kind", "o"],
    },
    "integer_bounds": {"type": "integer", "minimum": -5, "maximum": 120},
    "integer_exclusive_bounds": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    "integer_multiple_of": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5},
    "numbers": {
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "number"}, "n": {"type": "integer"}},
        "required": ["x", "y", "n"],
    },
    "string_lengths": {"type": "string", "minLength": 2, "maxLength": 5},
    "string_unbounded": {
        "type": "object",
        "properties": {"s": {"type": "string"}},
        "required": ["s"],
    },
    "pattern_digits": {"type": "string", "pattern": "^\\d{3}-\\d{4}$"},
    "pattern_alternation": {"type": "string", "pattern": "^red|green|blue$"},
    "pattern_classes": {
        "type": "string",
        "pattern": "^[A-Z]{2}[0-9]{2,4}(-[a-z_]{1,6})?\\.v[1-9]$",
    },
    "format_date": {"type": "string", "format": "date"},
    "format_time": {"type": "string", "format": "time"},
    "format_date_time": {"type": "string", "format": "date-time"},
    "format_uuid": {"type": "string", "format": "uuid"},
    "any_of": {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "integer"}, _SHORT, {"type": "null"}]}},
        "required": ["v"],
    },
    "one_of_discriminated": {
        "oneOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                "required": ["kind", "r"],
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "square"}, "side": {"type": "integer"}},
                "required": ["kind", "side"],
            },
        ]
    },
    "defs_and_refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "definitions_draft7": {
        "definitions": {"color": {"enum": ["red", "green"]}},
        "type": "array",
        "items": {"$ref": "#/definitions/color"},
        "maxItems": 4,
    },
    "ref_name_clashes": {  # a definition named like a property and like a primitive rule
        "$defs": {"address": {"type": "integer"}, "string": {"type": "boolean"}},
        "type": "object",
        "properties": {
            "address": _SHORT,
            "home": {"$ref": "#/$defs/address"},
            "flag": {"$ref": "#/$defs/string"},
        },
        "required": ["address", "home", "flag"],
    },
    "recursive_root_ref": {  # pydantic's shape for a self-referencing model
        "$ref": "#/$defs/Node",
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer"},
                    "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]},
                },
                "required": ["value", "next"],
            }
        },
    },
    "additional_false": {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    },
    "additional_typed": {
        "type": "object",
        "properties": {"id": {"type": "integer"}},
        "required": ["id"],
        "additionalProperties": {"type": "boolean"},
    },
    "additional_beside_optional": {  # extra properties are then never generated
        "type": "object",
        "properties": {"id": {"type": "integer"}},
        "additionalProperties": True,
    },
    "empty_object": {"type": "object", "additionalProperties": False},
    "booleans_and_nulls": {
        "type": "object",
        "properties": {
            "b": {"type": "boolean"},
            "n": {"type": "null"},
            "maybe": {"type": ["boolean", "null"]},
        },
        "required": ["b", "n", "maybe"],
    },
    "arrays_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": _SHORT,
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    "nested_arrays": {
        "type": "array",
        "maxItems": 3,
        "items": {"type": "array", "maxItems": 3, "items": {"type": "integer"}},
    },
    "tuple_prefix_items": {
        "type": "array",
        "prefixItems": [{"type": "integer"}, _SHORT, {"type": "boolean"}],
        "items": False,
    },
    "annotations": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://example.com/annotated",
        "title": "Annotated",
        "description": "annotations are allowed and ignored",
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "an int", "default": 1, "examples": [2]}
        },
        "required": ["a"],
    },
    "root_string_enum_array": {
        "type": "array",
        "items": {"enum": ["x", "y", "z"]},
        "minItems": 1,
        "maxItems": 5,
    },
    "integer_minimum_only": {"type": "integer", "minimum": 0},
    "integer_exclusive_minimum_only": {"type": "integer", "exclusiveMinimum": 0},
    "integer_maximum_only": {"type": "integer", "maximum": -3},
    "integer_wide_range": {"type": "integer", "minimum": -10_000, "maximum": 10_000},
    "integer_float_bounds": {"type": "integer", "minimum": 0.5, "exclusiveMaximum": 7.5},
    "number_minimum_only": {"type": "number", "minimum": 0},
    "number_exclusive_bounds": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "number_fraction_bounds": {"type": "number", "minimum": -2.5, "maximum": 3.75},
    "number_negative_upper_only": {"type": "number", "exclusiveMaximum": -0.5},
    "number_bounds_in_object": {
        "type": "object",
        "properties": {
            "p": {"type": "number", "minimum": 0, "maximum": 1},
            "t": {"type": "number", "minimum": -273.15},
            "n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10},
        },
        "required": ["p", "t", "n"],
    },
    "format_email": {"type": "string", "format": "email"},
    "format_uri": {"type": "string", "format": "uri"},
    "format_uri_implied_lengths": {
        "type": "string",
        "format": "uri",
        "minLength": 1,
        "maxLength": 2083,
    },
    "format_ipv4": {"type": "string", "format": "ipv4"},
    "format_ipv6": {"type": "string", "format": "ipv6"},
    "format_duration": {"type": "string", "format": "duration"},
    "format_uuid4": {"type": "string", "format": "uuid4"},
    "format_password": {"type": "string", "format": "password", "maxLength": 8},
    "unique_enum_items": {
        "type": "array",
        "items": {"enum": ["a", "b", "c", "d"]},
        "uniqueItems": True,
    },
    "unique_booleans_min_items": {
        "type": "array",
        "items": {"type": "boolean"},
        "uniqueItems": True,
        "minItems": 2,
    },
    "unique_ref_enum_bounded": {
        "$defs": {"Color": {"type": "string", "enum": ["red", "green", "blue"]}},
        "type": "array",
        "items": {"$ref": "#/$defs/Color"},
        "uniqueItems": True,
        "minItems": 1,
        "maxItems": 2,
    },
    "unique_small_integers": {
        "type": "array",
        "items": {"type": "integer", "minimum": 1, "maximum": 5},
        "uniqueItems": True,
    },
    "additional_properties_map": {
        "type": "object",
        "additionalProperties": {"type": "integer", "minimum": 0},
    },
    "discriminated_refs": {  # pydantic's shape for a discriminated union
        "$defs": {
            "Cat": {
                "type": "object",
                "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                "required": ["kind", "lives"],
            },
            "Dog": {
                "type": "object",
                "properties": {"kind": {"enum": ["dog", "puppy"]}, "barks": {"type": "boolean"}},
                "required": ["kind", "barks"],
            },
        },
        "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
        "discriminator": {
            "propertyName": "kind",
            "mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog", "puppy": "#/$defs/Dog"},
        },
    },
    "tuple_with_lengths": {  # pydantic's shape for tuple[int, bool]
        "type": "array",
        "prefixItems": [{"type": "integer"}, {"type": "boolean"}],
        "minItems": 2,
        "maxItems": 2,
    },
    "root_primitive": {"type": "boolean"},
}

UNSUPPORTED: list[tuple[str, Schema, str, str]] = [
    (
        "multiple_of_one_sided",
        {"type": "integer", "minimum": 0, "multipleOf": 5},
        "multipleOf",
        "/multipleOf",
    ),
    (
        "multiple_of_too_many",
        {"type": "integer", "minimum": 0, "maximum": 10_000, "multipleOf": 3},
        "multipleOf",
        "/multipleOf",
    ),
    ("empty_integer_range", {"type": "integer", "minimum": 5, "maximum": 3}, "minimum", "/minimum"),
    (
        "empty_number_range",
        {"type": "number", "exclusiveMinimum": 1, "maximum": 1},
        "exclusiveMinimum",
        "/exclusiveMinimum",
    ),
    ("bound_too_many_digits", {"type": "number", "minimum": 1e20}, "minimum", "/minimum"),
    ("bound_too_fine", {"type": "number", "maximum": 1e-20}, "maximum", "/maximum"),
    ("bound_boolean", {"type": "number", "minimum": True}, "minimum", "/minimum"),
    (
        "unique_items_strings",
        {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "uniqueItems",
        "/uniqueItems",
    ),
    (
        "unique_items_min_too_large",
        {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 3},
        "uniqueItems",
        "/uniqueItems",
    ),
    (
        "discriminator_not_required",
        {
            "oneOf": [
                {"type": "object", "properties": {"k": {"const": "a"}}},
                {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]},
            ],
            "discriminator": {"propertyName": "k"},
        },
        "discriminator",
        "/discriminator",
    ),
    (
        "discriminator_shared_value",
        {
            "oneOf": [
                {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"enum": ["b", "a"]}}, "required": ["k"]},
            ],
            "discriminator": {"propertyName": "k"},
        },
        "discriminator",
        "/discriminator",
    ),
    (
        "tuple_length_mismatch",
        {"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2},
        "minItems",
        "/minItems",
    ),
    (
        "nested_max_properties",
        {"type": "object", "properties": {"o": {"type": "object", "maxProperties": 2}}},
        "maxProperties",
        "/properties/o/maxProperties",
    ),
    (
        "unique_items",
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "uniqueItems",
        "/uniqueItems",
    ),
    (
        "contains",
        {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}},
        "contains",
        "/contains",
    ),
    ("min_items_without_items", {"type": "array", "minItems": 1}, "minItems", "/minItems"),
    ("not", {"not": {"type": "string"}}, "not", "/not"),
    ("if_then_else", {"type": "object", "properties": {}, "if": {}, "then": {}}, "if", "/if"),
    ("all_of", {"allOf": [{"type": "object"}]}, "allOf", "/allOf"),
    (
        "pattern_properties",
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
        "patternProperties",
        "/patternProperties",
    ),
    (
        "dependent_required",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        "dependentRequired",
        "/dependentRequired",
    ),
    (
        "property_names",
        {"type": "object", "propertyNames": {"maxLength": 3}},
        "propertyNames",
        "/propertyNames",
    ),
    ("format_regex", {"type": "string", "format": "regex"}, "format", "/format"),
    (
        "format_with_length",
        {"type": "string", "format": "date", "maxLength": 5},
        "maxLength",
        "/maxLength",
    ),
    (
        "pattern_with_length",
        {"type": "string", "pattern": "^a+$", "maxLength": 3},
        "maxLength",
        "/maxLength",
    ),
    ("pattern_unanchored", {"type": "string", "pattern": "abc"}, "pattern", "/pattern"),
    ("pattern_dot", {"type": "string", "pattern": "^a.c$"}, "pattern", "/pattern"),
    ("pattern_negated_class", {"type": "string", "pattern": "^[^a]+$"}, "pattern", "/pattern"),
    ("pattern_lookahead", {"type": "string", "pattern": "^(?=a)a$"}, "pattern", "/pattern"),
    ("pattern_quote_range", {"type": "string", "pattern": "^[ -~]+$"}, "pattern", "/pattern"),
    ("pattern_backreference", {"type": "string", "pattern": "^(a)\\1$"}, "pattern", "/pattern"),
    ("pattern_stray_brace", {"type": "string", "pattern": "^a}$"}, "pattern", "/pattern"),
    ("pattern_huge_repeat", {"type": "string", "pattern": "^a{5000}$"}, "pattern", "/pattern"),
    ("max_length_too_large", {"type": "string", "maxLength": 20_000}, "maxLength", "/maxLength"),
    (
        "max_items_too_large",
        {"type": "array", "items": {"type": "integer"}, "maxItems": 5000},
        "maxItems",
        "/maxItems",
    ),
    ("min_over_max", {"type": "string", "minLength": 5, "maxLength": 2}, "minLength", "/minLength"),
    ("multiple_of_number", {"type": "number", "multipleOf": 0.5}, "multipleOf", "/multipleOf"),
    (
        "length_on_type_list",
        {"type": ["string", "null"], "maxLength": 3},
        "maxLength",
        "/maxLength",
    ),
    (
        "keyword_beside_ref",
        {"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "maximum": 3},
        "maximum",
        "/maximum",
    ),
    (
        "type_beside_any_of",
        {"type": "string", "anyOf": [{"type": "string", "maxLength": 2}]},
        "type",
        "/type",
    ),
    ("remote_ref", {"$ref": "https://example.com/schema.json"}, "$ref", "/$ref"),
    (
        "ref_to_property",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}},
        },
        "$ref",
        "/properties/b/$ref",
    ),
    (
        "nested_defs",
        {"type": "object", "properties": {"a": {"$defs": {}, "type": "integer"}}},
        "$defs",
        "/properties/a/$defs",
    ),
    (
        "required_undefined",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]},
        "required",
        "/required",
    ),
    ("const_with_quote", {"const": 'say "hi"'}, "const", "/const"),
    ("enum_with_backslash", {"enum": ["a\\b"]}, "enum", "/enum"),
    ("enum_with_newline", {"enum": ["a\nb"]}, "enum", "/enum"),
    ("enum_empty", {"enum": []}, "enum", "/enum"),
    ("enum_outside_type_list", {"type": ["string", "null"], "enum": ["a", 1]}, "enum", "/enum"),
    ("pattern_not_a_string", {"type": "string", "pattern": 5}, "pattern", "/pattern"),
    ("enum_of_wrong_type", {"type": "string", "enum": ["a", 1]}, "enum", "/enum"),
    (
        "property_name_with_quote",
        {"type": "object", "properties": {'a"b': {"type": "integer"}}},
        "properties",
        "/properties",
    ),
    ("items_empty", {"type": "array", "items": {}}, "items", "/items"),
    ("items_list", {"type": "array", "items": [{"type": "integer"}]}, "items", "/items"),
    (
        "prefix_items_and_items",
        {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}},
        "prefixItems",
        "/prefixItems",
    ),
    ("boolean_subschema", {"type": "object", "properties": {"a": True}}, "schema", "/properties/a"),
    ("unknown_type", {"type": "int"}, "type", "/type"),
    ("untyped_min_length", {"minLength": 2}, "minLength", "/minLength"),
    ("nullable_openapi", {"type": "string", "nullable": True}, "nullable", "/nullable"),
    (
        "deep_unsupported",
        {
            "type": "array",
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"t": {"type": "string", "format": "hostname"}},
                    }
                ]
            },
        },
        "format",
        "/items/anyOf/0/properties/t/format",
    ),
    (
        "json_pointer_escaping",
        {"type": "object", "properties": {"a/b": {"type": "number", "multipleOf": 0.5}}},
        "multipleOf",
        "/properties/a~1b/multipleOf",
    ),
]
