"""The gateway as a Ray Serve ingress deployment, calling replicas through a handle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator

from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from baton_serve.replicas.telemetry.setup import configure_process
from baton_serve.replicas.wire.protocol import Admitted, Completion, ReplicaRequest, TokenEvent
from baton_serve.router.gateway.errors import replica_lost, too_busy
from baton_serve.router.gateway.gateway import GatewaySettings, create_app

READY_TIMEOUT_S = 2.0
ATTEMPTS = 3  # a replica that dies before answering: the request goes to another one

logger = logging.getLogger("baton.gateway")


class HandleReplicas:
    """The gateway's `ReplicaClient` over a handle to the replica deployment."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle

    async def generate(self, request: ReplicaRequest) -> Completion:
        for attempt in range(1, ATTEMPTS + 1):
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
            except RayActorError:
                _log_replica_lost(request, attempt)
        raise replica_lost()

    async def stream(
        self, request: ReplicaRequest
    ) -> AsyncGenerator[Admitted | TokenEvent | Completion, None]:
        for attempt in range(1, ATTEMPTS + 1):
            response = None
            started = False  # the client has tokens: the request cannot be sent again
            try:
                response = self._handle.options(stream=True).stream.remote(request)
                async for batch in response:  # the items ready at once (`stream_batches`)
                    for item in batch:
                        started = started or not isinstance(item, Admitted)
                        yield item
                return
            except RayTaskError as exc:
                raise exc.cause from None
            except BackPressureError as exc:
                raise too_busy(exc) from None
            except RayActorError:
                if started:  # the client has part of a reply: it cannot be sent again
                    raise replica_lost() from None
                _log_replica_lost(request, attempt)
            finally:
                if response is not None:
                    _cancel(response)
        raise replica_lost()

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


def _log_replica_lost(request: ReplicaRequest, attempt: int) -> None:
    logger.warning(
        "replica lost before answering request %s (attempt %d of %d)",
        request.generation.request_id,
        attempt,
        ATTEMPTS,
    )


@serve.ingress()
class GatewayDeployment:
    """OpenAI-compatible HTTP API (CPU only); the ASGI app is built per gateway replica."""

    def __init__(self, settings: GatewaySettings, replicas: DeploymentHandle) -> None:
        configure_process("gateway")
        self._settings = settings
        self._replicas = HandleReplicas(own_handle(replicas))

    def __serve_build_asgi_app__(self):
        return create_app(self._settings, self._replicas, ready=self._replicas.ready)
