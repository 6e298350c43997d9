"""How Baton's router weighs replicas, when a prefix state is pulled and what a replica's
state stream takes at once: the `routing` settings of `BatonConfig`. Their defaults are the
runtime's (`CostSettings`, `ShipCost`, the pull deadline, the router's view and lookup
bounds, the state stream receiver's), named here, never written again (and imported from
modules that load neither Ray nor Redis: settings are read before either is needed); the
reasons behind them are docs/routing.md's and docs/index-and-shipping.md's. Router baton
only."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from baton_serve.cache_store.index.index_view import LOOKUP_TIMEOUT_S, MAX_VIEW_AGE_S
from baton_serve.cache_store.pull_cost import PULL_DEADLINE_S, ShipCost
from baton_serve.replicas.stream_limits import ReceiverBounds
from baton_serve.router.routing.route_cost import CostSettings

_COST, _SHIP, _STREAM = CostSettings(), ShipCost(), ReceiverBounds()


class RoutingSettings(BaseModel):
    """Baton's router, the replicas' pulls and their state streams (`routing.*`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    load_slack: float = Field(
        default=_COST.load_slack,
        ge=0,
        le=10,
        allow_inf_nan=False,
        description="replicas whose load reaches (1 + load_slack) × the mean are ranked after "
        "the others, so a hot prefix spreads once its holder is busy (the peer that gets the "
        "request pulls the state); 0 balances load first, a large value follows prefixes "
        "regardless of load",
    )
    tokens_per_queued_request: int = Field(
        default=_COST.tokens_per_request,
        ge=0,
        le=1 << 20,
        description="prompt tokens the router counts for each request in flight at a replica "
        "beyond its prompt (its decode, which the router cannot see ahead)",
    )
    lookup_timeout_s: float = Field(
        default=LOOKUP_TIMEOUT_S,
        gt=0,
        le=5,
        allow_inf_nan=False,
        description="the longest a routing decision waits for a direct index lookup (while "
        "the router's copy of the index is not current); past it the request is routed by "
        "load alone (`baton bench index` at a million entries: lookup p99 1.2 ms on local "
        "Redis, 3.5 ms embedded, max 15 ms)",
    )
    max_view_age_s: float = Field(
        default=MAX_VIEW_AGE_S,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="the router trusts its copy of the index while the copy's change stream "
        "answered within this long; past it each decision looks the index up directly (a "
        "healthy idle copy's age, measured: p99 0.99 s on Redis, 1.97 s embedded)",
    )
    pull_min_gain_tokens: int = Field(
        default=_SHIP.min_gain_tokens,
        ge=0,
        le=1 << 20,
        description="a pull must save at least this many prompt tokens: below it recomputing "
        "is always cheap enough",
    )
    pull_latency_s: float = Field(
        default=_SHIP.latency_s,
        ge=0,
        le=60,
        allow_inf_nan=False,
        description="a pull's fixed cost beyond its bytes (the peer call, the index lookup; "
        "`baton bench ship`: about 0.02 s)",
    )
    pull_safety: float = Field(
        default=_SHIP.safety,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="a pull must take under this share of the recompute it saves (1: the "
        "router ranks pulls against its other plans by one time-to-first-token estimate; a "
        "margin on pulls alone keeps a hot prefix on its busy holder)",
    )
    pull_in_flight_slack: float = Field(
        default=_SHIP.in_flight_slack,
        ge=0,
        le=10,
        allow_inf_nan=False,
        description="a prefix a peer is computing right now is waited for while that takes up "
        "to this share longer than computing it again: a second computation spends a whole "
        "replica's prefill to win the shipping time (`baton bench routing`'s burst: TTFT p50 "
        "9.3-9.7 s computing a new system prompt on both replicas, 8.5-8.8 s on one)",
    )
    pull_deadline_s: float = Field(
        default=PULL_DEADLINE_S,
        gt=0,
        le=600,
        allow_inf_nan=False,
        description="a replica never waits longer than this past the time a peer's state was "
        "expected; then it asks again or computes the prefix itself",
    )

    stream_max_pending: int = Field(
        default=_STREAM.max_pending,
        ge=1,
        le=4096,
        description="connections a replica's state stream reads the opening bytes of at once "
        "(a pull's ticket and the blob's lengths); more are dropped, so stalled peers cannot "
        "hold its sockets",
    )
    stream_max_receivers: int = Field(
        default=_STREAM.max_streams,
        ge=1,
        le=256,
        description="worker threads a replica's state stream receives blobs in at once (each "
        "blob pulled from a peer on another node)",
    )
    stream_ticket_deadline_s: float = Field(
        default=_STREAM.ticket_deadline_s,
        gt=0,
        le=600,
        allow_inf_nan=False,
        description="a stream connection must deliver its opening bytes (ticket and lengths) "
        "within this long of being accepted, however it trickles",
    )

    def ship_cost(self, bandwidth_bytes_per_s: float) -> ShipCost:
        """The pull rule's costs (`pull_pays`) for router and replicas alike."""
        return replace(
            _SHIP,
            min_gain_tokens=self.pull_min_gain_tokens,
            bandwidth_bytes_per_s=bandwidth_bytes_per_s,
            latency_s=self.pull_latency_s,
            safety=self.pull_safety,
            in_flight_slack=self.pull_in_flight_slack,
        )

    def stream_bounds(self) -> ReceiverBounds:
        """What each replica's state-stream receiver takes at once."""
        return ReceiverBounds(
            max_pending=self.stream_max_pending,
            max_streams=self.stream_max_receivers,
            ticket_deadline_s=self.stream_ticket_deadline_s,
        )

    def router_kwargs(self, bandwidth_bytes_per_s: float) -> dict[str, Any]:
        """`BatonRouter.initialize_state`'s settings, as JSON-able data (Serve stores them)."""
        return {
            "load_slack": self.load_slack,
            "tokens_per_queued_request": self.tokens_per_queued_request,
            "lookup_timeout_s": self.lookup_timeout_s,
            "max_view_age_s": self.max_view_age_s,
            "ship_cost": asdict(self.ship_cost(bandwidth_bytes_per_s)),
        }
