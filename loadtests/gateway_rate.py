"""`baton bench gateway`: the request rate one gateway replica sustains, with instant engines.

Baton's real Serve app (HAProxy, ONE gateway replica with Baton's router, the embedded
index) over `replicas` replicas whose engines are emulated with an instant timing
(`emulated:instant`: compute takes ~0), so the time a client waits is what the serving path
adds. An open-loop load (seeded Poisson arrivals) steps through increasing request rates;
each request is a short token-id prompt (one of a few shared prefixes and its own tail),
`max_tokens` 1, streamed with usage as real clients send it. The client's time to the first
token is the added latency. A step passes a limit when its p99 is within the limit, no
request failed, and it kept up: answered at least `MIN_ACHIEVED` of the rate it sent. The
sustained rate is the highest offered rate that passes.

The load generator shares the machine: each step reports its own CPU use (and that of the
gateway, proxy and replica processes), and how late it sent requests, so a generator-bound
step can be told from a gateway-bound one. A last, traced run at a low rate cuts the added
latency into its parts (`span_breakdown`).
"""

from __future__ import annotations

import asyncio
import math
import os
import secrets
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass

import httpx
import numpy as np
import psutil

from baton_serve.deploy.app import GATEWAY_DEPLOYMENT, REPLICA_DEPLOYMENT
from baton_serve.deploy.config import BatonConfig
from baton_serve.loadtests.bench_http import bench_client
from baton_serve.loadtests.progress import SILENT
from baton_serve.loadtests.serve_app import on_local_ray, wait_idle
from baton_serve.loadtests.span_breakdown import (
    GATEWAY_ROOT,
    NEEDED,
    TTFT_PARTS,
    SpanReceiver,
    new_trace,
    request_parts,
)
from baton_serve.loadtests.sse import StreamError, aresponse_events
from baton_serve.replicas.engine.emulated_timing import EmulatedTiming
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_model import LlamaModel

INSTANT_SPEED = 1e12  # tokens (or bytes) a second: every step takes ~0
INSTANT = EmulatedTiming(
    name="instant",
    prefill_tokens_per_s=INSTANT_SPEED,
    decode_tokens_per_s=INSTANT_SPEED,
    batch_decode_tokens_per_s=INSTANT_SPEED,
    batch_slots=1,
    state_bytes_per_token=0,
    restore_bytes_per_s=INSTANT_SPEED,
)
APP = "gateway-rate"
COMPLETIONS_ROOT = "POST /v1/completions"  # the gateway's root span of these requests
LIMITS_MS = (10.0, 50.0)  # the target, and the fallback where the target is never met
MIN_ACHIEVED = 0.95  # of the offered rate
MISSES_TO_STOP = 2  # steps past the loosest limit before the ramp stops
REQUEST_TIMEOUT_S = 30.0
WARMUP_REQUESTS = 20
BLOCK_TOKENS = 16
QUANTILES = (50, 95, 99)


@dataclass(frozen=True)
class GatewayRateSettings:
    """The ramp: offered rates (req/s), seconds a step, and the requests' shape."""

    replicas: int = 2
    rates: tuple[float, ...] = (10, 20, 40, 80, 160, 320, 640, 1280)
    step_s: float = 10.0
    prompt_tokens: int = 32
    prefixes: int = 4  # distinct shared prefixes (3/4 of each prompt)
    seed: int = 0
    breakdown_rate: float = 5.0  # req/s of the traced run (0: no breakdown)
    breakdown_s: float = 10.0


@dataclass
class Sent:
    """One request as the client saw it (times in seconds)."""

    lag_s: float  # sent this late after its Poisson arrival time
    ttft_s: float | None = None
    total_s: float | None = None
    error: str | None = None
    trace_id: str = ""
    sent_ns: int = 0
    parts: dict[str, float] | None = None


def engine_config(settings: GatewayRateSettings) -> EngineConfig:
    """The replicas' engine: instant, with room for the short prompts."""
    return EngineConfig(
        n_ctx=max(256, 4 * settings.prompt_tokens),
        n_slots=4,
        n_threads=1,
        prefill_chunk=64,
        block_tokens=BLOCK_TOKENS,
        checkpoint_interval=64,
        emulated=INSTANT,
    )


class Prompts:
    """Seeded token-id prompts: one of `prefixes` shared heads, then the request's own tail."""

    def __init__(self, settings: GatewayRateSettings, n_vocab: int) -> None:
        rng = np.random.default_rng(settings.seed)
        low, high = min(100, n_vocab - 1), n_vocab
        head = settings.prompt_tokens * 3 // 4
        self._heads = rng.integers(low, high, (settings.prefixes, head)).tolist()
        self._tails = np.random.default_rng(settings.seed + 1)
        self._tail, self._low, self._high = settings.prompt_tokens - head, low, high

    def next(self) -> list[int]:
        head = self._heads[int(self._tails.integers(len(self._heads)))]
        return head + self._tails.integers(self._low, self._high, self._tail).tolist()


class Client:
    """Sends the bench's requests to one app and measures each."""

    def __init__(self, http: httpx.AsyncClient, url: str, model: str, prompts: Prompts) -> None:
        self._http, self._url, self._model, self._prompts = http, url, model, prompts

    async def send(self, lag_s: float, *, traced: bool = False) -> Sent:
        body = {"model": self._model, "prompt": self._prompts.next(), "max_tokens": 1}
        body |= {"temperature": 0, "ignore_eos": True, "stream": True}
        body |= {"stream_options": {"include_usage": True}}
        sent = Sent(lag_s=lag_s, sent_ns=time.time_ns())
        headers = {}
        if traced:
            sent.trace_id, headers["traceparent"] = new_trace()
        started = time.perf_counter()
        try:
            async with (
                asyncio.timeout(REQUEST_TIMEOUT_S),
                self._http.stream(
                    "POST", f"{self._url}/v1/completions", json=body, headers=headers
                ) as r,
            ):
                if r.status_code != 200:
                    await r.aread()
                    sent.error = f"HTTP {r.status_code}"
                    return sent
                async for chunk in aresponse_events(r):
                    if sent.ttft_s is None and chunk["choices"] and chunk["choices"][0]["text"]:
                        sent.ttft_s = time.perf_counter() - started
        except StreamError as exc:
            sent.error = (exc.error or {}).get("type") or "stream error"
        except httpx.HTTPError as exc:
            sent.error = type(exc).__name__
        except TimeoutError:
            sent.error = f"no reply within {REQUEST_TIMEOUT_S:g} s"
        else:
            sent.total_s = time.perf_counter() - started
            if sent.ttft_s is None:
                sent.error = "no token"
        return sent

    async def open_loop(
        self, rate: float, seconds: float, rng: np.random.Generator, *, traced: bool = False
    ) -> tuple[list[Sent], float]:
        """Poisson arrivals at `rate` for `seconds`, each sent whether or not earlier ones
        have answered; every request, and the time until the last one ended (at least
        `seconds`)."""
        arrivals = np.cumsum(rng.exponential(1 / rate, math.ceil(rate * seconds * 2) + 10))
        arrivals = arrivals[arrivals < seconds]
        start = time.perf_counter()
        tasks = []
        for at in arrivals:
            if (wait := start + at - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            lag = time.perf_counter() - start - at
            tasks.append(asyncio.create_task(self.send(lag, traced=traced)))
        sent = list(await asyncio.gather(*tasks))
        return sent, max(seconds, time.perf_counter() - start)


class CpuMeter:
    """CPU seconds of this process (the load generator) and of the app's Ray processes,
    found by their command lines: the gateway and the replicas (`ray::ServeReplica:APP:…`)
    and the HTTP ingress (the `haproxy` process, its manager actor, Serve's fallback proxy)."""

    def __init__(self, app: str) -> None:
        self._groups: dict[str, list[psutil.Process]] = {"generator": [psutil.Process()]}
        prefixes = {
            "gateway": (f"ray::ServeReplica:{app}:{GATEWAY_DEPLOYMENT}",),
            "replicas": (f"ray::ServeReplica:{app}:{REPLICA_DEPLOYMENT}",),
            "proxy": ("ray::ProxyActor", "ray::HAProxyManager"),
        }
        for proc in psutil.process_iter(["cmdline", "name"]):
            line = " ".join(proc.info["cmdline"] or ())
            group = (
                "proxy"
                if proc.info["name"] == "haproxy"
                else next((g for g, starts in prefixes.items() if line.startswith(starts)), None)
            )
            if group is not None:
                self._groups.setdefault(group, []).append(proc)

    def seconds(self) -> dict[str, float]:
        found = {}
        for group, procs in self._groups.items():
            total = 0.0
            for proc in procs:
                try:
                    times = proc.cpu_times()
                except psutil.Error:  # a replica gone: its time is no longer counted
                    continue
                total += times.user + times.system
            found[group] = total
        return found


def _quantiles(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": float(np.percentile(values, q)) if values else None for q in QUANTILES}


def step_figures(
    rate: float, seconds: float, sent: list[Sent], wall_s: float, cpu: dict[str, float]
) -> dict:
    """One step: added latency (TTFT) and total in ms, the rate sent (the Poisson draw's,
    over `seconds`) and achieved (answered over the time to the last answer), errors, CPU
    (cores)."""
    ok = [s for s in sent if s.error is None]
    ms = {k: v * 1e3 for k, v in _quantiles([s.ttft_s for s in ok]).items() if v is not None}
    total = {k: v * 1e3 for k, v in _quantiles([s.total_s for s in ok]).items() if v is not None}
    achieved = len(ok) / wall_s if wall_s > 0 else 0.0
    return {
        "offered_per_s": rate,
        "sent_per_s": len(sent) / seconds,
        "requests": len(sent),
        "errors": len(sent) - len(ok),
        "error_kinds": sorted({s.error for s in sent if s.error}),
        "achieved_per_s": achieved,
        "ttft_ms": ms,
        "total_ms": total,
        "send_lag_ms": {k: v * 1e3 for k, v in _quantiles([s.lag_s for s in sent]).items() if v},
        "cpu_cores": {k: v / wall_s for k, v in cpu.items()} if wall_s > 0 else {},
        "wall_s": wall_s,
    }


def passes(step: dict, limit_ms: float) -> bool:
    """The step's p99 within `limit_ms`, no error, and it kept up (`kept_up`)."""
    p99 = step["ttft_ms"].get("p99")
    return p99 is not None and p99 <= limit_ms and kept_up(step) and not step["errors"]


def kept_up(step: dict) -> bool:
    """Answered at least `MIN_ACHIEVED` of the rate sent (a short step's Poisson draw is
    itself a few percent off the offered rate)."""
    return step["achieved_per_s"] >= MIN_ACHIEVED * step["sent_per_s"]


def sustained(steps: list[dict]) -> dict[str, float | None]:
    """Per limit: the highest offered rate of a step that passes it (None: none did)."""
    return {
        f"p99_le_{limit:g}ms": max(
            (s["offered_per_s"] for s in steps if passes(s, limit)), default=None
        )
        for limit in LIMITS_MS
    }


async def _ramp(url: str, model: str, settings: GatewayRateSettings, prompts: Prompts, step):
    rng = np.random.default_rng(settings.seed)
    async with bench_client(REQUEST_TIMEOUT_S, keepalive=500) as http:
        client = Client(http, url, model, prompts)
        for _ in range(WARMUP_REQUESTS):  # first-call costs (connections, imports, caches)
            warm = await client.send(0.0)
            if warm.error:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        meter, steps, misses = CpuMeter(APP), [], 0
        for rate in settings.rates:
            step(f"{rate:g} req/s for {settings.step_s:g} s")
            before = meter.seconds()
            sent, wall = await client.open_loop(rate, settings.step_s, rng)
            cpu = {k: v - before.get(k, 0.0) for k, v in meter.seconds().items()}
            steps.append(step_figures(rate, settings.step_s, sent, wall, cpu))
            misses += not passes(steps[-1], max(LIMITS_MS))
            if misses >= MISSES_TO_STOP or not kept_up(steps[-1]):
                break
        return steps


async def _traced(url: str, model: str, settings: GatewayRateSettings, prompts: Prompts):
    async with bench_client(REQUEST_TIMEOUT_S) as http:
        client = Client(http, url, model, prompts)
        for _ in range(WARMUP_REQUESTS):
            await client.send(0.0)
        rng = np.random.default_rng(settings.seed + 2)
        sent, _ = await client.open_loop(
            settings.breakdown_rate, settings.breakdown_s, rng, traced=True
        )
    return sent


def _spans_arrived(receiver: SpanReceiver, sent: list[Sent], timeout_s: float = 15.0) -> None:
    """Until every traced request has the spans of its TTFT (a one-token reply has no
    `decode` span; its root is the completions route's)."""
    needed = {COMPLETIONS_ROOT, *(n for n in NEEDED if n not in (GATEWAY_ROOT, "decode"))}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(needed <= set(receiver.spans(s.trace_id)) for s in sent if s.error is None):
            return
        time.sleep(0.1)


def part_quantiles(sent: list[Sent]) -> dict[str, dict[str, float]]:
    """p50 and p99 (ms) of each part of the TTFT over the traced requests."""
    rows = [s.parts for s in sent if s.parts]
    return {
        name: {f"p{q}": float(np.percentile([r[name] for r in rows], q)) * 1e3 for q in (50, 99)}
        for name in TTFT_PARTS
        if rows
    }


def _deployed(
    model_path: str, settings: GatewayRateSettings, env: dict[str, str]
) -> AbstractContextManager[tuple[str, str]]:
    """A fresh local Ray (its processes see `env`) with the app deployed; yields its URL
    and served model name."""
    config = BatonConfig(
        model=model_path,
        replicas=settings.replicas,
        gateway_replicas=1,
        num_cpus_per_replica=0.01,
        engine=engine_config(settings),
        index="embedded",
        hmac_key=secrets.token_hex(16),
    )
    return on_local_ray(config, APP, env)


def gateway_rate_benchmark(
    model_path: str, settings: GatewayRateSettings = GatewayRateSettings(), *, progress=SILENT
) -> dict:
    """The ramp on one deployment, then (unless `breakdown_rate` is 0) the traced low-rate
    run on a second one; the figures as one JSON-ready dict."""
    model = LlamaModel(model_path, vocab_only=True)
    try:
        n_vocab = model.n_vocab
    finally:
        model.close()
    progress.start(len(settings.rates) + 2)
    step: Callable[[str], None] = progress.step
    step(f"deploying {settings.replicas} emulated:instant replicas, 1 gateway replica")
    with _deployed(model_path, settings, {}) as (url, name):
        steps = asyncio.run(_ramp(url, name, settings, Prompts(settings, n_vocab), step))
        health = httpx.get(f"{url}/health").json()
    result = {
        "model": model_path,
        "settings": asdict(settings),
        "engine": f"emulated:{INSTANT.name}",
        "health": health,
        "limits_ms": list(LIMITS_MS),
        "min_achieved": MIN_ACHIEVED,
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "steps": steps,
        "sustained_per_s": sustained(steps),
    }
    if settings.breakdown_rate > 0:
        step(f"traced run at {settings.breakdown_rate:g} req/s, for the breakdown")
        result["breakdown"] = _breakdown(model_path, settings, n_vocab)
    return result


def _breakdown(model_path: str, settings: GatewayRateSettings, n_vocab: int) -> dict:
    with SpanReceiver().running() as receiver:
        with _deployed(model_path, settings, receiver.env) as (url, name):
            sent = asyncio.run(_traced(url, name, settings, Prompts(settings, n_vocab)))
            asyncio.run(wait_idle(APP))
        _spans_arrived(receiver, sent)
        for s in sent:
            if s.error is None and s.ttft_s is not None:
                spans = receiver.spans(s.trace_id)
                if COMPLETIONS_ROOT in spans:
                    spans[GATEWAY_ROOT] = spans.pop(COMPLETIONS_ROOT)
                first_token_ns = s.sent_ns + int(s.ttft_s * 1e9)
                s.parts = request_parts(spans, s.sent_ns, first_token_ns, 1)
    ok = [s.ttft_s * 1e3 for s in sent if s.error is None and s.ttft_s is not None]
    return {
        "rate_per_s": settings.breakdown_rate,
        "requests": len(sent),
        "traced": sum(1 for s in sent if s.parts),
        "ttft_ms": _quantiles(ok),
        "parts_ms": part_quantiles(sent),
    }
