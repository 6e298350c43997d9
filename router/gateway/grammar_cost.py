"""What makes a client's raw GBNF grammar slow for llama.cpp's matcher, found before a
replica applies it: the grammar read as llama.cpp's parser reads it (rules, `|` branches,
groups, literals, classes, token references, quantifiers), then three checks.

llama.cpp's matcher keeps one stack per way the grammar can go on, and filters the
vocabulary through every stack, character by character of each token, on the engine thread
while the co-batched streams wait. Measured over a 49k-token vocabulary:

- a repeated part that can match nothing: `("a"?){300}` took minutes a token (every way of
  skipping each copy is followed), so such a repetition is refused;
- optional parts in a row: 8 `[a-z]?` ~0.1 s a token, 20 0.3 s, 40 60 s, so at most
  `MAX_OPTIONAL_RUN` (a group or rule counts as its own longest run);
- alternatives at one place: 100 took 25 ms a token, 1,000 0.3 s, 5,000 1.7 s, so at most
  the server's bound, counted through rules and groups and past parts that can match
  nothing.

Every pass is a loop, never a recursion, so no grammar (1,000 groups deep, thousands of rules
in a chain) runs out of stack. Text that does not parse as llama.cpp parses GBNF is refused
too (llama.cpp would refuse it as well), so no reading of it can differ from llama.cpp's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from baton_serve.router.gateway.schema_pattern import MAX_OPTIONAL_RUN

_SPACE = re.compile(r"(?:[ \t]|#[^\r\n]*)*")
_SPACE_NEWLINES = re.compile(r"(?:[ \t\r\n]|#[^\r\n]*)*")
_NAME = re.compile(r"[a-zA-Z0-9-]+")
_LITERAL = re.compile(r'"(?:\\.|[^"\\])*"', re.DOTALL)
_CLASS = re.compile(r"\[(?:\\.|[^\]\\])*\]", re.DOTALL)
_TOKEN = re.compile(r"!?<[^>]*>")
_BOUNDS = re.compile(r"\{[ \t]*(\d+)[ \t]*(?:(\})|,[ \t]*(\d*)[ \t]*\})")
_QUANTIFIERS = {"*": (0, None), "+": (1, None), "?": (0, 1)}


class GrammarCostly(ValueError):
    """A grammar llama.cpp's matcher would be slow on."""


class _Unparsed(ValueError):
    """Text llama.cpp's parser would refuse: where it stops."""


@dataclass
class _Item:
    """A part of a branch: a rule (by name) or a group, or else a literal, class or token
    (`element` None), repeated `low` to `high` (None: unbounded) times."""

    element: str | int | None  # a rule's name, or a group's index
    empty_literal: bool = False  # `""`
    low: int = 1
    high: int | None = 1


@dataclass
class _Group:
    branches: list[list[_Item]] = field(default_factory=lambda: [[]])


def check_grammar_cost(text: str, max_alternatives: int) -> None:
    """Raise `GrammarCostly` if llama.cpp's matcher would be slow on grammar `text`."""
    text = text.split("\0", 1)[0]  # llama.cpp reads a C string
    try:
        groups, rules = _parse(text)
    except _Unparsed as exc:
        raise GrammarCostly(f"it is not GBNF llama.cpp can parse (at character {exc})") from None
    _Costs(groups, rules, max_alternatives).check()


def _parse(text: str) -> tuple[list[_Group], dict[str, int]]:
    """Every group (rules first, as they are met) and each rule's group index."""
    groups: list[_Group] = []
    rules: dict[str, int] = {}
    at = _SPACE_NEWLINES.match(text).end()  # type: ignore[union-attr]

    def take(pattern: re.Pattern[str]) -> re.Match[str]:
        nonlocal at
        found = pattern.match(text, at)
        if found is None:
            raise _Unparsed(at)
        at = found.end()
        return found

    while at < len(text):
        name = take(_NAME).group()
        take(_SPACE)
        if not text.startswith("::=", at):
            raise _Unparsed(at)
        at += 3
        take(_SPACE_NEWLINES)
        rules[name] = len(groups)
        groups.append(_Group())
        open_groups = [rules[name]]
        while at < len(text):
            c, branch = text[at], groups[open_groups[-1]].branches[-1]
            if c == '"':
                branch.append(_Item(None, empty_literal=take(_LITERAL).group() == '""'))
            elif c == "[":
                take(_CLASS)
                branch.append(_Item(None))
            elif c in "<!":
                take(_TOKEN)
                branch.append(_Item(None))
            elif c == ".":
                at += 1
                branch.append(_Item(None))
            elif _NAME.match(c):
                branch.append(_Item(take(_NAME).group()))
            elif c == "(":
                at += 1
                take(_SPACE_NEWLINES)
                branch.append(_Item(len(groups)))
                open_groups.append(len(groups))
                groups.append(_Group())
                continue
            elif c == ")" and len(open_groups) > 1:
                open_groups.pop()
                at += 1
            elif c == "|":
                groups[open_groups[-1]].branches.append([])
                at += 1
                take(_SPACE_NEWLINES)
                continue
            elif c in _QUANTIFIERS or c == "{":
                if not branch:
                    raise _Unparsed(at)
                if c == "{":
                    bounds = take(_BOUNDS)
                    low = int(bounds[1])
                    high = low if bounds[2] else int(bounds[3]) if bounds[3] else None
                else:
                    at += 1
                    low, high = _QUANTIFIERS[c]
                last = branch[-1]
                if (last.low, last.high) != (1, 1):  # a repetition repeated: group it
                    groups.append(_Group([[last]]))
                    last = _Item(len(groups) - 1)
                branch[-1] = _Item(last.element, last.empty_literal, low, high)
            else:
                break
            take(_SPACE_NEWLINES if len(open_groups) > 1 else _SPACE)
        if len(open_groups) > 1 or (at < len(text) and text[at] not in "\r\n"):
            raise _Unparsed(at)
        take(_SPACE_NEWLINES)
    return groups, rules


class _Costs:
    def __init__(self, groups: list[_Group], rules: dict[str, int], max_alternatives: int):
        self._groups = groups
        self._rules = rules
        self._max = max_alternatives
        self._names = {index: name for name, index in rules.items()}
        self._empty = self._can_be_empty()

    def check(self) -> None:
        self._check_repetitions()
        runs: dict[int, int] = {}
        widths: dict[int, int] = {}
        for index in self._children_first():  # a cycle's first member sees 0 for the rest
            runs[index] = self._longest_run(index, runs)
            widths[index] = self._width(index, widths)

    def _group_of(self, item: _Item) -> int | None:
        if isinstance(item.element, str):
            return self._rules.get(item.element)
        return item.element

    def _item_empty(self, item: _Item, empty: list[bool]) -> bool:
        group = self._group_of(item)
        return item.low == 0 or item.empty_literal or (group is not None and empty[group])

    def _can_be_empty(self) -> list[bool]:
        """Which groups can match nothing: a fixpoint, each group's branches looked at again
        only when a group they name turns out empty."""
        empty = [False] * len(self._groups)
        users: dict[int, list[int]] = {}
        for index, group in enumerate(self._groups):
            for branch in group.branches:
                for item in branch:
                    if (named := self._group_of(item)) is not None:
                        users.setdefault(named, []).append(index)
        pending = list(range(len(self._groups)))
        while pending:
            index = pending.pop()
            if empty[index]:
                continue
            if any(
                all(self._item_empty(i, empty) for i in b) for b in self._groups[index].branches
            ):
                empty[index] = True
                pending.extend(users.get(index, ()))
        return empty

    def _check_repetitions(self) -> None:
        for group in self._groups:
            for item in (item for branch in group.branches for item in branch):
                named = self._group_of(item)
                element_empty = item.empty_literal or (named is not None and self._empty[named])
                if element_empty and (item.high is None or item.high > 1):
                    raise GrammarCostly(
                        'a repeated part can match nothing (such as ("a"?){n}): llama.cpp\'s '
                        'grammar matcher follows every way of skipping it (("a"?){300} took '
                        "minutes a token)"
                    )

    def _children_first(self) -> list[int]:
        """Every group, each after the groups its parts name (but along a cycle)."""
        order: list[int] = []
        seen: set[int] = set()
        for root in range(len(self._groups)):
            if root in seen:
                continue
            seen.add(root)
            stack = [(root, iter(self._named(root)))]
            while stack:
                index, named = stack[-1]
                child = next(named, None)
                if child is None:
                    stack.pop()
                    order.append(index)
                elif child not in seen:
                    seen.add(child)
                    stack.append((child, iter(self._named(child))))
        return order

    def _named(self, index: int) -> list[int]:
        branches = self._groups[index].branches
        return [g for b in branches for i in b if (g := self._group_of(i)) is not None]

    def _longest_run(self, index: int, runs: dict[int, int]) -> int:
        longest = 0
        for branch in self._groups[index].branches:
            run = 0
            for item in branch:
                if not self._item_empty(item, self._empty):
                    run = 0
                    continue
                named = self._group_of(item)
                run += max(runs.get(named, 0), 1) if named is not None else 1
                if run > MAX_OPTIONAL_RUN:
                    raise GrammarCostly(
                        f"more than {MAX_OPTIONAL_RUN} optional parts in a row ({self._where(index)}): "
                        "llama.cpp's grammar matcher follows every way of skipping them (40 "
                        "[a-z]? took 60 s a token)"
                    )
                longest = max(longest, run)
        return longest

    def _width(self, index: int, widths: dict[int, int]) -> int:
        """The alternatives at the start of group `index`, checked against the bound, as is
        every other place in its branches (a place's: its part's, and the next parts' while
        the ones before can match nothing)."""
        at_start = 0
        for branch in self._groups[index].branches:
            for start in range(len(branch) or 1):
                width = 0
                for item in branch[start:]:
                    named = self._group_of(item)
                    width += widths.get(named, 0) if named is not None else 1
                    if not self._item_empty(item, self._empty):
                        break
                self._bound(width, index)
                at_start += width if start == 0 else 0
        self._bound(at_start, index)
        return at_start

    def _bound(self, width: int, index: int) -> None:
        if width > self._max:
            raise GrammarCostly(
                f"{width} alternatives at one place ({self._where(index)}); this server takes "
                f"at most {self._max} (its max_grammar_choices setting): llama.cpp's grammar "
                "matcher follows each at every token"
            )

    def _where(self, index: int) -> str:
        name = self._names.get(index)
        return f"rule {name}" if name is not None else "a group"
