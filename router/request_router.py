"""Ray Serve request routers for the replica deployment.

`BatonRouter` sends a request to the replica holding the longest cached prefix of its
prompt (asked of the checkpoint index in one round trip), weighed against load, with a
bounded-load rule so one hot prefix — a shared system prompt — cannot pile every request
onto one replica. It also honours `target_replica=` on a call (`TARGET_REPLICA_KWARG`),
which is how a replica reaches a specific peer to pull its state.

Routers run in the caller's process, on the router's event loop: the lookup is awaited
with a short timeout, never blocking it. `SafeRequestRouter` holds the guards against
what measured Ray 2.60 routers get wrong.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time

from opentelemetry.context import Context
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from baton_serve.cache_store.index import CheckpointIndex, IndexUnavailable
from baton_serve.cache_store.index_connect import connect_cluster_index
from baton_serve.replicas.engine.protocol import TARGET_REPLICA_KWARG, ReplicaRequest
from baton_serve.replicas.telemetry import tracing
from baton_serve.replicas.telemetry.logs import request_fields
from baton_serve.router.routing_metrics import record_decision, record_lookup

logger = logging.getLogger("baton.router")


class SafeRequestRouter(RequestRouter):
    """A RequestRouter hardened against Ray 2.60's pitfalls; subclasses implement `rank`.

    - It fulfils the pending request a routing task owns, not the first one sharing its
      internal request id (Ray leaves the second of two sibling calls unrouted).
    - It always asks for backoff, so a full deployment is not polled without pause.
    - An exception in `rank` falls back to load-only ranks (escaping, it hangs the request).
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._pending_by_metadata: dict[int, PendingRequest] = {}

    def _add_pending_request_to_indices(self, pending_request: PendingRequest) -> None:
        self._pending_by_metadata[id(pending_request.metadata)] = pending_request
        super()._add_pending_request_to_indices(pending_request)

    def _remove_pending_request_from_indices(self, pending_request: PendingRequest) -> None:
        self._pending_by_metadata.pop(id(pending_request.metadata), None)
        super()._remove_pending_request_from_indices(pending_request)

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        pending = self._pending_by_metadata.get(id(request_metadata))
        if pending is None or pending.future.done():
            return
        self._cancel_routing_task_for_pending_request(pending)
        self._record_queue_wait_time(pending)
        pending.future.set_result(replica)
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
            request = _replica_request(pending_request)
            extra = request_fields(request.generation.request_id) if request else None
            logger.exception("routing failed; falling back to load-only ranks", extra=extra)
            record_decision("error_fallback")
            return _by_load(candidate_replicas)

    async def rank(
        self, candidates: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """Replicas in ranks, best first."""
        raise NotImplementedError


def _load(replica: RunningReplica) -> int:
    """Requests waiting or running on a replica, from its routing stats (slightly stale)."""
    stats = replica.routing_stats or {}
    return int(stats.get("queued", 0)) + int(stats.get("running", 0))


def _target_of(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    return pending_request.kwargs.get(TARGET_REPLICA_KWARG)


def _replica_request(pending_request: PendingRequest | None) -> ReplicaRequest | None:
    """The gateway's request a call carries (None for other calls, e.g. a peer's export)."""
    request = pending_request.args[0] if pending_request and pending_request.args else None
    return request if isinstance(request, ReplicaRequest) else None


class BatonRouter(SafeRequestRouter):
    """Prefix- and state-aware routing with bounded load."""

    def initialize_state(
        self,
        *,
        index: str = "embedded",
        fingerprint_hex: str = "",
        lookup_timeout_s: float = 0.02,
        load_slack: float = 0.25,
        tokens_per_queued_request: int = 256,
    ) -> None:
        self._index_spec = index
        self._fingerprint = bytes.fromhex(fingerprint_hex)
        self._lookup_timeout_s = lookup_timeout_s
        self._load_slack = load_slack
        self._tokens_per_queued_request = tokens_per_queued_request
        self._index: CheckpointIndex | None = None
        self._connecting: asyncio.Lock | None = None

    async def rank(
        self, candidates: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        target = _target_of(pending_request)
        if target is not None:
            record_decision("targeted")
            return [[r for r in candidates if r.replica_id.unique_id == target]]
        request = _replica_request(pending_request)
        if request is None:
            record_decision("no_prefix")
            return _by_load(candidates)
        attributes = {
            "baton.request_id": request.generation.request_id,
            "baton.route.candidates": len(candidates),
        }
        parent = tracing.extract(request.trace_context)
        with tracing.span("route", parent=parent, attributes=attributes) as span:
            ranks, reason, cached = await self._decide(
                candidates, request, tracing.context_of(span)
            )
            record_decision(reason)
            if span.is_recording():
                first = ranks[0][0].replica_id.unique_id if ranks and ranks[0] else ""
                span.set_attributes(
                    {
                        "baton.route.reason": reason,
                        "baton.route.replica": first,
                        "baton.route.cached_tokens": cached.get(first, 0),
                    }
                )
            return ranks

    async def _decide(
        self, candidates: list[RunningReplica], request: ReplicaRequest, trace: Context | None
    ) -> tuple[list[list[RunningReplica]], str, dict[str, int]]:
        """Ranks, the reason for them, and each replica's cached prefix length (if known)."""
        if not request.prefix_hashes:
            return _by_load(candidates), "no_prefix", {}
        cached = await self._cached_tokens(request, trace)
        if cached is None:
            return _by_load(candidates), "index_timeout", {}
        if not any(cached.get(r.replica_id.unique_id, 0) for r in candidates):
            return _by_load(candidates), "load_fallback", cached
        n_prompt = len(request.generation.prompt)
        return self._by_prefix(candidates, cached, n_prompt), "prefix_hit", cached

    def _by_prefix(
        self, candidates: list[RunningReplica], cached: dict[str, int], n_prompt: int
    ) -> list[list[RunningReplica]]:
        """Least estimated work first, among replicas within the load bound; then the rest."""
        loads = {r.replica_id.unique_id: _load(r) for r in candidates}
        bound = math.ceil((1 + self._load_slack) * (sum(loads.values()) + 1) / len(candidates))

        def work(replica: RunningReplica) -> int:
            rid = replica.replica_id.unique_id
            return n_prompt - cached.get(rid, 0) + self._tokens_per_queued_request * loads[rid]

        within = sorted((r for r in candidates if loads[r.replica_id.unique_id] < bound), key=work)
        beyond = sorted((r for r in candidates if loads[r.replica_id.unique_id] >= bound), key=work)
        return [[r] for r in within + beyond]

    async def _cached_tokens(
        self, request: ReplicaRequest, trace: Context | None
    ) -> dict[str, int] | None:
        """Replica id → cached prefix length, from one index lookup; None if it timed out."""
        started = time.perf_counter()
        try:
            with tracing.span("index.lookup", parent=trace):
                index = await self._connected_index()
                matches = await asyncio.wait_for(
                    index.lookup(list(request.prefix_hashes)), self._lookup_timeout_s
                )
        except (IndexUnavailable, asyncio.TimeoutError):
            record_lookup(time.perf_counter() - started, ok=False)
            return None
        record_lookup(time.perf_counter() - started, ok=True)
        return {rid: m.n_tokens for rid, m in matches.items()}

    async def _connected_index(self) -> CheckpointIndex:
        if self._index is None:
            self._connecting = self._connecting or asyncio.Lock()
            async with self._connecting:
                if self._index is None:
                    self._index = await connect_cluster_index(
                        self._index_spec, self._fingerprint, timeout_s=self._lookup_timeout_s
                    )
        return self._index


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


def _by_load(candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
    return [sorted(candidates, key=_load)] if candidates else []
