"""The benchmarks' HTTP client (`loadtests/bench_http.py`) and how `bench peer` lives with a
server that drops a request: sent once more when no response came at all, otherwise counted
as that request's error — never the end of the run.

The fault is a server closing a kept-alive connection as a request arrives (llama-server did
so once in about 50 requests on `bench peer`). It cannot be caused on demand in a real
server, so a raw asyncio TCP server stands in: it reads each request and then either closes
the connection without a byte, or answers with a real OpenAI-style SSE stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

import pytest

from baton_serve.loadtests.bench_http import IDLE_CONNECTION_S, bench_client
from baton_serve.loadtests.peer_play import PeerRecord, _stream_chat

UPSTREAM_KEEPALIVE_S = 5.0  # cpp-httplib's and uvicorn's default idle timeout


def _sse_reply(text: str) -> bytes:
    chunks = [{"choices": [{"index": 0, "delta": {"content": word}}]} for word in text.split(" ")]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    head = (
        f"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return (head + body).encode()


async def _read_request(reader: asyncio.StreamReader) -> bool:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    await reader.readexactly(length)
    return True


class DroppingServer:
    """Answers request k with the reply, or closes its connection unanswered where
    `drops(k)` says so."""

    def __init__(self, drops: Callable[[int], bool]) -> None:
        self.drops = drops
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await _read_request(reader):
                self.requests += 1
                if self.drops(self.requests):
                    break
                writer.write(_sse_reply("hello there"))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def _serve(server: DroppingServer) -> AsyncIterator[str]:
    tcp = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = tcp.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        tcp.close()


async def _one_request(server: DroppingServer) -> tuple[PeerRecord, str]:
    record = PeerRecord("peer", "chat", 0, 0, 0)
    async with _serve(server) as url:
        async with bench_client(30.0) as http:
            text = await _stream_chat(
                http, url, {"stream": True}, record, "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
            )
    return record, text


def test_a_request_dropped_unanswered_is_sent_once_more() -> None:
    server = DroppingServer(drops=lambda k: k == 1)
    record, text = asyncio.run(_one_request(server))
    assert server.requests == 2
    assert record.error is None and text == "hellothere"
    assert record.ttft_s is not None and record.completion_tokens == 2


def test_a_request_dropped_twice_is_that_requests_error_not_the_runs() -> None:
    server = DroppingServer(drops=lambda k: True)
    record, text = asyncio.run(_one_request(server))
    assert server.requests == 2  # one retry, no more
    assert text == "" and record.ttft_s is None
    assert record.error is not None and record.error.startswith("RemoteProtocolError")


def test_idle_connections_are_dropped_before_servers_drop_them() -> None:
    assert IDLE_CONNECTION_S < UPSTREAM_KEEPALIVE_S


@pytest.mark.parametrize("keepalive", [20, 500])
def test_the_client_keeps_what_it_is_asked_to(keepalive: int) -> None:
    async def limits() -> tuple[int | None, float | None]:
        async with bench_client(5.0, keepalive=keepalive) as http:
            pool = http._transport._pool  # type: ignore[attr-defined]
            return pool._max_keepalive_connections, pool._keepalive_expiry

    assert asyncio.run(limits()) == (keepalive, IDLE_CONNECTION_S)
