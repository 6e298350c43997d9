"""The routing half of `baton bench serve`: time in `BatonRouter.choose_replicas`.

`checkpoints` entries are indexed across `replicas` replicas (the `baton bench index`
workload, published under the router's fingerprint), for both index backends. The router
is built the way Ray Serve builds one and called directly, one decision at a time, once its
copy of the index (fed by the backend's change stream) has caught up; then the copy's
**staleness**: the time from a publish call's start until the entry is visible in the router.

The bench's own objects (the workload, 2,000 requests with their hash chains) are moved out of
the garbage collector's sight (`gc.freeze`) before the router copies the index, and each
request is handed to the router's `request_routed` as Ray hands a request it sends: a gateway
holds neither the bench's objects nor a decision past its sending, and with them each full
collection here took 0.4-0.5 s, which the slowest decision then measured instead of the
router. The decided requests stay in flight (never completed), as at a busy gateway.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import time
from collections import Counter
from dataclasses import dataclass

from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

from baton_serve.cache_store.index.index import CheckpointIndex, IndexEntry
from baton_serve.cache_store.index.index_connect import connect_index
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import GenerationRequest, ReplicaRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.deploy.app import REPLICA_DEPLOYMENT
from baton_serve.deploy.local_ray import local_ray
from baton_serve.loadtests.index_bench import (
    BLOCK_TOKENS,
    Workload,
    latency_ms,
    redis_url_or_private_server,
)
from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.router.routing.request_router import BatonRouter
from baton_serve.router.routing.route_decision import REASONS
from baton_serve.router.routing.routing_metrics import decision_counts

ROUTER_LOOKUP_TIMEOUT_S = 0.02  # BatonRouter's default: what `build_app` deploys
CHAIN_BLOCKS = 64  # a 4,096-token prompt at 64 tokens per block
WARMUP_DECISIONS = 20  # connect the router's index client, warm both ends
LOAD_PATTERNS = 16  # distinct replica-load snapshots the decisions cycle through
BENCH_APP = "baton-bench"
ROUTER_TARGET_P99_MS = 0.5
STALENESS_TARGET_P99_MS = 50.0
STALENESS_SAMPLES = 200
VIEW_SYNC_TIMEOUT_S = 300.0
RATIO_TARGET = 0.9


@dataclass
class _Candidate:
    """Stand-in for Ray's `RunningReplica` with just what `BatonRouter` reads: its
    `replica_id.unique_id` and its `routing_stats`. A real `RunningReplica` wraps a live
    replica actor, which a benchmark of the routing decision alone does not need."""

    replica_id: ReplicaID
    routing_stats: dict[str, int]


def _router(spec: str, fingerprint: bytes, deployment: DeploymentID) -> BatonRouter:
    """A `BatonRouter` constructed and initialised as Ray Serve's handle router does it
    (`ray.serve._private.router`), for a caller that is not a Serve replica."""
    router = BatonRouter(deployment_id=deployment, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(
        index=spec, fingerprint_hex=fingerprint.hex(), lookup_timeout_s=ROUTER_LOOKUP_TIMEOUT_S
    )
    return router


def _candidate_sets(
    replica_ids: list[str], deployment: DeploymentID, rng: random.Random
) -> list[list[_Candidate]]:
    """`LOAD_PATTERNS` snapshots of the replicas with small random loads, so the router's
    bounded-load rule has something to weigh."""
    return [
        [
            _Candidate(
                ReplicaID(unique_id=rid, deployment_id=deployment),
                {"queued": rng.randint(0, 1), "running": rng.randint(0, 2)},
            )
            for rid in replica_ids
        ]
        for _ in range(LOAD_PATTERNS)
    ]


def _pending(request: ReplicaRequest, i: int) -> PendingRequest:
    """A pending handle call `stream(request)`, as the gateway makes it (needs a running loop)."""
    rid = f"bench-{i}"
    metadata = RequestMetadata(
        request_id=rid,
        internal_request_id=rid,
        call_method="stream",
        app_name=BENCH_APP,
        is_streaming=True,
    )
    return PendingRequest(args=[request], kwargs={}, metadata=metadata)


async def _route_backend(spec: str, workload: Workload, seed: int) -> dict:
    fingerprint = os.urandom(32)  # a fresh model namespace; the router is bound to it too
    publisher = await connect_index(
        spec, fingerprint, timeout_s=1.0, write_timeout_s=30.0, liveness_ttl_s=600.0
    )
    deployment = DeploymentID(name=REPLICA_DEPLOYMENT, app_name=BENCH_APP)
    router = _router(spec, fingerprint, deployment)
    rng = random.Random(seed)
    candidate_sets = _candidate_sets(list(workload.entries), deployment, rng)
    # One 4,096-token prompt shared by every request: the router reads only its length,
    # and 2,000 distinct 4,096-token tuples would cost ~250 MB of Python ints.
    prompt = Prompt(
        tokens=tuple(rng.randrange(1, 32_000) for _ in range(CHAIN_BLOCKS * BLOCK_TOKENS))
    )
    sampling = SamplingParams(max_tokens=128)
    # Each request carries one of the workload's 64-hash chains: 16-byte hashes that share
    # a prefix of blocks with a published document, then diverge (or share none), as a
    # gateway's chain would. They are not `PrefixHasher` hashes of `prompt` — the index
    # and the router only match hashes, so the cost of a lookup is the same.
    pendings = [
        _pending(
            ReplicaRequest(
                generation=GenerationRequest(prompt=prompt, sampling=sampling),
                prefix_hashes=tuple(chain),
            ),
            i,
        )
        for i, chain in enumerate(workload.chains)
    ]
    gc.freeze()
    try:
        publish_s = await workload.publish(publisher)
        for i in range(WARMUP_DECISIONS):
            warm = _pending(pendings[i % len(pendings)].args[0], -1 - i)
            await router.choose_replicas(candidate_sets[i % LOAD_PATTERNS], warm)
        sync_s = await _view_caught_up(router, sum(map(len, workload.entries.values())))
        before = Counter(decision_counts())
        latencies = []
        for i, pending in enumerate(pendings):
            candidates = candidate_sets[i % LOAD_PATTERNS]
            started = time.perf_counter()
            ranks = await router.choose_replicas(candidates, pending)
            latencies.append(time.perf_counter() - started)
            if not ranks or not ranks[0]:
                raise RuntimeError(f"the router chose no replica for decision {i}")
            router.request_routed(pending, ranks[0][0])  # as Ray does, sending it there
        reasons = dict(Counter(decision_counts()) - before)
        staleness = await _staleness(publisher, router, next(iter(workload.entries)), rng)
        for replica in workload.entries:
            await publisher.forget(replica)
    finally:
        # BatonRouter has no close hook (Ray never closes a router); release its client here.
        if router._index is not None:
            await router._index.close()
        await publisher.close()
        gc.unfreeze()
    return {
        "publish_s": publish_s,
        "view_sync_s": sync_s,
        "view_entries": router.view.entries,
        "staleness_ms": latency_ms(staleness),
        "decision_ms": latency_ms(latencies),
        "prefix_hit_share": reasons.get("prefix_hit", 0) / len(pendings),
        "reuse_share": sum(reasons.get(r, 0) for r in REASONS.values()) / len(pendings),
        "decisions_by_reason": reasons,
    }


async def _view_caught_up(router: BatonRouter, entries: int) -> float:
    """Wait until the router's copy of the index holds every published entry; seconds."""
    started = time.perf_counter()
    while not (router.view.synced and router.view.entries >= entries):
        if time.perf_counter() - started > VIEW_SYNC_TIMEOUT_S:
            raise RuntimeError(f"the router's index view has {router.view.entries}/{entries}")
        await asyncio.sleep(0.05)
    return time.perf_counter() - started


async def _staleness(
    publisher: CheckpointIndex, router: BatonRouter, replica: str, rng: random.Random
) -> list[float]:
    """Seconds from the start of each publish until the router's view shows the entry."""
    samples = []
    for _ in range(STALENESS_SAMPLES):
        prefix_hash = rng.randbytes(16)
        started = time.perf_counter()
        await publisher.publish(replica, [IndexEntry(prefix_hash, 64, 1)])
        while replica not in router.view.lookup([prefix_hash]):
            await asyncio.sleep(0)  # lets the view's follower (same loop) apply the change
        samples.append(time.perf_counter() - started)
        await asyncio.sleep(0.005)
    return samples


def routing_overhead(
    redis_url: str | None = None,
    *,
    checkpoints: int = 100_000,
    replicas: int = 8,
    decisions: int = 2_000,
    progress: Progress = SILENT,
) -> dict:
    """Time `BatonRouter.choose_replicas` (index lookup included) on Redis (at `redis_url`,
    or a private redis-server) and on the embedded index (Ray started here if needed)."""
    workload = Workload.make(checkpoints, replicas, decisions, CHAIN_BLOCKS)
    backends = {}
    with redis_url_or_private_server(redis_url) as url:
        progress.step(
            f"routing overhead, redis: {checkpoints:,} checkpoints, {decisions:,} decisions"
        )
        backends["redis"] = asyncio.run(_route_backend(url, workload, seed=1))
    with local_ray(num_cpus=2):
        progress.step("routing overhead, embedded index")
        backends["embedded"] = asyncio.run(_route_backend("embedded", workload, seed=1))
    return {
        "checkpoints": checkpoints,
        "replicas": replicas,
        "decisions": decisions,
        "chain": CHAIN_BLOCKS,
        "prompt_tokens": CHAIN_BLOCKS * BLOCK_TOKENS,
        "lookup_timeout_ms": ROUTER_LOOKUP_TIMEOUT_S * 1000,
        "target_p99_ms": ROUTER_TARGET_P99_MS,
        "staleness_target_p99_ms": STALENESS_TARGET_P99_MS,
        "backends": backends,
    }


def format_routing(result: dict) -> str:
    lines = [
        f"routing: {result['decisions']:,} decisions of BatonRouter.choose_replicas over"
        f" {result['replicas']} replicas, {result['checkpoints']:,} checkpoints indexed,"
        f" {result['chain']}-hash chains ({result['prompt_tokens']:,}-token prompts),"
        f" lookup timeout {result['lookup_timeout_ms']:g} ms",
        f"{'backend':<9} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} {'max ms':>7} {'hits':>5}"
        f" {'reuse':>5} {'timeouts':>8} {'stale p50':>9} {'p95':>6} {'p99 ms':>7}"
        f" {'view sync s':>11}",
    ]
    for name, r in result["backends"].items():
        ms, stale = r["decision_ms"], r["staleness_ms"]
        lines.append(
            f"{name:<9} {ms['p50']:>7.3f} {ms['p95']:>7.3f} {ms['p99']:>7.3f} {ms['max']:>7.2f}"
            f" {r['prefix_hit_share']:>5.0%} {r['reuse_share']:>5.0%}"
            f" {r['decisions_by_reason'].get('index_timeout', 0):>8}"
            f" {stale['p50']:>9.2f} {stale['p95']:>6.2f} {stale['p99']:>7.2f}"
            f" {r['view_sync_s']:>11.1f}"
        )
    for name, r in result["backends"].items():
        for what, key, target in (
            ("decision", "decision_ms", result["target_p99_ms"]),
            ("staleness", "staleness_ms", result["staleness_target_p99_ms"]),
        ):
            verdict = "met" if r[key]["p99"] <= target else "NOT met"
            lines.append(f"target {what} p99 <= {target:g} ms ({name}): {verdict}")
    return "\n".join(lines)
