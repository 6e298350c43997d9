"""A replica's choices about a request's prefix before it runs, as pure functions that the
replica's `PrefixPuller` and the simulator's replica (`loadtests/sim_replica.py`) both call:
whether the router's plan still holds here, and which peer to pull from when the replica
decides itself (whether that pull pays is `pull_cost.pull_pays`, the router's rule too)."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from baton_serve.cache_store.index.index import IndexMatch
from baton_serve.cache_store.wire.route_plan import CACHED, PULL, RoutePlan

HELD_HERE = "held_here"  # a planned pull would bring too little: enough is held here
STATE_GONE = "state_gone"  # the state a cached plan counts on is not here (evicted)


def stale_plan(plan: RoutePlan, local: int, usable: int, least: int) -> str | None:
    """Why the router's `plan` no longer holds here, given the `local` prompt tokens this
    replica can reuse, `usable` (the most any state can serve: the engine computes the last
    piece itself) and `least` (`ShipCost.min_gain_tokens`): `HELD_HERE`, `STATE_GONE`, or
    None while it holds."""
    if plan.kind == PULL:
        return HELD_HERE if pull_gain(plan.donor_tokens, usable, local) < least else None
    if plan.kind == CACHED:
        return STATE_GONE if pull_gain(plan.reused_tokens, usable, local) >= least else None
    return None


def pull_gain(held: int, usable: int, local: int) -> int:
    """The prompt tokens a state of `held` tokens saves over the `local` ones."""
    return min(held, usable) - local


def best_donor(matches: Mapping[str, IndexMatch], exclude: Collection[str]) -> IndexMatch | None:
    """The index's deepest match on a replica not in `exclude` (a held state before one in
    flight of the same length), or None."""
    peers = [match for replica, match in matches.items() if replica not in exclude]
    return max(peers, key=lambda m: (m.n_tokens, not m.in_flight), default=None)
