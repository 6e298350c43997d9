"""Baton's Ray Serve request router for the replica deployment.

`BatonRouter` sends a request where its first token is expected soonest (`route_cost`):
to the replica holding — or computing right now — the longest prefix of its prompt, or
to an idle one that will pull it, under a bounded-load rule so one hot prefix cannot pile
every request onto one replica. What replicas hold comes from this router's own copy of
the checkpoint index (`IndexView`, kept current by the index's change stream; one direct
lookup while it is not, or while it has not heard from the stream for `max_view_age_s`),
merged with what this router itself just sent where (`RoutingLedger`), which also gives
exact in-flight counts per replica. The decision travels with the request: for the
replica Ray picked, `request_routed` (before Ray sends it) puts that replica's `RoutePlan`
on it (`plan_delivery`) — cached, in flight, pull from which donor, or compute — which the
replica executes instead of deciding again. It honours `target_replica=` on a call
(`TARGET_REPLICA_KWARG`), which is how a replica reaches a specific peer to pull its state.

Routers run in the caller's process, on the router's event loop: nothing here blocks it;
their background tasks (the index follower, the copy's age) are `supervised`. Its base,
`SafeRequestRouter` (`safe_router`), holds the guards against what measured Ray 2.60 routers
get wrong.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry.context import Context
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from baton_serve.cache_store.index.index import CheckpointIndex, IndexMatch, IndexUnavailable
from baton_serve.cache_store.index.index_connect import connect_cluster_index
from baton_serve.cache_store.index.index_view import LOOKUP_TIMEOUT_S, MAX_VIEW_AGE_S, IndexView
from baton_serve.cache_store.pull_cost import ASSUMED_PREFILL_TOKENS_PER_S, ShipCost
from baton_serve.cache_store.supervised import supervised
from baton_serve.cache_store.telemetry import tracing
from baton_serve.cache_store.wire.protocol import TARGET_REPLICA_KWARG, ReplicaRequest
from baton_serve.router.routing.by_identity import ByIdentity
from baton_serve.router.routing.plan_delivery import attach_plan
from baton_serve.router.routing.route_cost import CostSettings, Estimate, ReplicaState
from baton_serve.router.routing.route_decision import (
    decide,
    merge_ledger,
    plan_of,
    record_sent,
    replica_state,
)
from baton_serve.router.routing.routing_ledger import RoutingLedger
from baton_serve.router.routing.routing_metrics import (
    record_decision,
    record_lookup,
    record_stale_view,
    record_view_age,
)
from baton_serve.router.routing.safe_router import (
    SafeRequestRouter,
    by_load,
    replica_load,
    replica_request,
)

logger = logging.getLogger("baton.router")

VIEW_AGE_REPORT_S = 1.0


def _prefill_speed(replica: RunningReplica) -> float:
    """The prefill speed a replica reports (0: not measured yet)."""
    return float((replica.routing_stats or {}).get("prefill_tokens_per_s") or 0.0)


def _target_of(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    return pending_request.kwargs.get(TARGET_REPLICA_KWARG)


class BatonRouter(SafeRequestRouter):
    """Prefix- and state-aware routing with bounded load (see `route_cost`)."""

    def initialize_state(
        self,
        *,
        index: str = "embedded",
        fingerprint_hex: str = "",
        block_tokens: int = 64,
        every_block: bool = True,
        lookup_timeout_s: float = LOOKUP_TIMEOUT_S,
        load_slack: float = CostSettings.load_slack,
        tokens_per_queued_request: int = CostSettings.tokens_per_request,
        prefill_tokens_per_s: float = ASSUMED_PREFILL_TOKENS_PER_S,
        ship_cost: Mapping[str, float] | None = None,
        follow_index: bool = True,
        max_view_age_s: float = MAX_VIEW_AGE_S,
    ) -> None:
        """Serve's `request_router_kwargs` (`deploy.routing_settings.RoutingSettings`);
        `ship_cost`: `ShipCost`'s fields, the replicas' pull rule."""
        if max_view_age_s <= 0:
            raise ValueError(f"max_view_age_s must be > 0, got {max_view_age_s}")
        self._index_spec = index
        self._fingerprint = bytes.fromhex(fingerprint_hex)
        self._lookup_timeout_s = lookup_timeout_s
        self._settings = CostSettings(
            load_slack=load_slack,
            tokens_per_request=tokens_per_queued_request,
            ship=ShipCost(**ship_cost) if ship_cost else ShipCost(),
        )
        self._default_prefill_speed = prefill_tokens_per_s
        self._index: CheckpointIndex | None = None
        self._connecting: asyncio.Lock | None = None
        self._view = IndexView()
        self._follow_index = follow_index
        self._follower: asyncio.Task[None] | None = None
        self._ledger = RoutingLedger(block_tokens, every_block=every_block)
        self._max_view_age_s = max_view_age_s
        self._age_reporter: asyncio.Task[None] | None = None
        # a pending request's metadata -> its estimates (by identity, never a reused id)
        self._decisions: ByIdentity[object, _Decision] = ByIdentity()

    @property
    def view(self) -> IndexView:
        """This router's copy of the index (synced once its change stream is followed)."""
        return self._view

    async def rank(
        self, candidates: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        target = _target_of(pending_request)
        if target is not None:
            record_decision("targeted")
            return [[r for r in candidates if r.replica_id.unique_id == target]]
        request = replica_request(pending_request)
        if request is None:
            record_decision("no_prefix")
            return by_load(candidates)
        assert pending_request is not None
        attributes = {
            "baton.request_id": request.generation.request_id,
            "baton.route.candidates": len(candidates),
        }
        parent = tracing.extract(request.trace_context)
        with tracing.span("route", parent=parent, attributes=attributes) as span:
            trusted = self._view.trusted(self._max_view_age_s)
            span.set_attribute("baton.route.index", "copy" if trusted else "lookup")
            estimates, reason = await self._decide(candidates, request, tracing.context_of(span))
            self._record_decision(pending_request, request, estimates)
            record_decision(reason)
            if span.is_recording() and estimates:
                span.set_attributes(
                    {
                        "baton.route.reason": reason,
                        "baton.route.replica": estimates[0].replica_id,
                        "baton.route.cached_tokens": estimates[0].reused_tokens,
                    }
                )
        by_id = {r.replica_id.unique_id: r for r in candidates}
        return [[by_id[e.replica_id]] for e in estimates]

    async def _decide(
        self, candidates: list[RunningReplica], request: ReplicaRequest, trace: Context | None
    ) -> tuple[list[Estimate], str]:
        """Each candidate's estimate, best first, and the reason for the first."""
        holdings: dict[str, IndexMatch] = {}
        reason = "no_prefix"
        if request.prefix_hashes:
            found = await self._holdings(request.prefix_hashes, trace)
            if found is None:  # the index did not answer: this router's own decisions only
                reason, holdings = "index_timeout", self._ledger.lookup(request.prefix_hashes)
            else:
                reason, holdings = "load_fallback", found
        # a replica that has not measured its prefill yet is taken at its measured peers'
        # mean: at the default figure it could look far faster and draw a whole burst
        speeds = [_prefill_speed(r) for r in candidates]
        known = [speed for speed in speeds if speed]
        unmeasured = sum(known) / len(known) if known else self._default_prefill_speed
        states = [
            self._state(r, holdings.get(r.replica_id.unique_id), speed or unmeasured)
            for r, speed in zip(candidates, speeds, strict=True)
        ]
        n_prompt = len(request.generation.prompt)
        return decide(states, n_prompt, time.time(), self._settings, reason)

    def _state(
        self, replica: RunningReplica, match: IndexMatch | None, speed: float
    ) -> ReplicaState:
        stats = replica.routing_stats or {}
        sampled_at = stats.get("sampled_at")
        return replica_state(
            replica.replica_id.unique_id,
            self._ledger,
            replica_load(replica),
            speed,
            match,
            reported_at=float(sampled_at) if sampled_at is not None else None,
            pull_bytes_per_s=float(stats.get("pull_bytes_per_s") or 0.0) or None,
        )

    async def _holdings(
        self, chain: tuple[bytes, ...], trace: Context | None
    ) -> dict[str, IndexMatch] | None:
        """Replica id → its best match for `chain`: the index (this router's copy of it,
        or one lookup while the copy is not synced or is older than `max_view_age_s`) merged
        with this router's own recent decisions. None if the index did not answer in time."""
        self._start_following()
        started = time.perf_counter()
        if self._view.trusted(self._max_view_age_s):
            matches = self._view.lookup(chain)
        else:
            if self._view.synced:
                record_stale_view()
            try:
                with tracing.span("index.lookup", parent=trace):
                    index = await self._connected_index()
                    matches = await asyncio.wait_for(index.lookup(chain), self._lookup_timeout_s)
            except (IndexUnavailable, asyncio.TimeoutError):
                record_lookup(time.perf_counter() - started, ok=False)
                return None
        record_lookup(time.perf_counter() - started, ok=True)
        return merge_ledger(matches, self._ledger.lookup(chain))

    def _start_following(self) -> None:
        if self._follow_index and self._follower is None:
            self._follower = supervised("router.index_follower", self._follow)
            self._age_reporter = supervised("router.index_view_age", self._report_age)

    async def _follow(self) -> None:
        """Keep this router's copy of the index current (retrying while it cannot connect);
        on any other failure the supervisor logs it and starts this again."""
        try:
            while True:
                try:
                    index = await self._connected_index()
                except IndexUnavailable:
                    await asyncio.sleep(1.0)
                    continue
                await index.follow(self._view)
        finally:
            self._view.lost()  # nothing keeps it current now

    async def _report_age(self) -> None:
        """Publish the copy's age, and log each time it crosses `max_view_age_s`."""
        stale = False
        while True:
            age = self._view.age
            record_view_age(age)
            if (age > self._max_view_age_s) != stale:
                stale = not stale
                if stale:
                    logger.warning(
                        "index copy: nothing heard from the change stream for %.1f s "
                        "(max_view_age_s %g): routing by direct index lookups",
                        age,
                        self._max_view_age_s,
                    )
                else:
                    logger.info("index copy: the change stream answers again")
            await asyncio.sleep(VIEW_AGE_REPORT_S)

    async def _connected_index(self) -> CheckpointIndex:
        if self._index is None:
            self._connecting = self._connecting or asyncio.Lock()
            async with self._connecting:
                if self._index is None:
                    self._index = await connect_cluster_index(
                        self._index_spec, self._fingerprint, timeout_s=self._lookup_timeout_s
                    )
        return self._index

    # ---- what this router sent where -----------------------------------------------------

    def _record_decision(
        self, pending_request: PendingRequest, request: ReplicaRequest, estimates: list[Estimate]
    ) -> None:
        """Count the request for its first-ranked replica at once — the next decision, a
        moment later in the same burst, must see it — replacing an earlier attempt's."""
        key = pending_request.metadata.internal_request_id
        earlier = self._decisions.pop(pending_request.metadata)
        if earlier is not None:
            self._ledger.withdraw(earlier.replica_id, key)
        if estimates:
            self._decisions.put(pending_request.metadata, _Decision(request, estimates))
            self._send(estimates[0], request, key)

    def _send(self, chosen: Estimate, request: ReplicaRequest, key: str) -> None:
        prompt = request.generation.prompt
        held = self._ledger.entries_for(prompt, request.prefix_hashes)
        record_sent(self._ledger, chosen, key, len(prompt), held, time.time())

    def request_routed(self, pending_request: PendingRequest, replica: RunningReplica) -> None:
        """Ray sends it to `replica` (it has not yet): move the record there if that was not
        the first rank, and put that replica's plan on the request it is sent (`attach_plan`)."""
        decision = self._decisions.pop(pending_request.metadata)
        if decision is None:
            return
        rid = replica.replica_id.unique_id
        chosen = next((e for e in decision.estimates if e.replica_id == rid), None)
        if rid != decision.replica_id:
            key = pending_request.metadata.internal_request_id
            self._ledger.withdraw(decision.replica_id, key)
            if chosen is not None:
                self._send(chosen, decision.request, key)
        attach_plan(pending_request, plan_of(chosen) if chosen is not None else None)

    def _remove_pending_request_from_indices(self, pending_request: PendingRequest) -> None:
        decision = self._decisions.pop(pending_request.metadata)
        if decision is not None:  # it was never sent (cancelled)
            self._ledger.withdraw(decision.replica_id, pending_request.metadata.internal_request_id)
        super()._remove_pending_request_from_indices(pending_request)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._ledger.completed(replica_id.unique_id, internal_request_id)
        super().on_request_completed(replica_id, internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self._ledger.forget_replica(replica_id.unique_id)
        super().on_replica_actor_died(replica_id)


@dataclass(frozen=True)
class _Decision:
    """A decision recorded in the ledger: the request, and every replica's estimate."""

    request: ReplicaRequest
    estimates: list[Estimate]

    @property
    def replica_id(self) -> str:
        """Where the ledger counts it (the first rank)."""
        return self.estimates[0].replica_id
