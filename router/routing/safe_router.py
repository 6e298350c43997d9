"""The base of Baton's Ray Serve request routers, hardened against what measured Ray 2.60
routers get wrong, and the round-robin baseline built on it. The private Ray methods
`SafeRequestRouter` overrides or calls are checked when one is made (`ray_contract`)."""

from __future__ import annotations

import itertools
import logging

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from baton_serve.cache_store.telemetry.logs import request_fields
from baton_serve.cache_store.wire.protocol import ReplicaRequest
from baton_serve.router.routing.by_identity import ByIdentity
from baton_serve.router.routing.ray_contract import check_ray_contract
from baton_serve.router.routing.routing_metrics import record_decision

logger = logging.getLogger("baton.router")


class SafeRequestRouter(RequestRouter):
    """A RequestRouter hardened against Ray 2.60's pitfalls; subclasses implement `rank`.

    - It fulfils the pending request a routing task owns, not the first one sharing its
      internal request id (Ray leaves the second of two sibling calls unrouted).
    - It always asks for backoff, so a full deployment is not polled without pause.
    - An exception in `rank` falls back to load-only ranks (escaping, it hangs the request).
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        check_ray_contract()
        super().__init__(*args, **kwargs)
        self._pending_by_metadata: ByIdentity[object, PendingRequest] = ByIdentity()

    def _add_pending_request_to_indices(self, pending_request: PendingRequest) -> None:
        self._pending_by_metadata.put(pending_request.metadata, pending_request)
        super()._add_pending_request_to_indices(pending_request)

    def _remove_pending_request_from_indices(self, pending_request: PendingRequest) -> None:
        self._pending_by_metadata.pop(pending_request.metadata)
        super()._remove_pending_request_from_indices(pending_request)

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        pending = self._pending_by_metadata.get(request_metadata)
        if pending is None or pending.future.done():
            return
        self._cancel_routing_task_for_pending_request(pending)
        self._record_queue_wait_time(pending)
        pending.future.set_result(replica)
        self.request_routed(pending, replica)
        self._remove_pending_request_from_indices(pending)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        try:
            return await self.rank(candidate_replicas, pending_request)
        except Exception:
            request = replica_request(pending_request)
            extra = request_fields(request.generation.request_id) if request else None
            logger.exception("routing failed; falling back to load-only ranks", extra=extra)
            record_decision("error_fallback")
            return by_load(candidate_replicas)

    async def rank(
        self, candidates: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """Replicas in ranks, best first."""
        raise NotImplementedError

    def request_routed(self, pending_request: PendingRequest, replica: RunningReplica) -> None:
        """`pending_request` goes to `replica` (whichever rank it came from)."""


def replica_load(replica: RunningReplica) -> int:
    """Requests waiting or running on a replica, from its routing stats (slightly stale)."""
    stats = replica.routing_stats or {}
    return int(stats.get("queued", 0)) + int(stats.get("running", 0))


def replica_request(pending_request: PendingRequest | None) -> ReplicaRequest | None:
    """The gateway's request a call carries (None for other calls, e.g. a peer's export)."""
    request = pending_request.args[0] if pending_request and pending_request.args else None
    return request if isinstance(request, ReplicaRequest) else None


def by_load(candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
    """One rank of every candidate, the least loaded first."""
    return [sorted(candidates, key=replica_load)] if candidates else []


class RoundRobinRouter(SafeRequestRouter):
    """Each request to the next replica in turn (a baseline for the routing benchmark)."""

    def initialize_state(self, **_: object) -> None:
        self._turn = itertools.count()

    async def rank(
        self, candidates: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        if not candidates:
            return []
        ordered = sorted(candidates, key=lambda r: r.replica_id.unique_id)
        start = next(self._turn) % len(ordered)
        return [[r] for r in ordered[start:] + ordered[:start]]
