"""JSON-schema `pattern`s, checked and rewritten for llama-cpp-python's schema converter.

The converter copies a regular expression almost verbatim into GBNF and writes what it
matches into a JSON string unescaped, so Baton accepts a safe subset only: anchored
(`^...$`), literal characters other than `"`, `\\` and control characters, positive
character classes whose ranges avoid those, groups, `|`, and the quantifiers `* + ? {n}
{n,} {n,m}`. `\\d`, `\\w` and escaped punctuation are rewritten into classes the converter
handles (it emits `\\d` as an escape GBNF rejects), and a body with a top-level `|` is
wrapped in a group (the converter does not group it, which would split the string's quotes).

What llama.cpp's grammar matcher is slow on is refused too: a repeated part that can match
the empty string (`(a?){300}` held the engine for minutes a token: the matcher follows
every way of skipping it), more than `MAX_OPTIONAL_RUN` optional parts in a row, and
patterns whose `|` branches, with the schema's other alternatives, exceed the server's
bound (counted by `schema_check`).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_REPEAT = 1000  # deeper GBNF nesting overflows llama.cpp's recursive parser
MAX_GROUP_DEPTH = 32
# Optional parts in a row: llama.cpp's matcher follows every way of skipping them, at
# every character of every token. Its filter of a 49k-token vocabulary by `[a-z]?` written
# 8 times in a row took ~0.1 s, 16 times ~0.2 s, 20 times 0.3 s, 40 times 60 s.
MAX_OPTIONAL_RUN = 8
_CLASS_ESCAPES = {"d": "0-9", "w": "a-zA-Z0-9_", ".": ".", "]": "\\]", "[": "\\["}
_ESCAPES = {"d": "[0-9]", "w": "[a-zA-Z0-9_]", ".": "[.]", "-": "-", "/": "/"}
_CONVERTER_ESCAPES = frozenset("[](){}|*+?")  # the converter turns these into literals


class PatternError(ValueError):
    """A pattern outside the subset Baton can enforce."""


def is_safe_char(c: str) -> bool:
    """A character a JSON string may hold unescaped, and GBNF can write as itself."""
    return 0x20 <= ord(c) <= 0xFFFF and c not in '"\\'


@dataclass(frozen=True)
class Rewritten:
    pattern: str
    alternatives: int  # the branches of its `|`s: each is an alternative of the grammar


@dataclass
class _Group:
    """What a group (or the whole pattern) can match so far: whether its current branch
    can match nothing (`empty`), whether an earlier branch could, and how many parts that
    can match nothing end the branch (`optional_run`)."""

    empty: bool = True
    any_branch_empty: bool = False
    optional_run: int = 0
    longest_run: int = 0  # the longest `optional_run` so far, in any branch
    last_empty: bool = False  # the last part can match nothing
    _before_last: tuple[bool, int] = (True, 0)  # (empty, optional_run) before the last part
    _last_weight: int = 1  # optional parts the last part counts as (a group: those inside)

    def part(self, can_be_empty: bool, weight: int = 1) -> None:
        """A character, class or closed group (`weight`: its longest run of optional
        parts) follows."""
        self._before_last = (self.empty, self.optional_run)
        self._last_weight = max(weight, 1)
        self._last(can_be_empty)

    def repeated(self, low: int, high: int | None) -> None:
        """The last part is repeated `low` to `high` (None: unbounded) times."""
        if self.last_empty and (high is None or high > 1):
            raise PatternError(
                "a repeated part can match nothing (such as (a?){n} or (a|b?)*): llama.cpp's "
                "grammar matcher follows every way of skipping it ((a?){300} took minutes a "
                "token)"
            )
        if low == 0:
            self._last(True)

    def branch(self) -> None:
        """A `|` starts the next branch."""
        self.any_branch_empty = self.any_branch_empty or self.empty
        self.empty, self.optional_run = True, 0

    @property
    def can_be_empty(self) -> bool:
        return self.any_branch_empty or self.empty

    def _last(self, can_be_empty: bool) -> None:
        empty, run = self._before_last
        self.last_empty = can_be_empty
        self.empty = empty and can_be_empty
        self.optional_run = run + self._last_weight if can_be_empty else 0
        self.longest_run = max(self.longest_run, self.optional_run)
        if self.optional_run > MAX_OPTIONAL_RUN:
            raise PatternError(
                f"more than {MAX_OPTIONAL_RUN} optional parts in a row: llama.cpp's grammar "
                "matcher would follow every way of skipping them"
            )


def rewrite_pattern(pattern: str) -> Rewritten:
    """`pattern` in the form the converter translates faithfully, and its alternatives;
    `PatternError` if unsafe, or if its grammar would be slow to match (a repeated part
    that can match nothing, a long run of optional parts)."""
    if len(pattern) < 2 or not (pattern.startswith("^") and pattern.endswith("$")):
        raise PatternError("a pattern must be anchored: start with '^' and end with '$'")
    body, out = pattern[1:-1], []
    i, can_repeat = 0, False
    groups = [_Group()]  # the whole pattern, then each open group
    alternatives, top_level_branches = 1, False
    while i < len(body):
        c = body[i]
        if c == "\\":
            out.append(_escape(body[i + 1 : i + 2]))
            groups[-1].part(False)
            i, can_repeat = i + 2, True
        elif c == "[":
            text, i = _char_class(body, i)
            out.append(text)
            groups[-1].part(False)
            can_repeat = True
        elif c == "(":
            if body[i + 1 : i + 2] == "?":
                raise PatternError("'(?' groups (lookarounds, named groups) are not supported")
            groups.append(_Group())
            if len(groups) - 1 > MAX_GROUP_DEPTH:
                raise PatternError(f"groups nest deeper than {MAX_GROUP_DEPTH}")
            out.append(c)
            i, can_repeat = i + 1, False
        elif c == ")":
            if len(groups) == 1:
                raise PatternError("unbalanced ')'")
            closed = groups.pop()
            groups[-1].part(closed.can_be_empty, closed.longest_run)
            out.append(c)
            i, can_repeat = i + 1, True
        elif c in "*+?{":
            if not can_repeat:
                raise PatternError(
                    f"'{c}' must follow a character, class or group (lazy and "
                    "possessive quantifiers are not supported)"
                )
            text, low, high, i = _quantifier(body, i)
            groups[-1].repeated(low, high)
            out.append(text)
            can_repeat = False
        elif c == "|":
            groups[-1].branch()
            alternatives += 1
            top_level_branches = top_level_branches or len(groups) == 1
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
            groups[-1].part(False)
            i, can_repeat = i + 1, True
    if len(groups) > 1:
        raise PatternError("unbalanced '('")
    text = "".join(out)
    # The converter does not group a top-level `|`, which would split the string's quotes;
    # a group only where needed keeps a pattern's nesting as written.
    return Rewritten(f"^({text})$" if top_level_branches else f"^{text}$", alternatives)


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


def _quantifier(body: str, i: int) -> tuple[str, int, int | None, int]:
    """The quantifier at `i` (checked), its bounds (None: unbounded) and the index after it."""
    if body[i] != "{":
        low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[body[i]]
        return body[i], low, high, i + 1
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
    return body[i : end + 1], low, high, end + 1
