"""A chat template's rendering cut into one piece per message, in time linear in the
number of messages.

A chat prompt is tokenized piece by piece, so that a conversation's tokens are a stable
prefix of the next turn's and every message starts at an exact token offset. The pieces
are defined by prefix renderings: message k's piece is what rendering `messages[:k+1]` adds
to rendering `messages[:k]`, split after the generation prompt when the message continues
one (an assistant reply). Rendering every prefix costs O(n²) template work, so instead:

1. the conversation is rendered once, its messages in a list that records how much text had
   been produced when the template's loop fetched each one (the candidate cut points);
2. the candidates are checked against real prefix renderings at the powers of two and the
   last two messages — O(log n) renderings of total size O(n).

A template for which they disagree (one that rewrites earlier messages, or prints a
message's text before its loop reaches it) gets no pieces: its rendering is tokenized whole.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

View = dict[str, Any]


class ChatRenderer(Protocol):
    def render_views(
        self, views: Sequence[View], *, add_generation_prompt: bool, extras: Mapping[str, Any]
    ) -> str: ...

    def stream_views(
        self, views: Sequence[View], *, add_generation_prompt: bool, extras: Mapping[str, Any]
    ) -> Iterator[str]: ...


@dataclass(frozen=True)
class ChatText:
    """A rendered chat: each message's texts (one, or the generation prompt and the reply
    that continues it) and the closing generation prompt; or, without pieces, the whole
    rendering as `tail`."""

    pieces: tuple[tuple[str, ...], ...]
    tail: str

    @property
    def text(self) -> str:
        return "".join("".join(parts) for parts in self.pieces) + self.tail


def segment_chat(
    renderer: ChatRenderer, views: Sequence[View], extras: Mapping[str, Any], full: str
) -> ChatText:
    """`full` (the conversation rendered with its generation prompt) cut into pieces."""
    whole = ChatText(pieces=(), tail=full)
    try:
        rendered, starts = _tracked_render(renderer, views, extras)
    except ValueError:
        return whole
    if starts is None or not full.startswith(rendered):
        return whole
    opening = full[len(rendered) :]
    cuts = [*starts, len(rendered)]
    splits = [k > 0 and _continues(rendered, cuts, k, opening) for k in range(len(views))]
    try:
        if not all(
            _prefix_agrees(renderer, views, extras, rendered, cuts, k, splits[k])
            for k in _samples(len(views))
        ):
            return whole
    except ValueError:  # a prefix the template refuses: the conversation itself rendered
        return whole
    pieces = []
    for k in range(len(views)):
        text = rendered[cuts[k] : cuts[k + 1]]
        pieces.append((opening, text[len(opening) :]) if splits[k] else (text,))
    return ChatText(pieces=tuple(pieces), tail=opening)


def _continues(rendered: str, cuts: list[int], k: int, opening: str) -> bool:
    """Whether message k's text starts with the generation prompt (so it continues it)."""
    return bool(opening) and rendered.startswith(opening, cuts[k], cuts[k + 1])


def _samples(n: int) -> list[int]:
    """The prefix lengths checked: powers of two and the last two, within [1, n - 1]."""
    powers = {1 << j for j in range(n.bit_length())}
    return sorted(k for k in powers | {n - 1, n - 2} if 1 <= k < n)


def _prefix_agrees(
    renderer: ChatRenderer,
    views: Sequence[View],
    extras: Mapping[str, Any],
    rendered: str,
    cuts: list[int],
    k: int,
    split: bool,
) -> bool:
    """Whether rendering `views[:k]` gives what the cuts say: the text before message k,
    and (with its generation prompt) whether message k continues that prompt."""
    before = renderer.render_views(views[:k], add_generation_prompt=False, extras=extras)
    if len(before) != cuts[k] or not rendered.startswith(before):
        return False
    opened = renderer.render_views(views[:k], add_generation_prompt=True, extras=extras)
    continues = (
        len(before) < len(opened)
        and opened.startswith(before)
        and rendered.startswith(opened, 0, cuts[k + 1])
    )
    return continues == split


def _tracked_render(
    renderer: ChatRenderer, views: Sequence[View], extras: Mapping[str, Any]
) -> tuple[str, list[int] | None]:
    """The conversation rendered without the generation prompt, and the candidate offset
    where each message starts (None if the template's loops do not show them)."""
    clock = _Clock()
    passes: list[list[_Fetch]] = []
    messages = _TrackedMessages(views, clock, passes, range(len(views)))
    chunks = []
    for chunk in renderer.stream_views(messages, add_generation_prompt=False, extras=extras):
        chunks.append(chunk)
        clock.produced += len(chunk)
    return "".join(chunks), _starts(passes, len(views))


def _starts(passes: list[list[_Fetch]], n: int) -> list[int] | None:
    """Message offsets from the loop that produced the most text between its fetches: a
    forward loop over every message, or over all but the first (a system message the
    template prints elsewhere). The first message always starts at 0."""
    if n == 1:
        return [0]
    best: list[int] | None = None
    best_span = -1
    for fetches in passes:
        indices = [f.index for f in fetches]
        if indices not in (list(range(n)), list(range(1, n))):
            continue
        starts = [f.start() for f in fetches]
        if None in starts:
            continue
        span = starts[-1] - starts[0]  # type: ignore[operator]
        if span >= best_span:
            best, best_span = [0, *starts[len(starts) - n + 1 :]], span  # type: ignore[list-item]
    if best is None or any(a > b for a, b in zip(best, best[1:])):
        return None
    return best


class _Clock:
    """How many characters of output the template has produced so far."""

    produced = 0


class _Fetch:
    """One message fetched by a template loop, and how much output existed then."""

    def __init__(self, index: int, at: int, peeked: bool) -> None:
        self.index = index
        self.at = at
        self.peeked = peeked
        self.first_use: int | None = None

    def start(self) -> int | None:
        """Where the loop's turn for this message began. A message fetched early, by
        Jinja's `loop.last` looking one ahead, began when the template first read it."""
        return self.first_use if self.peeked else self.at


class _SeenView(dict):  # type: ignore[type-arg]
    """A message that notes when the template first reads one of its fields."""

    def __init__(self, view: View, fetch: _Fetch, clock: _Clock) -> None:
        super().__init__(view)
        self._fetch = fetch
        self._clock = clock

    def __getitem__(self, key: str) -> Any:
        if self._fetch.first_use is None:
            self._fetch.first_use = self._clock.produced
        return super().__getitem__(key)


class _TrackedMessages(list):  # type: ignore[type-arg]
    """The messages as the template sees them; every loop over them (slices and reversals
    included) is recorded as a pass."""

    def __init__(
        self, views: Sequence[View], clock: _Clock, passes: list[list[_Fetch]], indices: range
    ) -> None:
        super().__init__(views)
        self._clock = clock
        self._passes = passes
        self._indices = indices

    def __iter__(self) -> Iterator[View]:
        return self._loop(list(zip(self._indices, list.__iter__(self))))

    def __reversed__(self) -> Iterator[View]:
        return self._loop(list(zip(self._indices, list.__iter__(self)))[::-1])

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            items = list.__getitem__(self, key)
            return _TrackedMessages(items, self._clock, self._passes, self._indices[key])
        return list.__getitem__(self, key)

    def _loop(self, items: list[tuple[int, View]]) -> Iterator[View]:
        fetches: list[_Fetch] = []
        self._passes.append(fetches)
        for index, view in items:
            fetch = _Fetch(index, self._clock.produced, _peeking())
            fetches.append(fetch)
            yield _SeenView(view, fetch, self._clock)


def _peeking() -> bool:
    """Whether the loop asking for the next message is Jinja's `loop.last` looking ahead
    (frames: this function, the `_loop` generator, the caller of `next`)."""
    return sys._getframe(2).f_code.co_name == "_peek_next"
