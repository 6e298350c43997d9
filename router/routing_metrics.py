"""Routing decisions by reason, counted in the process the router runs in (each caller's).

Kept out of `request_router`: Ray Serve ships a router's module to callers *by value*,
so module-level state there would be a private copy; functions here are imported by
reference, so every router in a process shares these counts.
"""

from __future__ import annotations

from collections import Counter

_DECISIONS: Counter[str] = Counter()


def record_decision(reason: str) -> None:
    """Count one routing decision: prefix_hit, load_fallback, index_timeout, no_prefix,
    targeted or error_fallback."""
    _DECISIONS[reason] += 1


def decision_counts() -> dict[str, int]:
    return dict(_DECISIONS)
