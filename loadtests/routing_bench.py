"""`baton bench routing`: one seeded workload against each request-routing policy, in one run.

For each policy a fresh Baton app (K replicas of one model, the same engine settings and
index) is deployed on one local Ray cluster and sent the same requests, in four scenarios
(`routing_scenarios`): chat (`concurrency` conversations at a time sharing a system
prompt), burst (sessions arriving at once on a system prompt nobody holds), agent (loops
with no pause between steps) and moved (a conversation whose replica is kept busy).

Every request streams; TTFT is measured here, at the client. Computed prompt tokens are
`prompt_tokens - cached_tokens` from each response's usage. *New* tokens are what an ideal
cluster-wide cache would still compute: the prompt minus its longest common prefix with the
prompt and reply of any request that had finished when it started (tokenised here with the
model's vocabulary and template). Checkpoints and bytes shipped are the replicas' own pull
counters.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import httpx

from baton_serve.cache_store.prefix_hash import common_prefix_length
from baton_serve.deploy.app import GATEWAY_CPUS, local_cluster_cpus
from baton_serve.deploy.config import BatonConfig, RouterPolicy
from baton_serve.deploy.local_ray import local_ray
from baton_serve.loadtests.bench_http import bench_client
from baton_serve.loadtests.index_bench import redis_url_or_private_server
from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.loadtests.ray_metrics import settled_counters
from baton_serve.loadtests.routing_report import policy_targets, summarize
from baton_serve.loadtests.routing_scenarios import (
    Client,
    Run,
    agent_session,
    burst,
    chat_session,
    moved_session,
)
from baton_serve.loadtests.routing_workload import (
    AGENT,
    BLOCKERS,
    BURST,
    CHAT,
    MOVED,
    SCENARIOS,
    Conversation,
    RequestRecord,
    RoutingWorkload,
    Script,
)
from baton_serve.loadtests.serve_app import replica_stats, serve_app, wait_idle
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_model import LlamaModel

POLICIES = tuple(RouterPolicy)

HTTP_TIMEOUT_S = 600.0
HEARTBEAT_S = 0.2
WARMUP_REQUESTS_PER_REPLICA = 2


async def _scenarios(
    run: Run, script: Script, workload: RoutingWorkload, app: str, warmups: int
) -> dict:
    """Every scenario on one deployed app, one after the other: for each, its wall time,
    the replicas' pulls, and the routing decisions and pull outcomes the app's metrics
    counted."""
    slots = asyncio.Semaphore(workload.concurrency)

    async def limited(conversation: Conversation) -> None:
        async with slots:
            await chat_session(run, script.system, conversation)

    def of(scenario: str) -> list[Conversation]:
        return [c for c in script.conversations if c.scenario == scenario]

    async def moved() -> None:
        for conversation in of(MOVED):
            await moved_session(run, script.system, conversation)
            await wait_idle(app)

    plays = {
        CHAT: lambda: asyncio.gather(*(limited(c) for c in of(CHAT))),
        BURST: lambda: burst(run, script.burst_system, of(BURST)),
        AGENT: lambda: asyncio.gather(
            *(agent_session(run, script.agent_header, c) for c in of(AGENT))
        ),
        MOVED: moved,
    }
    figures = {}
    sent = warmups
    counters, app_metrics = await _pull_counters(app), await _app_metrics(app, sent)
    for scenario in SCENARIOS:
        started = time.perf_counter()
        await plays[scenario]()
        figures[scenario] = {"total_s": time.perf_counter() - started}
        await wait_idle(app)
        sent = warmups + len(run.records) + (BLOCKERS * len(of(MOVED)) if scenario == MOVED else 0)
        counters_after, metrics_after = await _pull_counters(app), await _app_metrics(app, sent)
        figures[scenario] |= _difference(counters_after, counters)
        figures[scenario] |= _metric_difference(metrics_after, app_metrics)
        counters, app_metrics = counters_after, metrics_after
    return figures


async def _app_metrics(app: str, requests: int) -> dict[str, float]:
    """The app's Baton counters once its metrics have caught up; empty if unreachable."""
    try:
        return await asyncio.to_thread(settled_counters, app, requests)
    except (httpx.HTTPError, StopIteration):
        return {}


def _metric_difference(after: dict[str, float], before: dict[str, float]) -> dict[str, dict]:
    """Routing decisions by reason and state pulls by outcome, counted between two scrapes."""

    def by(name: str, label: str) -> dict[str, int]:
        prefix = f"{name}{{{label}="
        counts = {
            key[len(prefix) : -1]: round(value - before.get(key, 0.0))
            for key, value in after.items()
            if key.startswith(prefix)
        }
        return {k: v for k, v in sorted(counts.items()) if v}

    return {
        "routing_decisions": by("ray_baton_routing_decisions_total", "reason"),
        "pull_outcomes": by("ray_baton_state_pulls_total", "outcome"),
    }


def _difference(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {
        "checkpoints_shipped": after["pulls"] - before["pulls"],
        "bytes_shipped": after["pulled_bytes"] - before["pulled_bytes"],
    }


# ---- the replicas' own counters ---------------------------------------------------------------


async def _pull_counters(app: str) -> dict[str, int]:
    stats = await replica_stats(app)
    return {key: sum(int(s[key]) for s in stats) for key in ("pulls", "pulled_bytes")}


# ---- one policy -----------------------------------------------------------------------------


def _count_new_tokens(records: list[RequestRecord]) -> None:
    """Each request's prompt tokens not in the prompt and reply of a request finished before
    it started (requests computing the same prefix at the same time each count it)."""
    for record in records:
        done = (r.prompt + r.reply for r in records if r.finished_s <= record.started_s)
        shared = max((common_prefix_length(record.prompt, tokens) for tokens in done), default=0)
        record.new_tokens = len(record.prompt) - shared


async def _warm_up(client: Client, replicas: int) -> int:
    """Short unrelated requests, so no policy pays llama.cpp's first-call costs in its TTFT;
    returns how many were sent."""
    count = WARMUP_REQUESTS_PER_REPLICA * replicas
    for i in range(count):
        reply = await client.chat([{"role": "user", "content": f"Warm-up {i}: say hi."}], 4)
        if reply.error:
            raise RuntimeError(f"warm-up request failed: {reply.error}")
    return count


async def _policy_run(
    policy: RouterPolicy,
    config: BatonConfig,
    url: str,
    app: str,
    model: LlamaModel,
    script: Script,
    workload: RoutingWorkload,
    recorded: Callable[[int], None],
) -> tuple[list[RequestRecord], dict]:
    async with bench_client(HTTP_TIMEOUT_S) as http:
        client = Client(http, url, config.served_model_name)
        warmups = await _warm_up(client, config.replicas)
        await wait_idle(app)
        run = Run(policy.value, client, model, workload, recorded)
        figures = await _scenarios(run, script, workload, app, warmups)
    _count_new_tokens(run.records)
    return run.records, figures


# ---- the benchmark --------------------------------------------------------------------------


def routing_benchmark(
    model_path: Path,
    *,
    workload: RoutingWorkload = RoutingWorkload(),
    policies: Sequence[RouterPolicy] = POLICIES,
    replicas: int = 2,
    index: str | None = None,
    cpus_per_replica: float = 1.0,
    http_port: int | None = None,
    progress: Progress = SILENT,
) -> tuple[dict, list[RequestRecord]]:
    """Run `workload` against each of `policies` on `replicas` replicas of `model_path`.

    `index` is "embedded", a redis:// URL, or None for a private redis-server. Ray is started
    here unless running (with enough logical CPUs); Serve is started on a free port unless
    `http_port` names a running one. Returns the summary and every request.
    """
    # A Ray started here flushes metrics every second (not 10), so each scenario's routing
    # decisions can be read soon after it ends.
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    threads = max(1, (os.cpu_count() or 1) // replicas)
    engine = EngineConfig(n_ctx=workload.n_ctx(), n_slots=4, n_threads=threads)
    num_cpus = local_cluster_cpus(replicas * cpus_per_replica + GATEWAY_CPUS)
    model = LlamaModel(model_path, vocab_only=True)
    try:
        script = Script.make(workload, model)
        records: list[RequestRecord] = []
        summaries = {}
        with redis_url_or_private_server(index) as index_spec, local_ray(num_cpus):
            base = BatonConfig(
                model=str(model_path),
                replicas=replicas,
                num_cpus_per_replica=cpus_per_replica,
                engine=engine,
                index=index_spec,
                heartbeat_s=HEARTBEAT_S,
                hmac_key=secrets.token_hex(16),
            )
            per_policy = workload.requests()
            progress.start(len(policies) * per_policy)
            for i, policy in enumerate(policies):
                name = f"policy {policy.value} ({i + 1}/{len(policies)})"
                progress.step(f"{name}: deploying {replicas} replicas and warming up")

                def recorded(n: int, name: str = name, done: int = i * per_policy) -> None:
                    progress.step(f"{name}: request {n}/{per_policy}", done=done + n)

                config = base.model_copy(update={"router": policy})
                app = f"routing-{policy.value}"
                with serve_app(config, app, http_port) as url:
                    rows, scenarios = asyncio.run(
                        _policy_run(policy, config, url, app, model, script, workload, recorded)
                    )
                records += rows
                summaries[policy.value] = summarize(rows, scenarios)
    finally:
        model.close()
    result = {
        "model": str(model_path),
        "replicas": replicas,
        "threads_per_replica": threads,
        "index": "redis" if index_spec.startswith("redis") else index_spec,
        "workload": asdict(workload),
        "policies": summaries,
        "targets": policy_targets(summaries, replicas),
    }
    return result, records
