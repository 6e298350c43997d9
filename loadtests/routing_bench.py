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
import csv
import itertools
import json
import math
import os
import random
import secrets
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from baton_serve.cache_store.prefix_hash import common_prefix_length
from baton_serve.deploy.app import GATEWAY_CPUS
from baton_serve.deploy.config import BatonConfig, RouterPolicy
from baton_serve.deploy.local_ray import local_ray
from baton_serve.loadtests.index_bench import redis_url_or_private_server
from baton_serve.loadtests.ray_metrics import settled_counters
from baton_serve.loadtests.serve_app import replica_stats, serve_app, wait_idle
from baton_serve.loadtests.synthetic_text import filler_text
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.prompt import ChatMessage, chat_prompt, model_chat_template

POLICIES = tuple(RouterPolicy)
BASELINE = RouterPolicy.POW2
ANCHOR = RouterPolicy.PREFIX_AFFINITY
TTFT_RATIO_TARGET = 0.3  # Baton's TTFT p50 over power-of-two's
COMPUTED_OVER_NEW_TARGET = 1.2

HTTP_TIMEOUT_S = 600.0
PUBLISH_WAIT_S = 1.0  # a finished turn's checkpoint reaches the index (heartbeat below)
STATS_WAIT_S = 1.0  # routing stats (every 0.5 s) show the busy replica's load
BLOCKERS = 2  # long requests that make a moved session's replica busy
HEARTBEAT_S = 0.2
WARMUP_REQUESTS_PER_REPLICA = 2
CHAT, MOVED = "chat", "moved"


@dataclass(frozen=True)
class RoutingWorkload:
    """The requests every policy is sent (sizes in tokens of the served model)."""

    sessions: int = 8
    turns: int = 5
    concurrency: int = 4
    system_tokens: int = 1000
    document_tokens: int = 800
    turn_tokens: int = 60
    reply_tokens: int = 24
    think_s: float = 2.0  # mean pause before each later turn (uniform in [0, 2 x think_s])
    moved_sessions: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.sessions, self.turns, self.concurrency, self.reply_tokens) < 1:
            raise ValueError("sessions, turns, concurrency and reply_tokens must be >= 1")
        if min(self.system_tokens, self.document_tokens, self.turn_tokens) < 1:
            raise ValueError("token sizes must be >= 1")
        if self.moved_sessions < 0 or self.think_s < 0:
            raise ValueError("moved_sessions and think_s must be >= 0")

    def n_ctx(self) -> int:
        """A context that holds the longest conversation, with room for long blockers."""
        per_turn = self.turn_tokens + self.reply_tokens + 32  # 32: template tokens and slack
        longest = self.system_tokens + self.document_tokens + self.turns * per_turn
        return 1024 * math.ceil((longest + 1024) / 1024)


@dataclass(frozen=True)
class Conversation:
    """One session's script: its document, the user message of each turn, and the user's
    pause before each turn (the first's is 0)."""

    scenario: str
    session: int
    document: str
    questions: tuple[str, ...]
    pauses_s: tuple[float, ...]


@dataclass(frozen=True)
class Script:
    system: str
    conversations: tuple[Conversation, ...]

    @classmethod
    def make(cls, workload: RoutingWorkload, model: LlamaModel) -> Script:
        def text(n_tokens: int, seed: int, topic: str = "") -> str:
            return filler_text(n_tokens, count, seed=seed, topic=topic)

        count = lambda s: len(model.tokenize(s))  # noqa: E731
        rng = random.Random(workload.seed)
        seeds = iter(lambda: rng.randrange(2**32), None)
        conversations = []
        for scenario, sessions, turns in (
            (CHAT, workload.sessions, workload.turns),
            (MOVED, workload.moved_sessions, 2),
        ):
            for session in range(sessions):
                document = text(workload.document_tokens, next(seeds), f"Document {session}:")
                questions = tuple(
                    text(workload.turn_tokens, next(seeds), f"Question {turn + 1}:")
                    for turn in range(turns)
                )
                pauses = (0.0, *(rng.uniform(0, 2 * workload.think_s) for _ in range(turns - 1)))
                conversations.append(Conversation(scenario, session, document, questions, pauses))
        system = text(workload.system_tokens, next(seeds), "You are a helpful assistant.")
        return cls(system=system, conversations=tuple(conversations))


@dataclass
class RequestRecord:
    """One request of one policy's run."""

    policy: str
    scenario: str
    session: int
    turn: int
    started_s: float  # since the policy's run started
    ttft_s: float | None
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    new_tokens: int = 0
    error: str | None = None
    prompt: tuple[int, ...] = field(default=(), repr=False)  # tokens, for counting new ones
    reply: tuple[int, ...] = field(default=(), repr=False)

    @property
    def computed_tokens(self) -> int:
        return 0 if self.error else self.prompt_tokens - self.cached_tokens

    @property
    def finished_s(self) -> float:
        return self.started_s + self.total_s


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
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    reply.error = chunk["error"].get("type") or "stream error"
                    return reply
                delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else ""
                if delta:
                    reply.ttft_s = reply.ttft_s or time.perf_counter() - started
                    reply.text += delta
                reply.usage = chunk.get("usage") or reply.usage
        if not reply.usage:
            reply.error = "no usage"
        return reply


class _Run:
    """One policy's requests, recorded against a shared clock and tokeniser."""

    def __init__(
        self, policy: str, client: _Client, model: LlamaModel, workload: RoutingWorkload
    ) -> None:
        self.policy = policy
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
) -> tuple[list[RequestRecord], dict]:
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
        client = _Client(http, url, config.served_model_name)
        warmups = await _warm_up(client, config.replicas)
        await wait_idle(app)
        run = _Run(policy.value, client, model, workload)
        figures = await _scenarios(run, script, workload, app, warmups)
    _count_new_tokens(run.records)
    return run.records, figures


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[RequestRecord], scenarios: dict) -> dict:
    """A policy's figures: the chat scenario at the top level, the moved one under "moved"."""

    def figures(scenario: str) -> dict:
        rows = [r for r in records if r.scenario == scenario]
        ok = [r for r in rows if not r.error]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        prompt = sum(r.prompt_tokens for r in ok)
        cached = sum(r.cached_tokens for r in ok)
        computed = sum(r.computed_tokens for r in ok)
        new = sum(r.new_tokens for r in ok)
        return {
            "requests": len(rows),
            "errors": len(rows) - len(ok),
            "ttft_p50_s": _percentile(ttfts, 50),
            "ttft_p95_s": _percentile(ttfts, 95),
            "ttft_p99_s": _percentile(ttfts, 99),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "computed_prompt_tokens": computed,
            "new_prompt_tokens": new,
            "cached_ratio": cached / prompt if prompt else None,
            "computed_over_new": computed / new if new else None,
            **scenarios[scenario],
        }

    return figures(CHAT) | {MOVED: figures(MOVED)}


def _targets(policies: dict[str, dict]) -> dict[str, dict]:
    """The issue's targets, where the policies they compare were run."""
    baton = policies.get(RouterPolicy.BATON.value)
    if baton is None:
        return {}
    targets = {}
    if (baton_new := baton["computed_over_new"]) is not None:
        targets["computed_over_new"] = {
            "value": baton_new,
            "target": f"<= {COMPUTED_OVER_NEW_TARGET}",
            "met": baton_new <= COMPUTED_OVER_NEW_TARGET,
        }
    for other, name, bound in (
        (BASELINE, "ttft_p50_over_pow2", TTFT_RATIO_TARGET),
        (ANCHOR, "ttft_p50_over_prefix_affinity", 1.0),
    ):
        theirs = policies.get(other.value, {}).get("ttft_p50_s")
        if theirs and baton["ttft_p50_s"] is not None:
            ratio = baton["ttft_p50_s"] / theirs
            targets[name] = {"value": ratio, "target": f"<= {bound}", "met": ratio <= bound}
    return targets


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
            for policy in policies:
                config = base.model_copy(update={"router": policy})
                app = f"routing-{policy.value}"
                with serve_app(config, app, http_port) as url:
                    rows, scenarios = asyncio.run(
                        _policy_run(policy, config, url, app, model, script, workload)
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
        "targets": _targets(summaries),
    }
    return result, records


# ---- output ---------------------------------------------------------------------------------

_COLUMNS = (  # title, key, format, scale
    ("reqs", "requests", "d", 1),
    ("errs", "errors", "d", 1),
    ("TTFT p50", "ttft_p50_s", ".3f", 1),
    ("p95", "ttft_p95_s", ".3f", 1),
    ("p99", "ttft_p99_s", ".3f", 1),
    ("total s", "total_s", ".1f", 1),
    ("prompt", "prompt_tokens", "d", 1),
    ("computed", "computed_prompt_tokens", "d", 1),
    ("new", "new_prompt_tokens", "d", 1),
    ("cached", "cached_ratio", ".1%", 1),
    ("comp/new", "computed_over_new", ".3f", 1),
    ("shipped", "checkpoints_shipped", "d", 1),
    ("MB shipped", "bytes_shipped", ".1f", 1e-6),
)


def _table(policies: dict[str, dict]) -> list[str]:
    widths = [max(len(title), 8) for title, *_ in _COLUMNS]
    lines = [f"{'policy':<16}" + "".join(f" {t:>{w}}" for (t, *_), w in zip(_COLUMNS, widths))]
    for name, figures in policies.items():
        cells = [f"{name:<16}"]
        for (_, key, fmt, scale), width in zip(_COLUMNS, widths):
            value = figures[key]
            text = "-" if value is None else format(value * scale if scale != 1 else value, fmt)
            cells.append(f" {text:>{width}}")
        lines.append("".join(cells))
    return lines


def _decisions(policies: dict[str, dict]) -> list[str]:
    """Per policy, Baton's routing decisions by reason and its replicas' pull outcomes."""
    lines = []
    for name, figures in policies.items():
        parts = [
            f"{title} " + ", ".join(f"{k} {v}" for k, v in counts.items())
            for title, counts in (
                ("decisions:", figures.get("routing_decisions")),
                ("pulls:", figures.get("pull_outcomes")),
            )
            if counts
        ]
        if parts:
            lines.append(f"  {name}: " + "; ".join(parts))
    return lines


def format_report(result: dict) -> str:
    w = result["workload"]
    policies = result["policies"]
    lines = [
        f"model: {result['model']}, {result['replicas']} replicas x {result['threads_per_replica']}"
        f" thread(s), {result['index']} index",
        f"chat: {w['sessions']} sessions x {w['turns']} turns, {w['concurrency']} at a time;"
        f" system {w['system_tokens']} + document {w['document_tokens']} tokens, then"
        f" {w['turn_tokens']}-token questions and {w['reply_tokens']}-token replies,"
        f" {w['think_s']:g} s mean pause between turns; seed {w['seed']}",
        *_table(policies),
        *_decisions(policies),
        "",
        f"moved: {w['moved_sessions']} sessions whose replica is kept busy by {BLOCKERS} long"
        " requests before their second turn",
        *_table(moved := {name: figures[MOVED] for name, figures in policies.items()}),
        *_decisions(moved),
    ]
    if result["targets"]:
        lines.append("")
        for name, target in result["targets"].items():
            verdict = "met" if target["met"] else "NOT met"
            lines.append(f"{name}: {target['value']:.3f} (target {target['target']}): {verdict}")
    return "\n".join(lines)


def write_outputs(result: dict, records: list[RequestRecord], out_dir: Path) -> list[Path]:
    """summary.json, policies.csv, requests.csv and two PNG plots in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / name for name in ("summary.json", "policies.csv", "requests.csv")]
    written[0].write_text(json.dumps(result, indent=2) + "\n")
    with written[1].open("w", newline="") as file:
        rows = [
            {
                "policy": name,
                "scenario": scenario,
                **_flat(figures if scenario == CHAT else figures[MOVED]),
            }
            for name, figures in result["policies"].items()
            for scenario in (CHAT, MOVED)
        ]
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with written[2].open("w", newline="") as file:
        rows = [
            {k: v for k, v in asdict(r).items() if k not in ("prompt", "reply")}
            | {"computed_tokens": r.computed_tokens}
            for r in records
        ]
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return written + _plots(records, out_dir)


def _flat(figures: dict) -> dict:
    return {k: v for k, v in figures.items() if not isinstance(v, dict)}


def _plots(records: list[RequestRecord], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chat = [r for r in records if r.scenario == CHAT and not r.error]
    by_policy: dict[str, list[RequestRecord]] = defaultdict(list)
    for record in chat:
        by_policy[record.policy].append(record)

    cdf_path = out_dir / "ttft_cdf.png"
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for policy, rows in by_policy.items():
        ttfts = sorted(r.ttft_s for r in rows if r.ttft_s is not None)
        axes.step(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), where="post", label=policy)
    axes.set(xlabel="time to first token (s)", ylabel="share of requests", title="TTFT CDF (chat)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(cdf_path, dpi=120)
    plt.close(figure)

    turns_path = out_dir / "computed_per_turn.png"
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for (policy, rows), marker in zip(by_policy.items(), itertools.cycle("osD^v")):
        turns = sorted({r.turn for r in rows})
        mean = [np.mean([r.computed_tokens for r in rows if r.turn == t]) for t in turns]
        # Distinct markers, open: policies that compute the same show on top of each other.
        axes.plot(turns, mean, marker=marker, fillstyle="none", markersize=8, label=policy)
    turns = sorted({r.turn for r in chat})
    new = [np.mean([r.new_tokens for r in chat if r.turn == t]) for t in turns]
    axes.plot(turns, new, linestyle="--", color="black", label="new tokens (ideal)")
    axes.set(
        xlabel="turn",
        ylabel="computed prompt tokens (mean per request)",
        title="Prompt tokens computed per turn (chat)",
    )
    axes.set_xticks(turns)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(turns_path, dpi=120)
    plt.close(figure)
    return [cdf_path, turns_path]
