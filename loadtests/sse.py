"""OpenAI server-sent-event streams, checked: the one contract every client here applies.

An httpx response is framed by `httpx-sse` (`response_events`, `aresponse_events`); locust's
requests-based client has no httpx response, so its lines go through `events`, which reads
the `data:` lines OpenAI streams are made of. Either way `EventStream` checks the contract as
events arrive — unnamed `data` events only (comments and blank lines skipped), JSON objects,
no error event, nothing after `data: [DONE]`, and `[DONE]` before the end — and returns each
event's JSON object. Plain parsing, no threads, so it is safe under gevent.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator

import httpx
from httpx_sse import EventSource

DONE = "[DONE]"
MESSAGE = "message"  # the event name of a `data:` line without an `event:` line


class StreamError(Exception):
    """The stream broke OpenAI's SSE contract or carried an error event (`error`)."""

    def __init__(self, message: str, error: dict | None = None) -> None:
        super().__init__(message)
        self.error = error


class EventStream:
    """One stream's contract state: `event` (or `feed` a line), then `close` at its end."""

    def __init__(self) -> None:
        self.done = False

    def event(self, name: str, data: str) -> dict | None:
        """The JSON object of one SSE event, or None for `[DONE]`."""
        if self.done:
            raise StreamError(f"data after {DONE}: {data[:80]!r}")
        if name != MESSAGE:
            raise StreamError(f"not an SSE data event: {name!r}")
        if data.strip() == DONE:
            self.done = True
            return None
        try:
            event = json.loads(data)
        except json.JSONDecodeError as exc:
            raise StreamError(f"malformed event: {data[:80]!r}") from exc
        if not isinstance(event, dict):
            raise StreamError(f"event is not an object: {data[:80]!r}")
        if "error" in event:
            error = event["error"] if isinstance(event["error"], dict) else {}
            raise StreamError(f"error event: {event['error']}", error)
        return event

    def feed(self, raw: bytes | str) -> dict | None:
        """The JSON event on this line, or None for a line that carries none: OpenAI streams
        are one `data:` line an event, so a line is an event here."""
        line = (raw.decode("utf-8") if isinstance(raw, bytes) else raw).strip()
        if not line or line.startswith(":"):
            return None
        if self.done:
            raise StreamError(f"data after {DONE}: {line[:80]!r}")
        if not line.startswith("data:"):
            raise StreamError(f"not an SSE data line: {line[:80]!r}")
        return self.event(MESSAGE, line[len("data:") :].strip())

    def close(self) -> None:
        """Raise if the stream ended before `data: [DONE]`."""
        if not self.done:
            raise StreamError(f"stream ended without data: {DONE}")


def events(lines: Iterable[bytes | str]) -> Iterator[dict]:
    """Every JSON event of a complete stream given as lines (locust's), checked."""
    stream = EventStream()
    for line in lines:
        if (event := stream.feed(line)) is not None:
            yield event
    stream.close()


def response_events(response: httpx.Response) -> Iterator[dict]:
    """Every JSON event of a streamed httpx response, framed by httpx-sse, checked."""
    stream = EventStream()
    for sse in EventSource(response).iter_sse():
        if (event := stream.event(sse.event, sse.data)) is not None:
            yield event
    stream.close()


async def aresponse_events(response: httpx.Response) -> AsyncIterator[dict]:
    """`response_events` for an `httpx.AsyncClient` stream."""
    stream = EventStream()
    async for sse in EventSource(response).aiter_sse():
        if (event := stream.event(sse.event, sse.data)) is not None:
            yield event
    stream.close()
