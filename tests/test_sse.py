"""OpenAI's SSE contract (`loadtests/sse.py`): streams in — lines, or httpx responses framed
by httpx-sse — checked events out."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from baton_serve.loadtests.sse import (
    EventStream,
    StreamError,
    aresponse_events,
    events,
    response_events,
)

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


def _body(lines: list[bytes]) -> bytes:
    return b"".join(line + b"\n\n" for line in lines)  # one event a line, as servers send


def test_an_httpx_response_is_framed_by_httpx_sse() -> None:
    def response(lines: list[bytes]) -> httpx.Response:
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=_body(lines)
        )

    lines = [b": ping", *_lines(CHUNK % "Hel", CHUNK % "lo", "[DONE]")]
    texts = [e["choices"][0]["delta"]["content"] for e in response_events(response(lines))]
    assert texts == ["Hel", "lo"]
    for broken in ([b"event: nope", b"data: [DONE]"], _lines(CHUNK % "x")):
        with pytest.raises(StreamError):
            list(response_events(response(broken)))


def test_the_async_form_checks_the_same_contract() -> None:
    """Over a real ASGI stream, chunked as it is written."""

    async def stream(request: object) -> StreamingResponse:
        lines = request.query_params.getlist("line")  # type: ignore[attr-defined]
        chunks = (_body([line.encode()]) for line in lines)
        return StreamingResponse(chunks, media_type="text/event-stream")

    app = Starlette(routes=[Route("/", stream)])

    async def collect(lines: list[bytes]) -> list[dict]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sse") as client:
            params = [("line", line.decode()) for line in lines]
            async with client.stream("GET", "/", params=params) as response:
                return [event async for event in aresponse_events(response)]

    assert len(asyncio.run(collect(_lines(CHUNK % "a", "[DONE]")))) == 1
    with pytest.raises(StreamError):
        asyncio.run(collect(_lines(CHUNK % "a")))
