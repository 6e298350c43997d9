"""Integer and number bounds, checked and normalised for the converter.

Integers: `minimum`/`maximum`/`exclusive*` (either side or both) become inclusive integer
`minimum`/`maximum`, which `schema_converter` turns into digit ranges; with `multipleOf`
the values are listed as an `enum` (both bounds needed, at most `MAX_INTEGER_CHOICES`).
Numbers: the strongest lower and upper bound are kept as written; a number `multipleOf` is
refused. Bounds must fit the digits the grammar writes (`number_ranges`).
"""

from __future__ import annotations

import math
from typing import Any

from baton_serve.router.gateway.number_ranges import MAX_DIGITS, MAX_FRACTION, decimal, digits_fit
from baton_serve.router.gateway.schema_error import SchemaError, pointer

BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
MAX_INTEGER_CHOICES = 256
_FIT = f"bounds need at most {MAX_DIGITS} integer and {MAX_FRACTION} fraction digits"


def integer_node(node: dict[str, Any], path: str) -> dict[str, Any]:
    """The prepared schema of a bounded integer."""
    _check_numbers(node, path)
    lows = [math.ceil(node["minimum"])] if "minimum" in node else []
    lows += [math.floor(node["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in node else []
    highs = [math.floor(node["maximum"])] if "maximum" in node else []
    highs += [math.ceil(node["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in node else []
    low, high = max(lows, default=None), min(highs, default=None)
    if low is not None and high is not None and low > high:
        key = next(k for k in BOUNDS if k in node)
        raise SchemaError(key, pointer(path, key), "no integer is in the bounds")
    if "multipleOf" not in node:
        return (
            {"type": "integer"}
            | ({} if low is None else {"minimum": low})
            | ({} if high is None else {"maximum": high})
        )
    step = node["multipleOf"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise SchemaError("multipleOf", pointer(path, "multipleOf"), "must be an integer >= 1")
    if low is None or high is None:
        reason = "needs both a lower and an upper bound on the integer"
        raise SchemaError("multipleOf", pointer(path, "multipleOf"), reason)
    first = -(-low // step) * step
    count = (high - first) // step + 1 if high >= first else 0
    if not 0 < count <= MAX_INTEGER_CHOICES:
        reason = f"the bounds allow {count} multiples (1..{MAX_INTEGER_CHOICES} are supported)"
        raise SchemaError("multipleOf", pointer(path, "multipleOf"), reason)
    return {"enum": list(range(first, high + 1, step))}


def number_node(node: dict[str, Any], path: str) -> dict[str, Any]:
    """The prepared schema of a bounded number."""
    if "multipleOf" in node:
        reason = "a number's multiples cannot be enforced (use an integer)"
        raise SchemaError("multipleOf", pointer(path, "multipleOf"), reason)
    _check_numbers(node, path)
    out: dict[str, Any] = {"type": "number"}
    lows = [
        (decimal(node[k]), k == "exclusiveMinimum", k)
        for k in ("minimum", "exclusiveMinimum")
        if k in node
    ]
    highs = [
        (decimal(node[k]), k == "exclusiveMaximum", k)
        for k in ("maximum", "exclusiveMaximum")
        if k in node
    ]
    # the stronger bound of each side; at equal values, the exclusive one
    low = max(lows, default=None, key=lambda b: (b[0], b[1]))
    high = min(highs, default=None, key=lambda b: (b[0], not b[1]))
    for bound in (low, high):
        if bound is not None:
            out[bound[2]] = node[bound[2]]
    if low and high and (low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1]))):
        raise SchemaError(low[2], pointer(path, low[2]), "no number is in the bounds")
    return out


def _check_numbers(node: dict[str, Any], path: str) -> None:
    for key in BOUNDS:
        value = node.get(key)
        if key not in node:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise SchemaError(key, pointer(path, key), "must be a finite number")
        if key != "multipleOf" and not digits_fit(decimal(value)):
            raise SchemaError(key, pointer(path, key), _FIT)
