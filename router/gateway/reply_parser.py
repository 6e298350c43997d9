"""Splits a chat reply, as it streams, into reasoning (`<think>…</think>`), content, and a
tool-call section that is held back whole until the reply ends (then parsed).

Text that might be the start of a marker is held back until the next piece decides, so no
marker ever leaks into content or reasoning.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from baton_serve.router.gateway.tool_calls import MARKERS

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class Part(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"


@dataclass(frozen=True)
class Piece:
    part: Part
    text: str


class _State(enum.Enum):
    START = "start"  # nothing but whitespace yet: a `<think>` or a bare JSON call may come
    REASONING = "reasoning"
    CONTENT = "content"
    TOOLS = "tools"  # from a tool-call marker on: held back for parsing


class ReplyParser:
    """`feed` pieces of reply text in order; `finish` once. `reasoning`: the template marks
    reasoning with `<think>`; `in_reasoning`: the prompt already opened it. `tools`: the
    reply may hold tool calls (marked, or a reply that is only JSON)."""

    def __init__(self, *, reasoning: bool, in_reasoning: bool, tools: bool) -> None:
        self._reasoning = reasoning
        self._tools = tools
        if in_reasoning:
            self._state = _State.REASONING
        else:
            self._state = _State.START if reasoning or tools else _State.CONTENT
        self._held = ""
        self._after_reasoning = False
        self.tool_text = ""  # the tool-call section, once `finish` has run

    def feed(self, text: str) -> list[Piece]:
        self._held += text
        pieces: list[Piece] = []
        while self._held and self._step(pieces):
            pass
        return [p for p in pieces if p.text]

    def finish(self) -> list[Piece]:
        """The rest: held-back text is what it was heading to be (reasoning stays reasoning,
        an unfinished marker is content); the tool section goes to `tool_text`."""
        rest, self._held = self._held, ""
        if self._state is _State.TOOLS:
            self.tool_text += rest
            return []
        if self._state is _State.START and self._after_reasoning:
            rest = rest.lstrip()
        part = Part.REASONING if self._state is _State.REASONING else Part.CONTENT
        return [Piece(part, rest)] if rest else []

    def _step(self, pieces: list[Piece]) -> bool:
        """Consume what can be decided of `_held`; False when the rest must wait."""
        if self._state is _State.TOOLS:
            self.tool_text += self._held
            self._held = ""
            return True
        if self._state is _State.REASONING:
            return self._reasoning_step(pieces)
        if self._state is _State.START:
            return self._start_step()
        return self._content_step(pieces)

    def _start_step(self) -> bool:
        stripped = self._held.lstrip()
        if not stripped:
            return False
        if self._reasoning and not self._after_reasoning and _could_start(stripped, THINK_OPEN):
            if not stripped.startswith(THINK_OPEN):
                return False
            self._held = stripped[len(THINK_OPEN) :]
            self._state = _State.REASONING
            return True
        if self._after_reasoning:  # content after reasoning starts at its first word
            self._held = stripped
        self._state = _State.TOOLS if self._tools and stripped[0] in "{[" else _State.CONTENT
        return True

    def _reasoning_step(self, pieces: list[Piece]) -> bool:
        before, found, after = self._held.partition(THINK_CLOSE)
        if found:
            pieces.append(Piece(Part.REASONING, before))
            self._held = after
            self._state = _State.START
            self._after_reasoning = True
            return True
        keep = _partial_suffix(self._held, (THINK_CLOSE,))
        pieces.append(Piece(Part.REASONING, self._held[: len(self._held) - keep]))
        self._held = self._held[len(self._held) - keep :]
        return False

    def _content_step(self, pieces: list[Piece]) -> bool:
        held = self._held
        if not self._tools:
            pieces.append(Piece(Part.CONTENT, held))
            self._held = ""
            return True
        starts = [i for i in (held.find(m) for m in MARKERS) if i >= 0]
        if starts:
            at = min(starts)
            pieces.append(Piece(Part.CONTENT, held[:at]))
            self._held = held[at:]
            self._state = _State.TOOLS
            return True
        keep = _partial_suffix(held, MARKERS)
        pieces.append(Piece(Part.CONTENT, held[: len(held) - keep]))
        self._held = held[len(held) - keep :]
        return False


def _could_start(text: str, marker: str) -> bool:
    return text.startswith(marker) or marker.startswith(text)


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins some marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest
