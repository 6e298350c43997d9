"""The load of `baton bench gateway`: seeded short prompts sent open-loop (Poisson arrivals)
to an app's `/v1/completions`, each request as the client saw it, the CPU of the load
generator and of the app's processes, and one rate step's figures."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import httpx
import numpy as np
import psutil

from baton_serve.loadtests.peer_play import new_trace
from baton_serve.loadtests.sse import StreamError, aresponse_events

REQUEST_TIMEOUT_S = 30.0
QUANTILES = (50, 95, 99)


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


class Prompts:
    """Seeded token-id prompts: one of `prefixes` shared heads, then the request's own tail."""

    def __init__(self, prompt_tokens: int, prefixes: int, seed: int, n_vocab: int) -> None:
        rng = np.random.default_rng(seed)
        low, high = min(100, n_vocab - 1), n_vocab
        head = prompt_tokens * 3 // 4
        self._heads = rng.integers(low, high, (prefixes, head)).tolist()
        self._tails = np.random.default_rng(seed + 1)
        self._tail, self._low, self._high = prompt_tokens - head, low, high

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
    found by their command lines: the gateway and the replicas (`ray::ServeReplica:APP:…`
    of the two deployments named) and the HTTP ingress (the `haproxy` process, its manager
    actor, Serve's fallback proxy)."""

    def __init__(self, app: str, gateway: str, replicas: str) -> None:
        self._groups: dict[str, list[psutil.Process]] = {"generator": [psutil.Process()]}
        prefixes = {
            "gateway": (f"ray::ServeReplica:{app}:{gateway}",),
            "replicas": (f"ray::ServeReplica:{app}:{replicas}",),
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


def quantiles(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": float(np.percentile(values, q)) if values else None for q in QUANTILES}


def step_figures(
    rate: float, seconds: float, sent: list[Sent], wall_s: float, cpu: dict[str, float]
) -> dict:
    """One step: added latency (TTFT) and total in ms, the rate sent (the Poisson draw's,
    over `seconds`) and achieved (answered over the time to the last answer), errors, CPU
    (cores)."""
    ok = [s for s in sent if s.error is None]
    ms = {k: v * 1e3 for k, v in quantiles([s.ttft_s for s in ok]).items() if v is not None}
    total = {k: v * 1e3 for k, v in quantiles([s.total_s for s in ok]).items() if v is not None}
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
        "send_lag_ms": {k: v * 1e3 for k, v in quantiles([s.lag_s for s in sent]).items() if v},
        "cpu_cores": {k: v / wall_s for k, v in cpu.items()} if wall_s > 0 else {},
        "wall_s": wall_s,
    }
