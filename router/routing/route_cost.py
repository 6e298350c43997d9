"""The routing cost model: for each replica, when would this request get its first token?

Pure functions over plain data, so the router, its tests and a simulator all rank with the
same code. A replica's estimate is its queue (prompt tokens it was sent and has not
finished, plus a fixed cost per request in flight), then the prompt tokens it would still
compute, at its measured prefill speed. A queued request that waits for a state (a prefix
in flight there, or a donor's still being computed) is computed no sooner than that state is
ready: a replica whose queue waits on a donor is busy until then and after, not just for its
queued tokens. Three ways to compute fewer:

- **cached**: it holds a prefix now;
- **in flight**: it is computing a prefix right now (it will not compute it twice: a
  request joining it waits for that state);
- **pull**: another replica holds (or is computing) a longer prefix, and waiting for it,
  then shipping it, pays (`cache_store/pull_cost.pull_pays`, the rule the replica and the
  simulator use too) and beats the replica's other plans; a prefix still being computed
  is waited for even when that is slower than computing it a second time, by up to
  `ShipCost.in_flight_slack` of that computation.

Replicas whose load reaches a bound of `(1 + load_slack)` × the mean come last, so a hot
prefix spreads once its holder is busy instead of piling every request onto it.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace

from baton_serve.cache_store.pull_cost import ShipCost, pull_pays, pull_seconds
from baton_serve.cache_store.wire.route_plan import CACHED, COMPUTE, IN_FLIGHT, PULL


@dataclass(frozen=True)
class Holding:
    """A prefix of the prompt a replica (`holder`) holds (`ready_at` 0) or is computing
    (Unix time it is expected), and the size of the state that holds it. Holdings equal but
    for their holder are one donor."""

    n_tokens: int
    nbytes: int
    ready_at: float = 0.0
    holder: str = field(default="", compare=False)


@dataclass(frozen=True)
class ReplicaState:
    """One candidate replica as the router sees it."""

    replica_id: str
    load: int  # requests in flight there
    queued_tokens: int  # prompt tokens it was sent and has not finished
    prefill_tokens_per_s: float
    holding: Holding | None = None
    pull_bytes_per_s: float | None = None  # its pulls' measured bandwidth (None: not reported)
    # (Unix time, prompt tokens) of queued requests that compute only once the state they
    # reuse is ready then, soonest first; their tokens are among `queued_tokens`
    gated: tuple[tuple[float, int], ...] = ()


@dataclass(frozen=True)
class CostSettings:
    load_slack: float = 0.25
    tokens_per_request: int = 256  # what one request in flight costs beyond its prompt
    ship: ShipCost = ShipCost()  # when a pull pays (the replicas' rule)


@dataclass(frozen=True)
class Estimate:
    """Where a request could go: the estimated time to its first token, how it would get
    its prefix (`plan`), the prompt tokens it would not compute, whether the replica is
    within the load bound, and the holding it reuses (its own, or the donor's for a pull)."""

    replica_id: str
    seconds: float
    plan: str
    reused_tokens: int
    within_bound: bool = True
    holding: Holding | None = None
    prefill_tokens_per_s: float = 0.0  # the replica's, as the estimate counted it
    # Unix time the state it reuses is ready (a donor's, for a pull), if it waits for it
    state_at: float = 0.0
    start_at: float = 0.0  # a pull: Unix time it could compute the prompt itself (0: now)


def estimate(
    replica: ReplicaState,
    n_prompt: int,
    donors: list[Holding],
    now: float,
    settings: CostSettings,
    *,
    within_bound: bool = True,
) -> Estimate:
    """`replica`'s best plan for an `n_prompt`-token prompt; `donors` are other replicas'
    holdings it could pull; `within_bound`: the replica is within the load bound."""
    speed = max(replica.prefill_tokens_per_s, 1e-6)
    own = replica.holding
    reused = own.n_tokens if own else 0
    ready_s = max(own.ready_at - now, 0.0) if own else 0.0
    plan = (IN_FLIGHT if ready_s > 0 else CACHED) if reused else COMPUTE
    seconds = prefill_start(replica, ready_s, now, settings) + (n_prompt - reused) / speed
    state_s = ready_s
    held = reused  # each donor is weighed against what the replica holds itself
    holding = own
    ship, measured = settings.ship, replica.pull_bytes_per_s
    # what the replica's own pulls measured, as it decides by (a new cost only when it can
    # matter: this runs for every candidate of every decision)
    if donors and measured and measured != ship.bandwidth_bytes_per_s:
        ship = replace(ship, bandwidth_bytes_per_s=measured)
    # its own queue, before any prompt: a pull may wait that long at no cost
    busy_s = prefill_start(replica, 0.0, now, settings) if donors else 0.0
    for donor in donors:
        wait_s = max(donor.ready_at - now, 0.0)
        if not pull_pays(donor.n_tokens - held, donor.nbytes, wait_s, speed, ship, busy_s=busy_s):
            continue
        pulled_s = prefill_start(replica, wait_s, now, settings) + pull_seconds(donor.nbytes, ship)
        pulled_s += (n_prompt - donor.n_tokens) / speed
        # computing what a peer is computing right now (`ShipCost.in_flight_slack`)
        duplicate_s = (donor.n_tokens - held) / speed if wait_s > 0 and plan != PULL else 0.0
        if pulled_s < seconds + ship.in_flight_slack * duplicate_s:
            seconds, plan, reused, holding, state_s = pulled_s, PULL, donor.n_tokens, donor, wait_s
    return Estimate(
        replica.replica_id,
        seconds,
        plan,
        reused,
        within_bound=within_bound,
        holding=holding,
        prefill_tokens_per_s=speed,
        state_at=now + state_s if state_s > 0 else 0.0,
        start_at=now + busy_s if plan == PULL and busy_s > 0 else 0.0,
    )


def prefill_start(
    replica: ReplicaState, state_s: float, now: float, settings: CostSettings
) -> float:
    """Seconds until `replica` could start computing a request whose reused state is ready
    `state_s` from now: after its queue — each queued request that waits for a state
    (`ReplicaState.gated`) computed once that is ready, and ahead of this request only if
    it is ready no later (the replica computes requests as their states come)."""
    speed = max(replica.prefill_tokens_per_s, 1e-6)
    # mostly none: this runs for every donor of every candidate
    waiting = sum(tokens for _, tokens in replica.gated) if replica.gated else 0
    start = (replica.queued_tokens - waiting + settings.tokens_per_request * replica.load) / speed
    for at, tokens in replica.gated:
        if at - now > state_s:
            break
        start = max(start, at - now) + tokens / speed
    return max(start, state_s)


def rank(
    replicas: list[ReplicaState], n_prompt: int, now: float, settings: CostSettings
) -> list[Estimate]:
    """Every replica's estimate, best first: those within the load bound by time to first
    token, then the rest by the same."""
    if not replicas:
        return []
    bound = math.ceil(
        (1 + settings.load_slack) * (sum(r.load for r in replicas) + 1) / len(replicas)
    )
    held = [r.holding for r in replicas if r.holding]
    useful = _undominated(held)
    counts = Counter(held)
    alone = {h for h in useful if counts[h] == 1}  # best donors no other replica matches
    estimates = []
    for replica in replicas:
        if replica.holding in alone:
            # its own holding is one of the best donors: rank the others' as they are
            donors = [r.holding for r in replicas if r.holding and r is not replica]
        else:
            donors = useful
        within = replica.load < bound
        estimates.append(estimate(replica, n_prompt, donors, now, settings, within_bound=within))
    return sorted(estimates, key=lambda e: (not e.within_bound, e.seconds, _tie(e, now)))


def _tie(estimate: Estimate, now: float) -> int:
    """Equal estimates (idle replicas holding the same prefix) in an order that changes
    from one decision to the next: by replica id, the same replica won every tie and took
    the most requests of a large cluster."""
    return zlib.crc32(f"{now!r} {estimate.replica_id}".encode())


def _undominated(holdings: list[Holding]) -> list[Holding]:
    """The distinct holdings no other one beats as a donor (at least as long, no larger,
    ready no later): the only ones a pull could choose — so a prefix many replicas hold
    costs each estimate one comparison, not one per replica."""
    kept: list[Holding] = []
    for h in sorted(holdings, key=lambda h: (-h.n_tokens, h.nbytes, h.ready_at)):
        if not any(k.nbytes <= h.nbytes and k.ready_at <= h.ready_at for k in kept):
            kept.append(h)
    return kept
