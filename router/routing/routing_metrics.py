"""Routing decisions and index lookups, counted in the process the router runs in (each
caller's: the gateway, or a replica reaching a peer).

Kept out of `request_router`: Ray Serve ships a router's module to callers *by value*,
so module-level state there would be a private copy; functions here are imported by
reference, so every router in a process shares these counts.
"""

from __future__ import annotations

from collections import Counter

from baton_serve.cache_store.telemetry import metrics

ROUTING_DECISIONS = metrics.Counter(
    "baton_routing_decisions",
    "Routing decisions by reason (prefix_hit, in_flight, peer_pull, load_fallback, "
    "index_timeout, no_prefix, targeted, error_fallback)",
    ("reason",),
)

VIEW_AGE = metrics.Gauge(
    "baton_router_index_view_age_seconds",
    "Seconds since the router's copy of the index last heard from the index's change stream",
)
STALE_VIEW_LOOKUPS = metrics.Counter(
    "baton_router_stale_view_lookups",
    "Routing decisions that asked the index directly: the router's copy was synced but older "
    "than its bound (max_view_age_s)",
)
PLANS_UNATTACHED = metrics.Counter(
    "baton_router_plans_unattached",
    "Routing plans the router could not put on the request Ray sent, by reason "
    "(args_not_a_list, no_replica_request_first, replica_not_ranked): its replica decided itself",
    ("reason",),
)

_DECISIONS: Counter[str] = Counter()
_VIEW = {"age_s": 0.0, "stale_lookups": 0.0}  # this process's last age, and its count
_UNATTACHED: Counter[str] = Counter()


def record_decision(reason: str) -> None:
    """Count one routing decision: prefix_hit, in_flight, peer_pull, load_fallback,
    index_timeout, no_prefix, targeted or error_fallback."""
    _DECISIONS[reason] += 1
    ROUTING_DECISIONS.inc(reason=reason)


def record_lookup(seconds: float, *, ok: bool) -> None:
    """One index lookup by the router, answered (`ok`) or not in time."""
    metrics.INDEX_LOOKUP.observe(seconds, caller="router")
    if not ok:
        metrics.INDEX_ERRORS.inc(caller="router")


def decision_counts() -> dict[str, int]:
    return dict(_DECISIONS)


def record_view_age(seconds: float) -> None:
    """The age of the router's copy of the index, now."""
    _VIEW["age_s"] = seconds
    VIEW_AGE.set(seconds)


def record_stale_view() -> None:
    """One decision that distrusted a synced but too old copy of the index."""
    _VIEW["stale_lookups"] += 1
    STALE_VIEW_LOOKUPS.inc()


def view_figures() -> dict[str, float]:
    """The last age recorded (`age_s`) and the stale-copy lookups (`stale_lookups`)."""
    return dict(_VIEW)


def record_unattached_plan(reason: str) -> None:
    """One plan not put on its request (`plan_delivery.attach_plan` says why)."""
    _UNATTACHED[reason] += 1
    PLANS_UNATTACHED.inc(reason=reason)


def unattached_plan_counts() -> dict[str, int]:
    """Plans not put on their request in this process, by reason."""
    return dict(_UNATTACHED)
