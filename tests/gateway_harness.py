"""A real gateway over real HTTP for tests: uvicorn serving `create_app` over one replica
of a generated model, in a background thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.replica import Replica
from baton_serve.replicas.wire.protocol import Completion, ReplicaRequest, TokenEvent
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
    engine = Engine(settings.model_path, config, hmac_key=b"k")
    readiness = {"ready": True}

    async def ready() -> bool:
        return readiness["ready"]

    app = create_app(settings, StartedReplica(Replica("r0", engine)), ready=ready)
    try:
        with serve_app(app) as url:
            yield Served(url, engine, readiness)
    finally:
        engine.close()
