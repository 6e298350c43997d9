"""`baton bench serve`: what the Serve layer costs on top of the engine and the index.

Two figures:

- **routing overhead** — time in `BatonRouter.choose_replicas`, with `checkpoints` entries
  indexed across `replicas` replicas (the `baton bench index` workload, published under the
  router's fingerprint), for both index backends. The router is built the way Ray Serve
  builds one and called directly, one decision at a time, once its copy of the index (fed
  by the backend's change stream) has caught up; then the copy's **staleness**: the time
  from a publish call's start until the entry is visible in the router.
- **HTTP decode** — single-stream decode speed through the whole HTTP path (proxy, gateway,
  handle, replica, engine) against the same engine alone in this process: same model, engine
  settings, prompt and token count, greedy, `ignore_eos`.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

from baton_serve.cache_store.index import CheckpointIndex, IndexEntry
from baton_serve.cache_store.index_connect import connect_index
from baton_serve.deploy.app import REPLICA_DEPLOYMENT
from baton_serve.deploy.config import BatonConfig
from baton_serve.deploy.local_ray import local_ray
from baton_serve.loadtests.index_bench import (
    BLOCK_TOKENS,
    Workload,
    latency_ms,
    redis_url_or_private_server,
)
from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.loadtests.serve_app import serve_app, wait_idle
from baton_serve.loadtests.sse import events
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.prompt import Prompt
from baton_serve.replicas.engine.protocol import GenerationRequest, ReplicaRequest
from baton_serve.replicas.engine.sampling import SamplingParams
from baton_serve.router.request_router import BatonRouter
from baton_serve.router.routing_metrics import decision_counts

# ---- routing overhead ----------------------------------------------------------------------

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
        reasons = dict(Counter(decision_counts()) - before)
        staleness = await _staleness(publisher, router, next(iter(workload.entries)), rng)
        for replica in workload.entries:
            await publisher.forget(replica)
    finally:
        # BatonRouter has no close hook (Ray never closes a router); release its client here.
        if router._index is not None:
            await router._index.close()
        await publisher.close()
    return {
        "publish_s": publish_s,
        "view_sync_s": sync_s,
        "view_entries": router.view.entries,
        "staleness_ms": latency_ms(staleness),
        "decision_ms": latency_ms(latencies),
        "prefix_hit_share": reasons.get("prefix_hit", 0) / len(pendings),
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


# ---- HTTP decode ---------------------------------------------------------------------------

PROMPT = (
    "The lighthouse keeper kept a logbook of every ship that passed the point. "
    "Write the next entries of that logbook, one ship at a time, in plain sentences."
)
HTTP_TIMEOUT_S = 300.0
IDLE_TIMEOUT_S = 60.0


def _engine_config(n_threads: int) -> EngineConfig:
    return EngineConfig(n_ctx=2048, n_slots=2, n_threads=n_threads)


def _rate(stamps: list[float]) -> float:
    """Content chunks per second, from the first chunk to the last."""
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return 0.0
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _run_row(started: float, stamps: list[float], completion_tokens: int) -> dict:
    return {
        "tokens_per_s": _rate(stamps),
        "content_chunks": len(stamps),
        "completion_tokens": completion_tokens,
        "first_chunk_s": stamps[0] - started if stamps else None,
        "decode_s": stamps[-1] - stamps[0] if stamps else 0.0,
    }


def _engine_runs(
    model: Path, config: EngineConfig, hmac_key: str, tokens: int, runs: int
) -> tuple[list[dict], int]:
    """The engine alone, in this process; each run iterates the handle's token events."""
    with Engine(str(model), config, hmac_key=hmac_key.encode()) as engine:
        prompt = engine.text_prompt(PROMPT)
        engine.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        engine.wait_idle(IDLE_TIMEOUT_S)
        sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        rows = []
        for _ in range(runs):
            started = time.perf_counter()
            handle = engine.submit(GenerationRequest(prompt=prompt, sampling=sampling))
            stamps = [time.perf_counter() for event in handle if event.text]
            done = handle.result()
            rows.append(_run_row(started, stamps, done.usage.completion_tokens))
            engine.wait_idle(IDLE_TIMEOUT_S)  # the reply's replay must not overlap the next run
    return rows, len(prompt)


def _stream_completion(client: httpx.Client, url: str, body: dict) -> tuple[dict, int]:
    """One streamed `POST /v1/completions`; the run's row and its prompt token count."""
    stamps: list[float] = []
    usage: dict = {}
    started = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"completion failed: HTTP {response.status_code}: {response.text}")
        for chunk in events(response.iter_lines()):
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                usage = chunk["usage"]
    row = _run_row(started, stamps, usage.get("completion_tokens", 0))
    return row, usage.get("prompt_tokens", 0)


def _http_runs(
    model: Path, engine: EngineConfig, hmac_key: str, tokens: int, runs: int, http_port: int | None
) -> tuple[list[dict], int]:
    config = BatonConfig(
        model=str(model),
        replicas=1,
        num_cpus_per_replica=1,
        engine=engine,
        hmac_key=hmac_key,
    )
    body = {
        "model": config.served_model_name,
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with (
        local_ray(num_cpus=2),
        serve_app(config, BENCH_APP, http_port) as url,
        httpx.Client(timeout=HTTP_TIMEOUT_S) as client,
    ):
        _stream_completion(client, url, {**body, "max_tokens": 4})  # warm-up
        asyncio.run(wait_idle(BENCH_APP))
        rows, prompt_tokens = [], 0
        for _ in range(runs):
            row, prompt_tokens = _stream_completion(client, url, body)
            rows.append(row)
            asyncio.run(wait_idle(BENCH_APP))
    return rows, prompt_tokens


def _summary(rows: list[dict]) -> dict:
    rates = [r["tokens_per_s"] for r in rows]
    return {
        "best_tokens_per_s": max(rates),
        "median_tokens_per_s": statistics.median(rates),
        "runs": rows,
    }


def http_decode(
    model: Path,
    *,
    tokens: int = 256,
    runs: int = 3,
    n_threads: int = 1,
    http_port: int | None = None,
    progress: Progress = SILENT,
) -> dict:
    """Single-stream decode tokens/s through HTTP vs the engine alone (best of `runs`),
    both with `EngineConfig(n_ctx=2048, n_slots=2, n_threads=n_threads)`.

    The engine is measured first, with no Serve app running (both share the CPUs). Serve is
    started on a free port and shut down at the end, unless `http_port` names the port of a
    Serve instance already running (then only the benchmark's app is added and deleted).
    """
    if tokens < 2 or runs < 1:
        raise ValueError("tokens must be >= 2 and runs >= 1")
    hmac_key = secrets.token_hex(16)
    config = _engine_config(n_threads)
    progress.step(f"decode: the engine alone, {runs} x {tokens} tokens")
    engine_rows, engine_prompt = _engine_runs(model, config, hmac_key, tokens, runs)
    progress.step(f"decode: through HTTP (starting the app), {runs} x {tokens} tokens")
    http_rows, http_prompt = _http_runs(model, config, hmac_key, tokens, runs, http_port)
    engine, http = _summary(engine_rows), _summary(http_rows)
    return {
        "model": str(model),
        "tokens": tokens,
        "runs": runs,
        "n_threads": n_threads,
        "prompt_tokens": {"engine": engine_prompt, "http": http_prompt},
        "engine": engine,
        "http": http,
        "ratio": http["best_tokens_per_s"] / engine["best_tokens_per_s"],
        "ratio_median": http["median_tokens_per_s"] / engine["median_tokens_per_s"],
        "target_ratio": RATIO_TARGET,
    }


# ---- both ----------------------------------------------------------------------------------


def serve_benchmark(model: Path, redis_url: str | None, progress: Progress = SILENT) -> dict:
    """Routing overhead (Redis at `redis_url` or a private server, and embedded) and HTTP
    decode speed of `model`, on one local Ray runtime (started here if none is running)."""
    with local_ray(num_cpus=2):
        routing = routing_overhead(redis_url, progress=progress)
        return {"routing": routing, "http_decode": http_decode(model, progress=progress)}


def format_routing(result: dict) -> str:
    lines = [
        f"routing: {result['decisions']:,} decisions of BatonRouter.choose_replicas over"
        f" {result['replicas']} replicas, {result['checkpoints']:,} checkpoints indexed,"
        f" {result['chain']}-hash chains ({result['prompt_tokens']:,}-token prompts),"
        f" lookup timeout {result['lookup_timeout_ms']:g} ms",
        f"{'backend':<9} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} {'max ms':>7} {'hits':>5}"
        f" {'timeouts':>8} {'stale p50':>9} {'p95':>6} {'p99 ms':>7} {'view sync s':>11}",
    ]
    for name, r in result["backends"].items():
        ms, stale = r["decision_ms"], r["staleness_ms"]
        lines.append(
            f"{name:<9} {ms['p50']:>7.3f} {ms['p95']:>7.3f} {ms['p99']:>7.3f} {ms['max']:>7.2f}"
            f" {r['prefix_hit_share']:>5.0%} {r['decisions_by_reason'].get('index_timeout', 0):>8}"
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


def format_http(result: dict) -> str:
    e, h = result["engine"], result["http"]
    verdict = "met" if result["ratio"] >= result["target_ratio"] else "NOT met"
    return "\n".join(
        [
            f"decode: {result['model']}, one stream, {result['tokens']} tokens (ignore_eos, greedy),"
            f" prompt {result['prompt_tokens']['engine']} tokens, {result['n_threads']} llama.cpp"
            f" thread(s), best of {result['runs']}",
            f"  engine alone:  {e['best_tokens_per_s']:7.1f} tok/s (median {e['median_tokens_per_s']:.1f})",
            f"  through HTTP:  {h['best_tokens_per_s']:7.1f} tok/s (median {h['median_tokens_per_s']:.1f})",
            f"  HTTP / engine: {result['ratio']:.3f} (median {result['ratio_median']:.3f});"
            f" target >= {result['target_ratio']:g}: {verdict}",
        ]
    )


def format_report(result: dict) -> str:
    """A `serve_benchmark` result, or either part of one on its own."""
    parts = []
    if "routing" in result or "backends" in result:
        parts.append(format_routing(result.get("routing", result)))
    if "http_decode" in result or "engine" in result:
        parts.append(format_http(result.get("http_decode", result)))
    return "\n\n".join(parts)
