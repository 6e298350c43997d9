"""The gateway as a Ray Serve ingress deployment, calling replicas through a handle."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from ray import serve
from ray.exceptions import RayTaskError
from ray.serve.handle import DeploymentHandle

from replicas.protocol import Completion, ReplicaRequest, TokenEvent
from router.gateway import GatewaySettings, create_app

READY_TIMEOUT_S = 2.0


class HandleReplicas:
    """The gateway's `ReplicaClient` over a handle to the replica deployment."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle

    async def generate(self, request: ReplicaRequest) -> Completion:
        try:
            return await self._handle.generate.remote(request)
        except RayTaskError as exc:
            raise exc.cause from None  # the replica's own error (e.g. a bad prompt → 400)

    async def stream(
        self, request: ReplicaRequest
    ) -> AsyncGenerator[TokenEvent | Completion, None]:
        response = self._handle.options(stream=True).stream.remote(request)
        try:
            async for item in response:
                yield item
        except RayTaskError as exc:
            raise exc.cause from None
        finally:
            response.cancel()  # a client that went away stops its generation

    async def ready(self) -> bool:
        try:
            return await asyncio.wait_for(self._handle.ready.remote(), READY_TIMEOUT_S)
        except Exception:
            return False


@serve.ingress()
class GatewayDeployment:
    """OpenAI-compatible HTTP API (CPU only); the ASGI app is built per gateway replica."""

    def __init__(self, settings: GatewaySettings, replicas: DeploymentHandle) -> None:
        self._settings = settings
        self._replicas = HandleReplicas(replicas)

    def __serve_build_asgi_app__(self):
        return create_app(self._settings, self._replicas, ready=self._replicas.ready)
