"""JSON-schema `pattern`s, checked and rewritten for llama-cpp-python's schema converter.

The converter copies a regular expression almost verbatim into GBNF and writes what it
matches into a JSON string unescaped, so Baton accepts a safe subset only: anchored
(`^...$`), literal characters other than `"`, `\\` and control characters, positive
character classes whose ranges avoid those, groups, `|`, and the quantifiers `* + ? {n}
{n,} {n,m}`. `\\d`, `\\w` and escaped punctuation are rewritten into classes the converter
handles (it emits `\\d` as an escape GBNF rejects), and the body is wrapped in a group (the
converter does not group a top-level `|`, which would split the string's quotes).
"""

from __future__ import annotations

MAX_REPEAT = 1000  # deeper GBNF nesting overflows llama.cpp's recursive parser
MAX_GROUP_DEPTH = 32
_CLASS_ESCAPES = {"d": "0-9", "w": "a-zA-Z0-9_", ".": ".", "]": "\\]", "[": "\\["}
_ESCAPES = {"d": "[0-9]", "w": "[a-zA-Z0-9_]", ".": "[.]", "-": "-", "/": "/"}
_CONVERTER_ESCAPES = frozenset("[](){}|*+?")  # the converter turns these into literals


class PatternError(ValueError):
    """A pattern outside the subset Baton can enforce."""


def is_safe_char(c: str) -> bool:
    """A character a JSON string may hold unescaped, and GBNF can write as itself."""
    return 0x20 <= ord(c) <= 0xFFFF and c not in '"\\'


def rewrite_pattern(pattern: str) -> str:
    """`pattern` in the form the converter translates faithfully; `PatternError` if unsafe."""
    if len(pattern) < 2 or not (pattern.startswith("^") and pattern.endswith("$")):
        raise PatternError("a pattern must be anchored: start with '^' and end with '$'")
    body, out = pattern[1:-1], []
    i, depth, can_repeat = 0, 0, False
    while i < len(body):
        c = body[i]
        if c == "\\":
            out.append(_escape(body[i + 1 : i + 2]))
            i, can_repeat = i + 2, True
        elif c == "[":
            text, i = _char_class(body, i)
            out.append(text)
            can_repeat = True
        elif c == "(":
            if body[i + 1 : i + 2] == "?":
                raise PatternError("'(?' groups (lookarounds, named groups) are not supported")
            depth += 1
            if depth > MAX_GROUP_DEPTH:
                raise PatternError(f"groups nest deeper than {MAX_GROUP_DEPTH}")
            out.append(c)
            i, can_repeat = i + 1, False
        elif c == ")":
            depth -= 1
            if depth < 0:
                raise PatternError("unbalanced ')'")
            out.append(c)
            i, can_repeat = i + 1, True
        elif c in "*+?{":
            if not can_repeat:
                raise PatternError(
                    f"'{c}' must follow a character, class or group (lazy and "
                    "possessive quantifiers are not supported)"
                )
            text, i = _quantifier(body, i)
            out.append(text)
            can_repeat = False
        elif c == "|":
            out.append(c)
            i, can_repeat = i + 1, False
        elif c == ".":
            raise PatternError("'.' would match '\"' and '\\': use a character class")
        elif c in "^$":
            raise PatternError(f"'{c}' is only supported as the pattern's first/last character")
        elif c in "]}":
            raise PatternError(f"unbalanced '{c}'")
        elif not is_safe_char(c):
            raise PatternError(f"the character {c!r} needs escaping in JSON")
        else:
            out.append(c)
            i, can_repeat = i + 1, True
    if depth:
        raise PatternError("unbalanced '('")
    return "^(" + "".join(out) + ")$"


def _escape(c: str) -> str:
    if c in _ESCAPES:
        return _ESCAPES[c]
    if c in _CONVERTER_ESCAPES:
        return "\\" + c
    raise PatternError(f"the escape '\\{c}' is not supported")


def _char_class(body: str, start: int) -> tuple[str, int]:
    """The class opening at `start`, rewritten, and the index after it."""
    i, items = start + 1, []
    if body[i : i + 1] == "^":
        raise PatternError("negated character classes would match '\"' and '\\'")
    while i < len(body) and body[i] != "]":
        if body[i] == "\\":
            c = body[i + 1 : i + 2]
            if c not in _CLASS_ESCAPES:
                raise PatternError(f"the escape '\\{c}' is not supported in a character class")
            items.append(_CLASS_ESCAPES[c])
            i += 2
            continue
        low = body[i]
        if not is_safe_char(low):
            raise PatternError(f"the character {low!r} needs escaping in JSON")
        if body[i + 1 : i + 2] == "-" and body[i + 2 : i + 3] not in ("", "]"):
            high = body[i + 2]
            if not is_safe_char(high) or ord(high) < ord(low):
                raise PatternError(f"bad character range {low}-{high}")
            if any(ord(low) <= ord(q) <= ord(high) for q in '"\\'):
                raise PatternError(f"the range {low}-{high} includes '\"' or '\\'")
            items.append(f"{low}-{high}")
            i += 3
        else:
            items.append(low)
            i += 1
    if i >= len(body):
        raise PatternError("unbalanced '['")
    if not items:
        raise PatternError("empty character class")
    return "[" + "".join(items) + "]", i + 1


def _quantifier(body: str, i: int) -> tuple[str, int]:
    """The quantifier at `i` (checked) and the index after it."""
    if body[i] != "{":
        return body[i], i + 1
    end = body.find("}", i)
    if end < 0:
        raise PatternError("unbalanced '{'")
    bounds = body[i + 1 : end].split(",")
    if len(bounds) > 2 or not all(b.strip().isdigit() or b.strip() == "" for b in bounds):
        raise PatternError(f"bad quantifier {body[i : end + 1]}")
    numbers = [int(b) for b in bounds if b.strip()]
    low = int(bounds[0]) if bounds[0].strip() else 0
    high = int(bounds[-1]) if bounds[-1].strip() else None
    if not numbers or max(numbers) > MAX_REPEAT or (high is not None and high < low):
        raise PatternError(f"quantifier {body[i : end + 1]}: bounds must be 0..{MAX_REPEAT}")
    return body[i : end + 1], end + 1
