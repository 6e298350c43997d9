"""Routing decisions and index lookups, counted in the process the router runs in (each
caller's: the gateway, or a replica reaching a peer).

Kept out of `request_router`: Ray Serve ships a router's module to callers *by value*,
so module-level state there would be a private copy; functions here are imported by
reference, so every router in a process shares these counts.
"""

from __future__ import annotations

from collections import Counter

from baton_serve.replicas.telemetry import metrics

ROUTING_DECISIONS = metrics.Counter(
    "baton_routing_decisions",
    "Routing decisions by reason (prefix_hit, in_flight, peer_pull, load_fallback, "
    "index_timeout, no_prefix, targeted, error_fallback)",
    ("reason",),
)

_DECISIONS: Counter[str] = Counter()


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
