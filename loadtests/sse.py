"""The one parser of OpenAI server-sent-event streams that every client here uses.

Incremental: feed it each line as it arrives (bytes or text, from httpx, requests or
locust's gevent client); it returns each event's JSON object and checks the contract as it
goes — `data:` lines only (comments and blank lines skipped), JSON objects, no error event,
nothing after `data: [DONE]`, and `[DONE]` before the end. Plain parsing, no I/O and no
threads, so it is safe under gevent.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

DONE = "[DONE]"


class StreamError(Exception):
    """The stream broke OpenAI's SSE contract or carried an error event (`error`)."""

    def __init__(self, message: str, error: dict | None = None) -> None:
        super().__init__(message)
        self.error = error


class EventStream:
    """One stream's parser state: `feed` lines, then `close` at the end of the stream."""

    def __init__(self) -> None:
        self.done = False

    def feed(self, raw: bytes | str) -> dict | None:
        """The JSON event on this line, or None for a line that carries none."""
        line = (raw.decode("utf-8") if isinstance(raw, bytes) else raw).strip()
        if not line or line.startswith(":"):
            return None
        if self.done:
            raise StreamError(f"data after {DONE}: {line[:80]!r}")
        if not line.startswith("data:"):
            raise StreamError(f"not an SSE data line: {line[:80]!r}")
        data = line[len("data:") :].strip()
        if data == DONE:
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

    def close(self) -> None:
        """Raise if the stream ended before `data: [DONE]`."""
        if not self.done:
            raise StreamError(f"stream ended without data: {DONE}")


def events(lines: Iterable[bytes | str]) -> Iterator[dict]:
    """Every JSON event of a complete stream, checked."""
    stream = EventStream()
    for line in lines:
        if (event := stream.feed(line)) is not None:
            yield event
    stream.close()


async def aevents(lines: AsyncIterable[bytes | str]) -> AsyncIterator[dict]:
    """`events` for an asynchronous line source (httpx's `aiter_lines`)."""
    stream = EventStream()
    async for line in lines:
        if (event := stream.feed(line)) is not None:
            yield event
    stream.close()
