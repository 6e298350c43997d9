"""One routing decision of `BatonRouter`, over plain data: what each replica holds (the
index merged with the router's ledger), each replica's state, the ranking and its reason,
the plan the chosen replica is sent (`plan_of`), and recording the choice in the ledger.

No Ray here, so the cluster simulator (`loadtests/sim_policies.py`) decides with exactly
the code the router runs.
"""

from __future__ import annotations

from dataclasses import replace

from baton_serve.cache_store.index.index import IndexMatch, better_match
from baton_serve.cache_store.wire.route_plan import RoutePlan
from baton_serve.router.routing.route_cost import (
    CACHED,
    IN_FLIGHT,
    PULL,
    CostSettings,
    Estimate,
    Holding,
    ReplicaState,
    rank,
)
from baton_serve.router.routing.routing_ledger import RoutingLedger

REASONS = {CACHED: "prefix_hit", IN_FLIGHT: "in_flight", PULL: "peer_pull"}  # what it reuses


def merge_ledger(
    matches: dict[str, IndexMatch], mine: dict[str, IndexMatch]
) -> dict[str, IndexMatch]:
    """The index's `matches` (updated in place and returned) with the router's own recent
    decisions (`mine`, from its ledger) where they go deeper."""
    for rid, match in mine.items():
        if better_match(match.n_tokens, match.ready_at, matches.get(rid)):
            known = matches.get(rid)
            matches[rid] = match if known is None else replace(match, nbytes=known.nbytes)
    return matches


def replica_state(
    replica_id: str,
    ledger: RoutingLedger,
    reported_load: int,
    prefill_tokens_per_s: float,
    match: IndexMatch | None,
    reported_at: float | None = None,
    pull_bytes_per_s: float | None = None,
) -> ReplicaState:
    """A candidate as the cost model sees it: its in-flight count (the ledger's, with the
    other callers' share of the replica's own report sampled at `reported_at`,
    `RoutingLedger.load_given_report`), the ledger's queued tokens and which of them wait
    for a state, its best match, and the bandwidth its pulls measured (as reported; None:
    the router's configured figure)."""
    holding = Holding(match.n_tokens, match.nbytes, match.ready_at, replica_id) if match else None
    return ReplicaState(
        replica_id=replica_id,
        load=ledger.load_given_report(replica_id, reported_load, reported_at),
        queued_tokens=ledger.queued_tokens(replica_id),
        prefill_tokens_per_s=prefill_tokens_per_s,
        holding=holding,
        pull_bytes_per_s=pull_bytes_per_s,
        gated=ledger.gated(replica_id),
    )


def decide(
    states: list[ReplicaState], n_prompt: int, now: float, settings: CostSettings, reason: str
) -> tuple[list[Estimate], str]:
    """Every candidate's estimate, best first, and the reason for the first: what it
    reuses, or `reason` (why it reuses nothing) when it reuses nothing."""
    estimates = rank(states, n_prompt, now, settings)
    if estimates and estimates[0].reused_tokens and reason == "load_fallback":
        reason = REASONS[estimates[0].plan]
    return estimates, reason


def plan_of(chosen: Estimate) -> RoutePlan:
    """What the replica `chosen` names is told to do: reuse its own holding (cached or in
    flight), pull the donor's, or compute."""
    held = chosen.holding
    if chosen.plan == PULL and held is not None:
        return RoutePlan(
            replica_id=chosen.replica_id,
            kind=PULL,
            reused_tokens=chosen.reused_tokens,
            donor_id=held.holder,
            donor_tokens=held.n_tokens,
            nbytes=held.nbytes,
            ready_at=held.ready_at,
            start_at=chosen.start_at,
        )
    return RoutePlan(
        replica_id=chosen.replica_id,
        kind=chosen.plan,
        reused_tokens=chosen.reused_tokens,
        nbytes=held.nbytes if held else 0,
        ready_at=held.ready_at if held else 0.0,
    )


def record_sent(
    ledger: RoutingLedger,
    chosen: Estimate,
    key: str,
    n_prompt: int,
    held: list[tuple[bytes, int]],
    now: float,
) -> None:
    """Count a request for the replica `chosen` names: the prompt tokens it computes
    there, and the prefixes (`held`, `RoutingLedger.entries_for`) it leaves, each in
    flight until the estimate says the replica's prefill passes it."""
    ledger.sent(
        chosen.replica_id,
        key,
        held,
        tokens=n_prompt - chosen.reused_tokens,
        ready_at=now + chosen.seconds,
        reused=chosen.reused_tokens,
        prefill_tokens_per_s=chosen.prefill_tokens_per_s,
        state_at=chosen.state_at,
    )
