"""The routing cost model and the router's ledger, on their own: bursts spread evenly, a
hot prefix stays within its load bound, in-flight prefixes are joined or waited for, and
what this router sent shows at once. (No Ray cluster here: the router is built as Ray
builds one and called directly; the Serve tests route real requests with it.)"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

from baton_serve.cache_store.prefix_hash import PrefixHasher
from baton_serve.cache_store.pull_cost import ShipCost, pull_pays
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import GenerationRequest, ReplicaRequest
from baton_serve.deploy.config import BatonConfig
from baton_serve.loadtests import sim_replica
from baton_serve.replicas import shipping
from baton_serve.replicas.shipping import ShipPolicy
from baton_serve.router.routing import route_cost
from baton_serve.router.routing.request_router import BatonRouter
from baton_serve.router.routing.route_cost import (
    CACHED,
    COMPUTE,
    IN_FLIGHT,
    PULL,
    CostSettings,
    Holding,
    ReplicaState,
    estimate,
    rank,
)
from baton_serve.router.routing.route_decision import plan_of
from baton_serve.router.routing.routing_ledger import LOAD_HISTORY_S, RoutingLedger

SETTINGS = CostSettings()
NOW = 1_000_000.0


def _cluster(n: int, holdings: dict[str, Holding] | None = None) -> dict[str, ReplicaState]:
    holdings = holdings or {}
    return {f"r{i}": ReplicaState(f"r{i}", 0, 0, 100.0, holdings.get(f"r{i}")) for i in range(n)}


def _send(replicas: dict[str, ReplicaState], n_prompt: int) -> str:
    """Route one request and account for it the way the ledger does."""
    best = rank(list(replicas.values()), n_prompt, NOW, SETTINGS)[0]
    old = replicas[best.replica_id]
    replicas[best.replica_id] = ReplicaState(
        old.replica_id,
        old.load + 1,
        old.queued_tokens + n_prompt - best.reused_tokens,
        old.prefill_tokens_per_s,
        old.holding,
    )
    return best.replica_id


def test_a_burst_with_nothing_cached_spreads_evenly() -> None:
    replicas = _cluster(4)
    chosen = [_send(replicas, 1500) for _ in range(16)]
    assert sorted(chosen.count(r) for r in replicas) == [4, 4, 4, 4]


def test_a_hot_prefix_never_piles_beyond_the_load_bound() -> None:
    """Every request wants replica r0's prefix; r0 never holds more than (1 + slack) x the
    mean load (+1 for the request being placed)."""
    replicas = _cluster(4, {"r0": Holding(2000, 40_000_000)})
    for sent in range(1, 41):
        _send(replicas, 2100)
        loads = [r.load for r in replicas.values()]
        mean = sum(loads) / len(loads)
        assert max(loads) <= math.ceil((1 + SETTINGS.load_slack) * (mean + 1)), (sent, loads)
    # the others pull r0's state rather than wait behind it
    assert replicas["r0"].load >= max(r.load for k, r in replicas.items() if k != "r0")


def test_a_cached_prefix_wins_over_an_idle_replica() -> None:
    replicas = _cluster(2, {"r1": Holding(1800, 40_000_000)})
    best = rank(list(replicas.values()), 1900, NOW, SETTINGS)[0]
    assert (best.replica_id, best.plan, best.reused_tokens) == ("r1", CACHED, 1800)


def test_an_in_flight_prefix_is_joined_when_no_replica_is_idle() -> None:
    """Both replicas are busy; r0 is computing the prefix: joining it beats computing the
    prefix again on r1 (which could also wait for r0's state, but only after its queue)."""
    replicas = {
        "r0": ReplicaState("r0", 1, 1000, 100.0, Holding(1000, 20_000_000, ready_at=NOW + 5)),
        "r1": ReplicaState("r1", 1, 1850, 100.0, None),
    }
    best = rank(list(replicas.values()), 1850, NOW, SETTINGS)[0]
    assert (best.replica_id, best.plan, best.reused_tokens) == ("r0", IN_FLIGHT, 1000)


def test_waiting_for_an_in_flight_prefix_and_pulling_it_beats_computing_it() -> None:
    """r0 is busy computing a long prefix; r1 is idle: r1 waits for the state, pulls it."""
    holding = Holding(3000, 60_000_000, ready_at=NOW + 2)
    replicas = {
        "r0": ReplicaState("r0", 3, 9000, 100.0, holding),
        "r1": ReplicaState("r1", 0, 0, 100.0, None),
    }
    estimates = rank(list(replicas.values()), 3100, NOW, SETTINGS)
    assert estimates[0].replica_id == "r1" and estimates[0].plan == PULL
    assert 2.0 < estimates[0].seconds < 4.0


def test_a_prefix_being_computed_is_waited_for_rather_than_computed_twice() -> None:
    """r1 is idle; r0 computes a 1000-token prefix. Waiting for it is slower than
    computing it on r1 (10 s) by the pull: r1 waits and pulls, and its replica's deadline
    lets it. Past `in_flight_slack` of the 10 s, r1 computes it; a prefix held now gets
    no slack."""

    def best_for(holding: Holding) -> str:
        replicas = [
            ReplicaState("r0", 1, 1000, 100.0, holding),
            ReplicaState("r1", 0, 0, 100.0, None),
        ]
        best = [e for e in rank(replicas, 1050, NOW, SETTINGS) if e.replica_id == "r1"][0]
        return best.plan

    assert SETTINGS.ship.in_flight_slack == 0.25
    assert best_for(Holding(1000, 20_000_000, ready_at=NOW + 10.5, holder="r0")) == PULL
    assert ShipPolicy().deadline(1000, 100.0, wait_s=10.5) > 10.5 + 0.1
    assert best_for(Holding(1000, 20_000_000, ready_at=NOW + 12.6, holder="r0")) == COMPUTE
    slow_link = ShipCost(bandwidth_bytes_per_s=2e6)  # 10 s to ship a state held now
    settings = CostSettings(ship=slow_link)
    idle = ReplicaState("r1", 0, 0, 100.0, None)
    held = Holding(1000, 20_000_000, holder="r0")
    assert estimate(idle, 1050, [held], NOW, settings).plan == COMPUTE


def test_a_busy_replica_waits_for_a_prefix_a_peer_has_ready_before_it_could_compute_it() -> None:
    """Every replica is busy for 5 s (its queue) when a new 1000-token prefix is being
    computed on r0, ready in 15.5 s: computing it on r1 would also end at 15 s, so r1 waits
    for it and pulls it (before, the wait was weighed from now against the 10 s of compute
    alone, and every busy replica of a burst computed the prefix itself). Its plan says when
    r1 could have started, and its replica's pull deadline counts from then."""
    held = Holding(1000, 20_000_000, ready_at=NOW + 15.5, holder="r0")
    busy = ReplicaState("r1", 0, 500, 100.0, None)  # 500 tokens queued: 5 s
    best = estimate(busy, 1060, [held], NOW, SETTINGS)
    assert best.plan == PULL and best.start_at == pytest.approx(NOW + 5.0)
    plan = plan_of(best)
    assert plan.start_at == pytest.approx(NOW + 5.0)
    assert ShipPolicy().deadline(1000, 100.0, wait_s=15.5, busy_s=5.0) > 15.5
    assert ShipPolicy().deadline(1000, 100.0, wait_s=15.5) < 15.5  # counted from now
    idle = ReplicaState("r1", 0, 0, 100.0, None)
    assert estimate(idle, 1060, [held], NOW, SETTINGS).plan == COMPUTE  # done at 10.6 s
    assert pull_pays(1000, 20_000_000, 15.5, 100.0, ShipCost(), busy_s=5.0)
    assert not pull_pays(1000, 20_000_000, 15.5, 100.0, ShipCost())


def test_a_replica_is_planned_to_pull_at_the_bandwidth_its_own_pulls_measured() -> None:
    """A GPU replica computes 10,000 tokens a second; a 2,000-token state of an 8B fp16
    model is 262 MB. At the configured 0.5 GB/s a pull looks slower than computing; a
    replica whose pulls measured 25 GB/s (its report's `pull_bytes_per_s`) is planned to
    pull, and the router's own figure comes from `pull_bandwidth_gb_s` (its other pull costs
    from `routing.*`, as the replicas' do)."""
    held = Holding(2000, 2000 * 131_072, holder="r0")
    configured = ReplicaState("r1", 0, 0, 10_000.0, None)
    measured = ReplicaState("r1", 0, 0, 10_000.0, None, pull_bytes_per_s=25e9)
    assert estimate(configured, 2100, [held], NOW, SETTINGS).plan == COMPUTE
    assert estimate(measured, 2100, [held], NOW, SETTINGS).plan == PULL
    fast_fabric = CostSettings(ship=ShipCost(bandwidth_bytes_per_s=25e9))
    assert estimate(configured, 2100, [held], NOW, fast_fabric).plan == PULL
    config = BatonConfig(pull_bandwidth_gb_s=25, routing={"pull_min_gain_tokens": 32})
    kwargs = config.routing.router_kwargs(config.pull_bandwidth_bytes_per_s)
    router, deployment = _router("bandwidth", **kwargs)
    replica = _Replica("r1", deployment)
    assert router._settings.ship == config.routing.ship_cost(25e9)
    assert router._settings.ship == ShipCost(min_gain_tokens=32, bandwidth_bytes_per_s=25e9)
    replica.routing_stats = {"prefill_tokens_per_s": 10_000.0, "pull_bytes_per_s": 3e9}
    assert router._state(replica, None, 10_000.0).pull_bytes_per_s == 3e9


def test_a_pull_takes_the_cheapest_donor_whatever_the_order() -> None:
    """Two replicas hold the same depth, one in a smaller state: an idle third pulls the
    smaller one, whichever comes first (the first acceptable donor used to block the
    others of the same depth)."""
    big, small = Holding(1800, 400_000_000), Holding(1800, 4_000_000)
    for first, second in ((big, small), (small, big)):
        replicas = {
            "r0": ReplicaState("r0", 2, 4000, 100.0, first),
            "r1": ReplicaState("r1", 2, 4000, 100.0, second),
            "r2": ReplicaState("r2", 0, 0, 100.0, None),
        }
        best = rank(list(replicas.values()), 1900, NOW, SETTINGS)[0]
        assert (best.replica_id, best.plan) == ("r2", PULL)
        assert best.seconds < SETTINGS.ship.latency_s + 0.02 + 100 / 100.0


def test_many_replicas_holding_one_prefix_rank_as_one_donor() -> None:
    """256 replicas hold a system prompt, one a whole conversation: each estimate weighs
    only the donors a pull could choose, and the ranking is what weighing all gives."""
    shared = Holding(960, 20_000_000)
    replicas = [ReplicaState(f"r{i:03d}", i % 3, 0, 100.0, shared) for i in range(256)]
    replicas[7] = ReplicaState("r007", 1, 0, 100.0, Holding(1792, 40_000_000))
    estimates = rank(replicas, 1900, NOW, SETTINGS)
    best = estimates[0]
    assert best.plan == PULL and best.reused_tokens == 1792 and best.replica_id != "r007"
    own = next(e for e in estimates if e.replica_id == "r007")
    assert own.plan == CACHED and own.reused_tokens == 1792


def test_nothing_to_reuse_means_compute_on_the_least_loaded() -> None:
    replicas = _cluster(3)
    replicas["r0"] = ReplicaState("r0", 2, 3000, 100.0, None)
    best = rank(list(replicas.values()), 500, NOW, SETTINGS)[0]
    assert best.plan == COMPUTE and best.replica_id != "r0"


def test_the_ledger_knows_its_decisions_at_once() -> None:
    """Attention: every block of the prompt; hybrid: only the checkpointed positions."""
    hasher = PrefixHasher(b"fp", 64)
    tokens = tuple(range(1000, 1700))
    prompt = Prompt(
        tokens=tokens, message_starts=(0, 300, 650), message_roles=("system", "user", "assistant")
    )
    chain = hasher.chain(tokens)
    clock = [0.0]
    every = RoutingLedger(64, every_block=True, ttl_s=30, now=lambda: clock[0])
    every.sent("a", "req-1", every.entries_for(prompt, chain), tokens=700, ready_at=NOW + 7)
    assert every.load("a") == 1 and every.queued_tokens("a") == 700
    match = every.lookup(chain[:5])["a"]
    assert (match.n_tokens, match.in_flight) == (320, True)
    every.completed("a", "req-1")
    assert every.load("a") == 0 and every.queued_tokens("a") == 0
    assert not every.lookup(chain)["a"].in_flight
    clock[0] = 31.0
    assert every.lookup(chain) == {}

    hybrid = RoutingLedger(64, every_block=False, ttl_s=30, now=lambda: clock[0])
    held = hybrid.entries_for(prompt, chain)
    assert [n for _, n in held] == [300, 698]  # the system prompt's end, the prompt's end - 2
    hybrid.sent("b", "req-2", held, tokens=700, ready_at=NOW + 7)
    assert hybrid.lookup(chain[:3]) == {}  # no checkpoint inside the first 192 tokens...
    assert hybrid.lookup(chain[:4])["b"].n_tokens == 300  # ...one at 300 (anchored at 256)
    hybrid.forget_replica("b")
    assert hybrid.lookup(chain) == {} and hybrid.load("b") == 0


def test_a_prefix_a_request_leaves_is_ready_when_its_prefill_passes_it() -> None:
    """A 1,000-token prompt computed at 100 tok/s, first token at NOW + 10: its 300-token
    system prompt is ready 7 s sooner; a pull plan's prefixes up to what it pulls arrive
    with the pull."""
    chain = PrefixHasher(b"fp", 100).chain(range(1000))
    ledger = RoutingLedger(100, every_block=True)
    held = [(chain[2], 300), (chain[9], 1000)]
    ledger.sent("a", "r1", held, tokens=1000, ready_at=NOW + 10, prefill_tokens_per_s=100.0)
    found = ledger.lookup(chain[:3])["a"]
    assert (found.n_tokens, found.ready_at) == (300, pytest.approx(NOW + 3))
    ledger.sent(
        "b", "r2", held, tokens=200, ready_at=NOW + 4, reused=800, prefill_tokens_per_s=100.0
    )
    assert ledger.lookup(chain[:3])["b"].ready_at == pytest.approx(NOW + 2)  # with the pull


def test_a_replica_report_counts_only_what_this_router_has_not_seen_finish() -> None:
    """A report is a second old: requests this router saw finish since are not counted
    again; other callers' requests in it are (as of the report)."""
    wall = [100.0]
    ledger = RoutingLedger(64, every_block=True, wall=lambda: wall[0])
    ledger.sent("a", "r1", [], tokens=10, ready_at=0.0)
    ledger.sent("a", "r2", [], tokens=10, ready_at=0.0)
    wall[0] = 100.6  # the replica reports: both running, plus one request of another router
    report_at, reported = 100.5, 3
    wall[0] = 101.0
    ledger.completed("a", "r1")  # the report still counts it
    assert ledger.load_given_report("a", reported, report_at) == 1 + 1  # r2, the other's
    assert ledger.load_given_report("a", 2, report_at) == 1  # only this router's: r2
    ledger.sent("a", "r3", [], tokens=10, ready_at=0.0)  # after the report: counted once
    assert ledger.load_given_report("a", 2, report_at) == 2
    # a report from before this router sent anything counts the others' then
    assert ledger.load_given_report("a", 1, 99.0) == 2 + 1
    # a report with no time, or older than the ledger's history: the larger count
    assert ledger.load_given_report("a", 5, None) == 5
    wall[0] = 101.0 + LOAD_HISTORY_S + 1
    ledger.completed("a", "r2")  # drops the changes of 100-101 from the history
    assert ledger.load_given_report("a", 4, report_at) == 4
    assert ledger.load_given_report("a", 0, wall[0] - 0.1) == 1  # recent reports still work


def test_a_follow_up_goes_to_its_holder_while_the_report_still_counts_its_last_step() -> None:
    """An agent's next step arrives the moment its last one finished, before the holder's
    routing stats (a report every 0.5 s) say so: the router knows its own request finished
    and sends the step to the holder, not to an idle replica that would recompute it."""
    router, deployment = _router("follow-up")
    holder, idle = _Replica("a", deployment), _Replica("b", deployment)
    speed = {"prefill_tokens_per_s": 2000.0}  # counting the finished step costs more than
    idle.routing_stats = holder.routing_stats = speed  # pulling the holder's state
    chain = tuple(PrefixHasher(b"fp", 64).chain(range(1100)))

    def request(n: int) -> ReplicaRequest:
        return ReplicaRequest(
            generation=GenerationRequest(prompt=Prompt(tokens=tuple(range(n)))),
            prefix_hashes=chain[: n // 64],
        )

    async def steps() -> str:
        first = PendingRequest(
            args=[request(1000)], kwargs={}, metadata=RequestMetadata("s1", "s1")
        )
        ranks = await router.choose_replicas([holder], first)
        router.request_routed(first, ranks[0][0])
        # the holder's last report, sampled while the first step ran
        holder.routing_stats = {"running": 1, "sampled_at": time.time(), **speed}
        router.on_request_completed(holder.replica_id, "s1")
        follow = PendingRequest(
            args=[request(1100)], kwargs={}, metadata=RequestMetadata("s2", "s2")
        )
        ranks = await router.choose_replicas([holder, idle], follow)
        return ranks[0][0].replica_id.unique_id

    assert asyncio.run(steps()) == "a"


class _Replica:
    """What `BatonRouter` reads of a `RunningReplica`: its id and routing stats (a live
    replica actor is not needed to rank)."""

    def __init__(self, name: str, deployment: DeploymentID) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=deployment)
        self.routing_stats: dict = {}


def _router(app_name: str, **settings: object) -> tuple[BatonRouter, DeploymentID]:
    """A `BatonRouter` built as Ray builds one, with no index to reach (its ledger only)."""
    deployment = DeploymentID(name="Replica", app_name=app_name)
    router = BatonRouter(deployment_id=deployment, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(
        index="redis://127.0.0.1:1", fingerprint_hex="ab" * 32, follow_index=False, **settings
    )
    return router, deployment


def test_a_burst_ranked_before_any_request_is_sent_still_spreads() -> None:
    """Ray ranks the requests of a burst before it sends the first: each decision is in the
    ledger the moment it is made, so the next one sees it (no index answers here)."""
    router, deployment = _router("burst")
    candidates = [_Replica("a", deployment), _Replica("b", deployment)]
    chain = tuple(PrefixHasher(b"fp", 64).chain(range(1000)))
    request = ReplicaRequest(
        generation=GenerationRequest(prompt=Prompt(tokens=tuple(range(1000)))),
        prefix_hashes=chain,
    )

    async def burst() -> list[str]:
        firsts, pendings = [], []  # alive, as Ray keeps them until sent (the router keys
        # its plans by the metadata's id, which a freed object's successor may reuse)
        for i in range(4):
            metadata = RequestMetadata(request_id=f"r{i}", internal_request_id=f"r{i}")
            pendings.append(PendingRequest(args=[request], kwargs={}, metadata=metadata))
            ranks = await router.choose_replicas(candidates, pendings[-1])
            firsts.append(ranks[0][0].replica_id.unique_id)
        return firsts

    # one replica computes the prompt; the other waits for it and pulls it (computing it
    # again would be faster only by the pull's shipping time), and takes the rest
    firsts = asyncio.run(burst())
    assert sorted(firsts.count(rid) for rid in ("a", "b")) == [1, 3]
    computing = sorted(router._ledger.queued_tokens(rid) for rid in ("a", "b"))
    assert computing == [3 * (1000 - 960), 1000]  # a pull gives the 15 whole 64-token blocks


def _chat_opening(
    speeds: dict[str, float], extra_at_donor: int = 0
) -> tuple[list[str], BatonRouter]:
    """Four chat sessions opening at once on a new 1,000-token system prompt, each with 856
    tokens of its own (`bench routing`'s opening), ranked by one router over replicas
    reporting `speeds` (0: not measured yet). With `extra_at_donor`, the replica computing
    the prompt reports that many more requests (another caller's) once the second is
    ranked."""
    router, deployment = _router("opening")
    candidates = [_Replica(rid, deployment) for rid in speeds]
    for replica in candidates:
        replica.routing_stats = {"prefill_tokens_per_s": speeds[replica.replica_id.unique_id]}
    hasher = PrefixHasher(b"fp", 64)

    async def opening() -> list[str]:
        firsts, pendings = [], []
        for i in range(4):
            own = range(10_000 * (i + 1), 10_000 * (i + 1) + 856)
            tokens = (*range(1000), *own)
            request = ReplicaRequest(
                generation=GenerationRequest(prompt=Prompt(tokens=tokens)),
                prefix_hashes=tuple(hasher.chain(tokens)),
            )
            metadata = RequestMetadata(request_id=f"s{i}", internal_request_id=f"s{i}")
            pendings.append(PendingRequest(args=[request], kwargs={}, metadata=metadata))
            chosen = (await router.choose_replicas(candidates, pendings[-1]))[0][0]
            router.request_routed(pendings[-1], chosen)
            firsts.append(chosen.replica_id.unique_id)
            if i == 1 and extra_at_donor:
                donor = next(r for r in candidates if r.replica_id.unique_id == firsts[0])
                donor.routing_stats = {
                    **donor.routing_stats,
                    "running": 1 + extra_at_donor,
                    "sampled_at": time.time(),
                }
        return firsts

    return asyncio.run(opening()), router


@pytest.mark.parametrize("extra_at_donor", [0, 1, 2])
def test_a_chat_opening_splits_two_and_two_whatever_the_donor_reports(
    extra_at_donor: int,
) -> None:
    """One replica computes the system prompt, the other pulls it once computed; the other
    two first turns go one to each. The puller's queue waits for the donor: it is busy until
    the state arrives and then with its first turn, not just for that turn's tokens — before
    that was counted, one more request in the donor's report sent the fourth turn to the
    puller too (three first turns, 8.6 s apart, on one replica: `bench routing`'s p99)."""
    firsts, router = _chat_opening({"a": 110.0, "b": 110.0}, extra_at_donor)
    assert sorted(firsts.count(rid) for rid in ("a", "b")) == [2, 2], firsts
    puller = firsts[1]
    assert puller != firsts[0]
    assert len(router._ledger.gated(puller)) == 2  # its pull and the turn that joins it


def test_a_replica_not_yet_measured_is_taken_at_its_measured_peers_speed() -> None:
    """A new replica has no prefill speed of its own yet: taken at the router's default
    (200 tokens/s, here twice its peer's), it drew three of the opening's four first turns."""
    firsts, _ = _chat_opening({"a": 100.0, "b": 0.0})
    assert sorted(firsts.count(rid) for rid in ("a", "b")) == [2, 2], firsts


def test_a_request_waiting_for_a_state_holds_the_queue_from_its_arrival() -> None:
    """A replica's queue: 200 tokens it can compute now, and 800 of a request whose state
    arrives in 5 s (100 tokens/s, nothing else in flight). A request that needs no state
    starts after the 200; one whose own state arrives in 6 s, after the other's 800."""
    replica = ReplicaState("r", 0, 1000, 100.0, gated=((NOW + 5, 800),))
    assert route_cost.prefill_start(replica, 0.0, NOW, SETTINGS) == pytest.approx(2.0)
    assert route_cost.prefill_start(replica, 4.0, NOW, SETTINGS) == pytest.approx(4.0)
    assert route_cost.prefill_start(replica, 6.0, NOW, SETTINGS) == pytest.approx(13.0)
    ledger = RoutingLedger(64, every_block=True)
    ledger.sent("r", "waits", [], tokens=800, ready_at=NOW + 13, state_at=NOW + 5)
    ledger.sent("r", "now", [], tokens=200, ready_at=NOW + 2)
    assert ledger.gated("r") == ((NOW + 5, 800),) and ledger.queued_tokens("r") == 1000
    ledger.completed("r", "waits")
    assert ledger.gated("r") == () and ledger.queued_tokens("r") == 200


# (gain tokens, state bytes, wait s, prefill tok/s): cheap, a gain too short to bother,
# a big state on a fast prefill, a long wait, and close to the line on either side of it
# (5 s of recompute, 6.25 s with the in-flight slack; the pull adds 0.04 s)
PULL_CASES = [
    (1000, 20_000_000, 0.0, 100.0),
    (63, 1_000, 0.0, 10.0),
    (2000, 4_000_000_000, 0.0, 10_000.0),
    (500, 10_000_000, 7.0, 100.0),
    (500, 10_000_000, 6.22, 100.0),
    (500, 10_000_000, 6.20, 100.0),
]


def test_router_replica_and_simulator_decide_a_pull_with_one_rule() -> None:
    """The router plans a pull exactly when `pull_pays` says it pays, as a replica without
    a plan decides it (and the simulator calls the very same function)."""
    cost = ShipCost()
    settings = CostSettings(ship=cost)
    decided = []
    for gain, nbytes, wait_s, speed in PULL_CASES:
        pays = pull_pays(gain, nbytes, wait_s, speed, cost)
        donor = Holding(gain, nbytes, ready_at=NOW + wait_s if wait_s else 0.0, holder="d")
        idle = ReplicaState("r", 0, 0, speed, None)
        router = estimate(idle, gain + 100, [donor], NOW, settings).plan == PULL
        replica = ShipPolicy(cost=cost).pays(gain, nbytes, speed, wait_s=wait_s)
        assert router == replica == pays, (gain, nbytes, wait_s, speed)
        decided.append(pays)
    assert True in decided and False in decided
    assert route_cost.pull_pays is shipping.pull_pays is sim_replica.pull_pays is pull_pays


def test_a_pull_plan_names_its_donor_and_what_it_gives() -> None:
    held = Holding(1800, 40_000_000, ready_at=NOW + 1, holder="r0")
    replicas = [ReplicaState("r0", 3, 6000, 100.0, held), ReplicaState("r1", 0, 0, 100.0)]
    best = rank(replicas, 1900, NOW, SETTINGS)[0]
    plan = plan_of(best)
    assert (plan.replica_id, plan.kind, plan.donor_id) == ("r1", PULL, "r0")
    assert (plan.donor_tokens, plan.nbytes, plan.ready_at) == (1800, 40_000_000, NOW + 1)
    assert plan.reused_tokens == 1800
    own = plan_of(next(e for e in rank(replicas, 1900, NOW, SETTINGS) if e.replica_id == "r0"))
    assert (own.kind, own.donor_id, own.reused_tokens) == (IN_FLIGHT, None, 1800)
