"""`baton bench routing`: one seeded workload against each request-routing policy, in one run.

For each policy a fresh Baton app (K replicas of one model, the same engine settings and
index) is deployed on one local Ray cluster and sent the same requests, in two scenarios:

- **chat** — `sessions` conversations sharing one system prompt, each opening with a document
  of its own and growing turn by turn (the previous reply sent back, after a seeded pause
  that stands for the user reading and typing), `concurrency` at a time;
- **moved** — conversations whose replica is made busy between two turns (long requests on
  the same prefix), so the next turn is better served elsewhere: Baton ships the state to the
  other replica; the other policies recompute it or queue behind the busy one.

Every request streams; TTFT is measured here, at the client. Computed prompt tokens are
`prompt_tokens - cached_tokens` from each response's usage. *New* tokens are what an ideal
cluster-wide cache would still compute: the prompt minus its longest common prefix with the
prompt and reply of any request that had finished when it started (tokenised here with the
model's vocabulary and template). Checkpoints and bytes shipped are the replicas' own pull
counters.
"""

from __future__ import annotations

import asyncio
import math
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from baton_serve.cache_store.prefix_hash import common_prefix_length
from baton_serve.deploy.app import GATEWAY_CPUS
from baton_serve.deploy.config import BatonConfig, RouterPolicy
from baton_serve.deploy.local_ray import local_ray
from baton_serve.loadtests.index_bench import redis_url_or_private_server
from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.loadtests.ray_metrics import settled_counters
from baton_serve.loadtests.routing_report import policy_targets, summarize
from baton_serve.loadtests.routing_workload import (
    BLOCKERS,
    CHAT,
    MOVED,
    Conversation,
    RequestRecord,
    RoutingWorkload,
    Script,
)
from baton_serve.loadtests.serve_app import replica_stats, serve_app, wait_idle
from baton_serve.loadtests.sse import StreamError, aevents
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.prompt import ChatMessage, chat_prompt, model_chat_template

POLICIES = tuple(RouterPolicy)

HTTP_TIMEOUT_S = 600.0
PUBLISH_WAIT_S = 1.0  # a finished turn's checkpoint reaches the index (heartbeat below)
STATS_WAIT_S = 1.0  # routing stats (every 0.5 s) show the busy replica's load
HEARTBEAT_S = 0.2
WARMUP_REQUESTS_PER_REPLICA = 2


@dataclass
class _Reply:
    text: str = ""
    ttft_s: float | None = None
    usage: dict = field(default_factory=dict)
    error: str | None = None


class _Client:
    """Streams chat completions from one deployed app."""

    def __init__(self, http: httpx.AsyncClient, url: str, model_name: str) -> None:
        self._http = http
        self._url = url
        self._model_name = model_name

    async def chat(self, messages: list[dict], max_tokens: int | None) -> _Reply:
        body = {
            "model": self._model_name,
            "messages": messages,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        reply = _Reply()
        started = time.perf_counter()
        async with self._http.stream("POST", f"{self._url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                reply.error = f"HTTP {r.status_code}"
                return reply
            try:
                async for chunk in aevents(r.aiter_lines()):
                    delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else ""
                    if delta:
                        reply.ttft_s = reply.ttft_s or time.perf_counter() - started
                        reply.text += delta
                    reply.usage = chunk.get("usage") or reply.usage
            except StreamError as exc:
                reply.error = (exc.error or {}).get("type") or "stream error"
                return reply
        if not reply.usage:
            reply.error = "no usage"
        return reply


class _Run:
    """One policy's requests, recorded against a shared clock and tokeniser; `recorded` is
    told how many there are after each."""

    def __init__(
        self,
        policy: str,
        client: _Client,
        model: LlamaModel,
        workload: RoutingWorkload,
        recorded: Callable[[int], None],
    ) -> None:
        self.policy = policy
        self._recorded = recorded
        self.records: list[RequestRecord] = []
        self._client = client
        self._model = model
        self._template = model_chat_template(model)
        self._workload = workload
        self._started = time.perf_counter()

    async def turn(self, conversation: Conversation, turn: int, messages: list[dict]) -> str:
        """Send `messages`; record the request; return the reply's text."""
        prompt = chat_prompt(self._model, self._template, [ChatMessage(**m) for m in messages])
        started = time.perf_counter()
        reply = await self._client.chat(messages, self._workload.reply_tokens)
        usage = reply.usage
        self.records.append(
            RequestRecord(
                policy=self.policy,
                scenario=conversation.scenario,
                session=conversation.session,
                turn=turn,
                started_s=started - self._started,
                ttft_s=reply.ttft_s,
                total_s=time.perf_counter() - started,
                prompt_tokens=usage.get("prompt_tokens", len(prompt)),
                cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                error=reply.error,
                prompt=prompt.tokens,
                reply=tuple(self._model.tokenize(reply.text)),
            )
        )
        self._recorded(len(self.records))
        return reply.text

    async def block(self, messages: list[dict]) -> None:
        """A request that generates until cancelled (or its context is full)."""
        await self._client.chat(messages, None)


def _opening(system: str, conversation: Conversation) -> list[dict]:
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"{conversation.document}\n\n{conversation.questions[0]}"},
    ]


async def _chat_session(run: _Run, system: str, conversation: Conversation) -> None:
    messages = _opening(system, conversation)
    for turn, (question, pause_s) in enumerate(zip(conversation.questions, conversation.pauses_s)):
        await asyncio.sleep(pause_s)
        if turn:
            messages.append({"role": "user", "content": question})
        reply = await run.turn(conversation, turn + 1, messages)
        messages.append({"role": "assistant", "content": reply})


async def _moved_session(run: _Run, system: str, conversation: Conversation) -> None:
    """Turn 1; then, while long requests on the same prefix keep its replica busy, turn 2."""
    messages = _opening(system, conversation)
    reply = await run.turn(conversation, 1, messages)
    await asyncio.sleep(PUBLISH_WAIT_S)
    blockers = [asyncio.create_task(run.block(list(messages))) for _ in range(BLOCKERS)]
    try:
        await asyncio.sleep(STATS_WAIT_S)
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": conversation.questions[1]},
        ]
        await run.turn(conversation, 2, messages)
    finally:
        for blocker in blockers:
            blocker.cancel()  # closes the stream: the gateway cancels the generation
        await asyncio.gather(*blockers, return_exceptions=True)


async def _scenarios(
    run: _Run, script: Script, workload: RoutingWorkload, app: str, warmups: int
) -> dict:
    """Both scenarios on one deployed app: for each, its wall time, the replicas' pulls, and
    the routing decisions and pull outcomes the app's metrics counted."""
    figures = {}
    slots = asyncio.Semaphore(workload.concurrency)

    async def limited(conversation: Conversation) -> None:
        async with slots:
            await _chat_session(run, script.system, conversation)

    chats = [c for c in script.conversations if c.scenario == CHAT]
    before = await _pull_counters(app)
    metrics_before = await _app_metrics(app, warmups)
    started = time.perf_counter()
    await asyncio.gather(*(limited(c) for c in chats))
    figures[CHAT] = {"total_s": time.perf_counter() - started}
    await wait_idle(app)
    after = await _pull_counters(app)
    metrics_after = await _app_metrics(app, warmups + len(run.records))
    figures[CHAT] |= _difference(after, before) | _metric_difference(metrics_after, metrics_before)

    started = time.perf_counter()
    moved = [c for c in script.conversations if c.scenario == MOVED]
    for conversation in moved:
        await _moved_session(run, script.system, conversation)
        await wait_idle(app)
    figures[MOVED] = {"total_s": time.perf_counter() - started}
    sent = warmups + len(run.records) + BLOCKERS * len(moved)
    figures[MOVED] |= _difference(await _pull_counters(app), after) | _metric_difference(
        await _app_metrics(app, sent), metrics_after
    )
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


async def _warm_up(client: _Client, replicas: int) -> int:
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
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
        client = _Client(http, url, config.served_model_name)
        warmups = await _warm_up(client, config.replicas)
        await wait_idle(app)
        run = _Run(policy.value, client, model, workload, recorded)
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
    num_cpus = max(os.cpu_count() or 1, math.ceil(replicas * cpus_per_replica + GATEWAY_CPUS))
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
            per_policy = workload.sessions * workload.turns + 2 * workload.moved_sessions
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
        "targets": policy_targets(summaries),
    }
    return result, records
