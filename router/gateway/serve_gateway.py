"""The gateway as a Ray Serve ingress deployment, calling replicas through a handle."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator

from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from baton_serve.cache_store.telemetry.setup import configure_process
from baton_serve.cache_store.wire.protocol import Admitted, Completion, ReplicaRequest, TokenEvent
from baton_serve.router.gateway.api_key_source import APIKeySource
from baton_serve.router.gateway.errors import too_busy
from baton_serve.router.gateway.gateway import GatewaySettings, create_app
from baton_serve.router.gateway.poison_requests import PoisonQuarantine, QuarantineSettings

READY_TIMEOUT_S = 2.0


class HandleReplicas:
    """The gateway's `ReplicaClient` over a handle to the replica deployment.

    A call is never resent here. Serve's router sends a call again itself until a replica
    accepts it (Serve's strict `max_ongoing_requests`: each replica confirms or refuses a
    call; a replica gone when chosen never confirms); a Ray actor error that reaches this code
    came after a replica accepted the call: it died running it (`poison_requests`)."""

    def __init__(self, handle: DeploymentHandle, quarantine: PoisonQuarantine) -> None:
        self._handle = handle
        self._quarantine = quarantine

    async def generate(self, request: ReplicaRequest) -> Completion:
        self._quarantine.check(request.generation)
        response = self._handle.generate.remote(request)
        try:
            return await response
        except asyncio.CancelledError:  # a sibling failed, or the client went away
            _cancel(response)
            raise
        except RayTaskError as exc:
            raise exc.cause from None  # the replica's own error (e.g. a bad prompt → 400)
        except BackPressureError as exc:
            raise too_busy(exc) from None  # as an OpenAI error (Serve's own is plain text)
        except RayActorError as exc:
            raise self._quarantine.lost(request.generation, exc) from None

    async def stream(
        self, request: ReplicaRequest
    ) -> AsyncGenerator[Admitted | TokenEvent | Completion, None]:
        self._quarantine.check(request.generation)
        response = self._handle.options(stream=True).stream.remote(request)
        try:
            async for batch in response:  # the items ready at once (`stream_batches`)
                for item in batch:
                    yield item
        except RayTaskError as exc:
            raise exc.cause from None
        except BackPressureError as exc:
            raise too_busy(exc) from None
        except RayActorError as exc:
            raise self._quarantine.lost(request.generation, exc) from None
        finally:
            _cancel(response)

    async def ready(self) -> bool:
        try:
            return await asyncio.wait_for(self._handle.ready.remote(), READY_TIMEOUT_S)
        except Exception:
            return False


def _cancel(response: DeploymentResponseGenerator) -> None:
    """Stop the call (a client that went away stops its generation). Ray's `cancel` first
    fetches the call's assignment and re-raises its failure (backpressure, a dead replica):
    already handled here, it must not replace the error being answered."""
    with contextlib.suppress(Exception):
        response.cancel()


def own_handle(handle: DeploymentHandle) -> DeploymentHandle:
    """A handle to `handle`'s deployment as this process makes one. The handle Serve passes
    to a deployment was made by the driver, with the driver's transport (Ray actor calls);
    this process's follows the cluster's `SERVE_PROCESS_ENV` (gRPC)."""
    return serve.get_deployment_handle(handle.deployment_name, handle.app_name)


@serve.ingress()
class GatewayDeployment:
    """OpenAI-compatible HTTP API (CPU only); the ASGI app is built per gateway replica.
    The API keys are read here, on the gateway's node, from where `keys` says: Serve stores
    a deployment's arguments."""

    def __init__(
        self,
        settings: GatewaySettings,
        replicas: DeploymentHandle,
        keys: APIKeySource,
        quarantine: QuarantineSettings,
    ) -> None:
        configure_process("gateway")
        self._settings = dataclasses.replace(settings, api_keys=keys.read())
        self._replicas = HandleReplicas(own_handle(replicas), PoisonQuarantine(quarantine))

    def __serve_build_asgi_app__(self):
        return create_app(self._settings, self._replicas, ready=self._replicas.ready)
