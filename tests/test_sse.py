"""The one SSE parser (`loadtests/sse.py`): OpenAI streams in, checked events out."""

from __future__ import annotations

import asyncio

import pytest

from baton_serve.loadtests.sse import EventStream, StreamError, aevents, events

CHUNK = '{"choices":[{"index":0,"delta":{"content":"%s"}}]}'


def _lines(*data: str) -> list[bytes]:
    return [f"data: {d}".encode() for d in data]


def test_a_stream_gives_its_events_in_order_skipping_comments_and_blanks() -> None:
    lines = [b": ping", b"", *_lines(CHUNK % "Hel", CHUNK % "lo", "[DONE]")]
    texts = [e["choices"][0]["delta"]["content"] for e in events(lines)]
    assert texts == ["Hel", "lo"]


def test_lines_are_parsed_as_they_arrive() -> None:
    stream = EventStream()
    assert stream.feed("data: " + CHUNK % "a")["choices"][0]["delta"]["content"] == "a"
    assert stream.feed(": keep-alive") is None and not stream.done
    assert stream.feed("data: [DONE]") is None and stream.done
    stream.close()


@pytest.mark.parametrize(
    "lines",
    [
        _lines(CHUNK % "x"),  # no [DONE]
        _lines("{not json", "[DONE]"),
        _lines("[1, 2]", "[DONE]"),
        [b"event: nope", b"data: [DONE]"],
        _lines("[DONE]", CHUNK % "late"),
    ],
    ids=["unfinished", "malformed", "not-an-object", "not-data", "after-done"],
)
def test_broken_streams_are_rejected(lines: list[bytes]) -> None:
    with pytest.raises(StreamError):
        list(events(lines))


def test_an_error_event_carries_the_error() -> None:
    with pytest.raises(StreamError) as caught:
        list(events(_lines('{"error":{"type":"server_error","message":"boom"}}', "[DONE]")))
    assert caught.value.error == {"type": "server_error", "message": "boom"}


def test_the_async_form_checks_the_same_contract() -> None:
    async def source(lines: list[bytes]):
        for line in lines:
            yield line

    async def collect(lines: list[bytes]) -> list[dict]:
        return [event async for event in aevents(source(lines))]

    assert len(asyncio.run(collect(_lines(CHUNK % "a", "[DONE]")))) == 1
    with pytest.raises(StreamError):
        asyncio.run(collect(_lines(CHUNK % "a")))
