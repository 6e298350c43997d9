"""A real gateway over real HTTP for tests: uvicorn serving `create_app` over one replica
of a generated model, in a background thread; and a client that trickles its body."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from baton_serve.cache_store.wire.protocol import Completion, ReplicaRequest, TokenEvent
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.replica import Replica
from baton_serve.router.gateway.gateway import GatewaySettings, create_app


class StartedReplica:
    """A `Replica` as the gateway's `ReplicaClient`, started by its first request on the
    server's event loop."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._started = False

    async def _start(self) -> None:
        if not self._started:
            self._started = True
            await self.replica.start()

    async def generate(self, request: ReplicaRequest) -> Completion:
        await self._start()
        return await self.replica.generate(request)

    async def stream(
        self, request: ReplicaRequest
    ) -> AsyncGenerator[TokenEvent | Completion, None]:
        await self._start()
        async with contextlib.aclosing(self.replica.stream(request)) as items:
            async for item in items:
                yield item


@dataclass
class Served:
    url: str
    engine: Engine
    readiness: dict[str, bool]


@contextlib.contextmanager
def serve_app(app: FastAPI) -> Iterator[str]:
    """Run `app` with uvicorn on a free local port, in a background thread."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextlib.contextmanager
def serving(settings: GatewaySettings, config: EngineConfig) -> Iterator[Served]:
    """The gateway over one replica of the settings' model, served; the engine is closed after."""
    engine = Engine(settings.model_path, config, hmac_key=b"k", mmproj=settings.mmproj)
    readiness = {"ready": True}

    async def ready() -> bool:
        return readiness["ready"]

    app = create_app(settings, StartedReplica(Replica("r0", engine)), ready=ready)
    try:
        with serve_app(app) as url:
            yield Served(url, engine, readiness)
    finally:
        engine.close()


BOUNDED_MODEL = "baton-tiny"  # the served name of `bounded_gateway`'s model


@contextlib.contextmanager
def bounded_gateway(model_path: str) -> Iterator[Served]:
    """The default bounds but a 256 KiB prompt text limit (so a larger text meets it), over
    a two-slot replica of a 1,024-token context: the abuse tests' gateway."""
    settings = GatewaySettings(BOUNDED_MODEL, model_path, n_ctx=1024, max_prompt_bytes=256 << 10)
    with serving(settings, EngineConfig(n_ctx=1024, n_slots=2, n_threads=1)) as served:
        yield served


async def post_slowly(
    url: str,
    body: bytes,
    gap_s: float,
    *,
    keep_alive: bool = True,
    headers: Mapping[str, str] | None = None,
) -> tuple[float, bytes, bool]:
    """POST `body` to the chat endpoint a byte every `gap_s` (headers at once, with its
    Content-Length), as a client trickling its body does, and stop sending once answered:
    the seconds until the server answered, its reply, and whether it then closed the
    connection within 2 s (with `keep_alive`, only the server decides)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    started = time.monotonic()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        b"Content-Type: application/json\r\n"
        + (b"" if keep_alive else b"Connection: close\r\n")
        + "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items()).encode()
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )

    async def trickle() -> None:
        for i in range(len(body)):
            writer.write(body[i : i + 1])
            await writer.drain()
            await asyncio.sleep(gap_s)

    sending = asyncio.create_task(trickle())
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        answered_s = time.monotonic() - started
        sending.cancel()
        length = re.search(rb"(?i)content-length: *(\d+)", head)
        reply = head + await reader.readexactly(int(length[1]) if length else 0)
        try:
            closed = await asyncio.wait_for(reader.read(), 2) == b""
        except ConnectionResetError:  # closed with our bytes unread
            closed = True
        except asyncio.TimeoutError:
            closed = False
    finally:
        sending.cancel()
        writer.close()
    return answered_s, reply, closed
