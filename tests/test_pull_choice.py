"""A replica's choices about a request's prefix (`pull_choice`): whether the router's plan
still holds, and which peer to pull from; the replica and the simulator call these same
functions."""

from __future__ import annotations

from baton_serve.cache_store.index.index import IndexMatch
from baton_serve.cache_store.wire.route_plan import CACHED, COMPUTE, PULL, RoutePlan
from baton_serve.loadtests import sim_replica
from baton_serve.replicas import prefix_pull
from baton_serve.replicas import pull_choice as choice


def plan(kind: str, **fields: object) -> RoutePlan:
    return RoutePlan(replica_id="here", kind=kind, **fields)


def test_a_planned_pull_that_would_bring_too_little_is_held_here() -> None:
    pull = plan(PULL, donor_id="d", donor_tokens=1000)
    assert choice.stale_plan(pull, local=0, usable=998, least=64) is None
    assert choice.stale_plan(pull, local=950, usable=998, least=64) == choice.HELD_HERE
    assert choice.pull_gain(1000, 998, 0) == 998  # never the prompt's last piece


def test_a_cached_plan_whose_state_is_gone_is_stale() -> None:
    cached = plan(CACHED, reused_tokens=800)
    assert choice.stale_plan(cached, local=800, usable=998, least=64) is None
    assert choice.stale_plan(cached, local=100, usable=998, least=64) == choice.STATE_GONE
    assert choice.stale_plan(plan(COMPUTE), local=0, usable=998, least=64) is None


def test_the_deepest_donor_wins_and_a_held_state_beats_one_in_flight() -> None:
    held = IndexMatch("a", b"h", 512, 10)
    in_flight = IndexMatch("b", b"h", 512, 10, ready_at=5.0)
    deeper = IndexMatch("c", b"h", 640, 10)
    assert choice.best_donor({"b": in_flight, "a": held}, exclude=()) is held
    assert choice.best_donor({"a": held, "c": deeper}, exclude=("c",)) is held
    assert choice.best_donor({"here": held}, exclude=("here",)) is None


def test_the_replica_and_the_simulator_choose_with_the_same_functions() -> None:
    for name in ("stale_plan", "pull_gain", "best_donor"):
        assert getattr(prefix_pull, name) is getattr(sim_replica, name) is getattr(choice, name)
