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
step can be told from a gateway-bound one. The same ramp then runs against Ray Serve's floor
(`serve_floor`: a FastAPI ingress and a handle call, no Baton code) on a fresh Ray with the
same settings, so Baton's own part of the added latency can be told from Ray Serve's. A last,
traced run at a low rate cuts the added latency into its parts (`span_breakdown`).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from functools import partial

import httpx
import numpy as np

from baton_serve.deploy.app import (
    GATEWAY_CPUS,
    GATEWAY_DEPLOYMENT,
    REPLICA_DEPLOYMENT,
    local_cluster_cpus,
    replica_max_ongoing,
)
from baton_serve.deploy.config import BatonConfig
from baton_serve.loadtests.bench_http import bench_client
from baton_serve.loadtests.gateway_load import (
    REQUEST_TIMEOUT_S,
    Client,
    CpuMeter,
    Prompts,
    Sent,
    quantiles,
    step_figures,
)
from baton_serve.loadtests.progress import SILENT
from baton_serve.loadtests.serve_app import on_local_ray, on_local_ray_application, wait_idle
from baton_serve.loadtests.serve_floor import (
    ENGINE_CPUS,
    ENGINE_DEPLOYMENT,
    INGRESS_DEPLOYMENT,
    floor_app,
)
from baton_serve.loadtests.span_breakdown import (
    GATEWAY_ROOT,
    NEEDED,
    TTFT_PARTS,
    SpanReceiver,
    request_parts,
)
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
FLOOR_APP = "serve-floor"
FLOOR = "Ray Serve floor: a FastAPI ingress streaming one handle call (Ray's pow2), no Baton code"
COMPLETIONS_ROOT = "POST /v1/completions"  # the gateway's root span of these requests
LIMITS_MS = (10.0, 50.0)  # the target, and the fallback where the target is never met
MIN_ACHIEVED = 0.95  # of the offered rate
MISSES_TO_STOP = 2  # steps past the loosest limit before the ramp stops
WARMUP_REQUESTS = 20
BLOCK_TOKENS = 16


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
    floor: bool = True  # the same ramp against Ray Serve's floor (`serve_floor`)

    def prompts(self, n_vocab: int) -> Prompts:
        """The seeded prompts of one run (each run sends the same)."""
        return Prompts(self.prompt_tokens, self.prefixes, self.seed, n_vocab)


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


async def _ramp(
    url: str,
    model: str,
    settings: GatewayRateSettings,
    prompts: Prompts,
    meter: Callable[[], CpuMeter],
    step: Callable[[str], None],
) -> list[dict]:
    """Every rate step against the app at `url` (its processes metered by `meter()`), until
    one falls behind or `MISSES_TO_STOP` pass no limit."""
    rng = np.random.default_rng(settings.seed)
    async with bench_client(REQUEST_TIMEOUT_S, keepalive=500) as http:
        client = Client(http, url, model, prompts)
        for _ in range(WARMUP_REQUESTS):  # first-call costs (connections, imports, caches)
            warm = await client.send(0.0)
            if warm.error:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        cpu_meter, steps, misses = meter(), [], 0
        for rate in settings.rates:
            step(f"{rate:g} req/s for {settings.step_s:g} s")
            before = cpu_meter.seconds()
            sent, wall = await client.open_loop(rate, settings.step_s, rng)
            cpu = {k: v - before.get(k, 0.0) for k, v in cpu_meter.seconds().items()}
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
        num_cpus_per_replica=ENGINE_CPUS,  # as the floor's engines: any number fit
        engine=engine_config(settings),
        index="embedded",
        hmac_key=secrets.token_hex(16),
    )
    return on_local_ray(config, APP, env)


def gateway_rate_benchmark(
    model_path: str, settings: GatewayRateSettings = GatewayRateSettings(), *, progress=SILENT
) -> dict:
    """The ramp on Baton's app, then (unless `floor` is off) on Ray Serve's floor, then
    (unless `breakdown_rate` is 0) the traced low-rate run on Baton's app again, each on a
    fresh Ray; the figures as one JSON-ready dict."""
    model = LlamaModel(model_path, vocab_only=True)
    try:
        n_vocab = model.n_vocab
    finally:
        model.close()
    progress.start((len(settings.rates) + 1) * (1 + settings.floor) + 1)
    step: Callable[[str], None] = progress.step
    step(f"deploying {settings.replicas} emulated:instant replicas, 1 gateway replica")
    meter = partial(CpuMeter, APP, GATEWAY_DEPLOYMENT, REPLICA_DEPLOYMENT)
    with _deployed(model_path, settings, {}) as (url, name):
        ramp = _ramp(url, name, settings, settings.prompts(n_vocab), meter, step)
        steps = asyncio.run(ramp)
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
    if settings.floor:
        step(f"deploying Ray Serve's floor: 1 ingress replica, {settings.replicas} engines")
        floor_steps = _floor_ramp(settings, n_vocab, step)
        result["floor"] = {
            "app": FLOOR,
            "steps": floor_steps,
            "sustained_per_s": sustained(floor_steps),
        }
    if settings.breakdown_rate > 0:
        step(f"traced run at {settings.breakdown_rate:g} req/s, for the breakdown")
        result["breakdown"] = _breakdown(model_path, settings, n_vocab)
    return result


def _floor_ramp(
    settings: GatewayRateSettings, n_vocab: int, step: Callable[[str], None]
) -> list[dict]:
    """The ramp against `serve_floor`'s app, its engines taking as many requests at once
    as Baton's replicas here."""
    max_ongoing = replica_max_ongoing(engine_config(settings).n_slots)
    build = partial(floor_app, settings.replicas, max_ongoing)
    cpus = local_cluster_cpus(settings.replicas * ENGINE_CPUS + GATEWAY_CPUS)
    meter = partial(CpuMeter, FLOOR_APP, INGRESS_DEPLOYMENT, ENGINE_DEPLOYMENT)
    with on_local_ray_application(build, FLOOR_APP, cpus, {}) as url:
        return asyncio.run(_ramp(url, "floor", settings, settings.prompts(n_vocab), meter, step))


def _breakdown(model_path: str, settings: GatewayRateSettings, n_vocab: int) -> dict:
    with SpanReceiver().running() as receiver:
        with _deployed(model_path, settings, receiver.env) as (url, name):
            sent = asyncio.run(_traced(url, name, settings, settings.prompts(n_vocab)))
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
        "ttft_ms": quantiles(ok),
        "parts_ms": part_quantiles(sent),
    }
