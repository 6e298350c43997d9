"""Whether pulling a prefix state from a peer pays: the one rule the router (`route_cost`),
the replica (`Replica.prepare`, for a request without a plan) and the simulator
(`loadtests/sim_replica.py`) all decide with.

A pull pays a round trip plus the state's bytes over the wire, after waiting for the state
if the peer is still computing it; not pulling pays the prefill of the tokens it would have
given, plus reading what is held locally from disk (which the pull makes unnecessary).
"""

from __future__ import annotations

from dataclasses import dataclass

# Prompt tokens a second a replica is assumed to compute until its engine has measured its
# own (a slow CPU replica's; the engine, the router and the replica's pulls all start here).
ASSUMED_PREFILL_TOKENS_PER_S = 200.0
# A replica never waits longer than this past the time a peer's state was expected.
PULL_DEADLINE_S = 2.0


@dataclass(frozen=True)
class ShipCost:
    """What a pull costs, and how much it must save.

    - `bandwidth_bytes_per_s`: the slowest path measured between replicas (`baton bench
      ship --cross-node`: 0.53 GB/s through Ray's object managers between nodes, what a peer
      that cannot open a stream falls back to; the stream gives 1.21 GB/s, one node 2.44).
      A replica replaces it with what its own pulls measure (`ShipPolicy`).
    - `latency_s`: a pull's fixed cost beyond the bytes (the peer call, the index lookup;
      `bench ship`: ship s - move s ≈ 0.02 s more per pull).
    - `safety`: a pull must take under this share of the recompute it saves. 1: the
      router ranks pulls against its other plans by the same time-to-first-token estimate
      (a margin on pulls alone would keep a hot prefix on its busy holder instead of
      spreading it), and a lost bet is bounded already — a pull never waits past the
      recompute estimate (`ShipPolicy.deadline`). Measured pulls cost 0.7-5% of the
      recompute (`bench ship`), so the margin decides only near the line.
    - `min_gain_tokens`: below this, recomputing is always cheap enough.
    - `in_flight_slack`: a state a peer is computing right now is waited for while that
      takes up to this share longer than computing it again. Computing it a second time
      spends a second replica's whole prefill to win at most this share of it (waiting
      is the pull's ship time slower when the estimates are right); on `bench routing`'s
      burst, two replicas on one machine computing a new system prompt each were slower
      than one computing it while the other waited (docs/benchmarks.md).
    """

    min_gain_tokens: int = 64
    bandwidth_bytes_per_s: float = 500e6
    latency_s: float = 0.02
    safety: float = 1.0
    in_flight_slack: float = 0.25


def pull_seconds(nbytes: int, cost: ShipCost) -> float:
    """Seconds to move a state of `nbytes` from a peer."""
    return cost.latency_s + nbytes / cost.bandwidth_bytes_per_s


def pull_budget_s(
    gain_tokens: int,
    wait_s: float,
    prefill_tokens_per_s: float,
    cost: ShipCost,
    busy_s: float = 0.0,
) -> float:
    """How long from now getting `gain_tokens` from a peer may take: `busy_s` (the time
    before this replica could start computing them itself: its own queue), plus
    `cost.safety` × computing them here, × (1 + `cost.in_flight_slack`) while the peer is
    still computing them (`wait_s` > 0)."""
    recompute_s = gain_tokens / max(prefill_tokens_per_s, 1e-6)
    slack = 1.0 + cost.in_flight_slack if wait_s > 0 else 1.0
    return busy_s + cost.safety * slack * recompute_s


def pull_pays(
    gain_tokens: int,
    nbytes: int,
    wait_s: float,
    prefill_tokens_per_s: float,
    cost: ShipCost,
    local_restore_s: float = 0.0,
    busy_s: float = 0.0,
) -> bool:
    """True when waiting `wait_s` for a peer's state, then pulling its `nbytes`, takes
    under the budget (`pull_budget_s`) for the `gain_tokens` it gives beyond what is held
    here, plus `local_restore_s` (reading what is held here from disk, which the pull
    saves). A replica busy for `busy_s` could not compute them before then either: a state
    a peer is computing is worth waiting for while it is ready no later than this replica
    would have computed it (with the slack)."""
    if gain_tokens < cost.min_gain_tokens:
        return False
    budget_s = pull_budget_s(gain_tokens, wait_s, prefill_tokens_per_s, cost, busy_s)
    return wait_s + pull_seconds(nbytes, cost) < budget_s + local_restore_s
