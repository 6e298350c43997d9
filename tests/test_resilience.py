"""Faults with real processes: a Serve app (two replicas of a generated hybrid model, a Redis
index on a redis-server of its own) under a bounded load while more requests arrive than it
can hold, Redis goes away for 30 s, or a replica is killed (under load, or while it runs one
long request: that request is not resent, and its repeat is refused)."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
import ray
from fixtures_ray import wait_healthy
from fixtures_redis import NO_REDIS
from ray import serve

from baton_serve.cache_store.fingerprint import file_fingerprint
from baton_serve.cache_store.index.index_connect import connect_index
from baton_serve.deploy.app import REPLICA_DEPLOYMENT, build_app
from baton_serve.deploy.config import BatonConfig
from baton_serve.deploy.local_ray import metrics_export_port
from baton_serve.loadtests.ray_metrics import app_counters
from baton_serve.loadtests.redis_server import RedisServer, redis_server_path
from baton_serve.loadtests.serve_app import replica_actors, replica_stats
from baton_serve.replicas.engine.engine_config import EngineConfig

APP = "resilience"
ENGINE = EngineConfig(n_ctx=2048, n_slots=2, n_threads=1, prefill_chunk=128)
MAX_QUEUED = 8  # above the load's concurrency: Ray counts a burst as queued before routing it
SYSTEM = "You are the operator's assistant; answer about replicas and caches briefly. " * 12
LOAD_WORKERS = 4
TURNS_PER_SESSION = 5
OUTAGE_S = 30.0
FORGET_WITHIN_S = 30.0


@dataclass
class App:
    url: str
    config: BatonConfig
    redis: RedisServer


@pytest.fixture(scope="module")
def app(serve_port, tiny_model) -> Iterator[App]:
    if redis_server_path() is None:
        pytest.skip(NO_REDIS)
    with RedisServer() as redis:
        config = BatonConfig(
            model=str(tiny_model("qwen35")),
            replicas=2,
            num_cpus_per_replica=0.5,
            engine=ENGINE,
            index=redis.url,
            heartbeat_s=0.5,
            max_queued_requests=MAX_QUEUED,
            hmac_key=secrets.token_hex(16),
        )
        serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
        url = f"http://127.0.0.1:{serve_port}/{APP}"
        wait_healthy(url)
        yield App(url, config, redis)
        serve.delete(APP)


# ---- a bounded load --------------------------------------------------------------------------


@dataclass
class Outcome:
    at_s: float
    status: int | None  # None: no HTTP answer at all
    replica: str = ""
    reply: str = ""
    error: str = ""


@dataclass
class Load:
    """`LOAD_WORKERS` multi-turn sessions sharing a system prompt, in a background thread,
    until stopped; every request's outcome is kept."""

    app: App
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _started: float = 0.0

    def __enter__(self) -> Load:
        self._started = time.monotonic()
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(),), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(120)
        assert not self._thread.is_alive(), "the load did not finish: a request hung"

    def elapsed_s(self) -> float:
        return time.monotonic() - self._started

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != 200]

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(self._worker(client, w) for w in range(LOAD_WORKERS)))

    async def _worker(self, client: httpx.AsyncClient, worker: int) -> None:
        session = 0
        while not self._stop.is_set():
            session += 1
            messages = [{"role": "system", "content": SYSTEM}]
            for turn in range(TURNS_PER_SESSION):
                if self._stop.is_set():
                    return
                messages.append(
                    {"role": "user", "content": f"Worker {worker}, session {session}: step {turn}?"}
                )
                outcome = await self._send(client, messages)
                self.outcomes.append(outcome)
                if outcome.status != 200:
                    break
                messages.append({"role": "assistant", "content": outcome.reply})

    async def _send(self, client: httpx.AsyncClient, messages: list[dict]) -> Outcome:
        body = {
            "model": self.app.config.served_model_name,
            "messages": messages,
            "max_tokens": 6,
            "temperature": 0,
        }
        at = self.elapsed_s()
        try:
            response = await client.post(f"{self.app.url}/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            return Outcome(at, None, error=type(exc).__name__)
        if response.status_code != 200:
            return Outcome(at, response.status_code, error=response.text)
        reply = response.json()["choices"][0]["message"]["content"]
        return Outcome(at, 200, response.headers.get("x-baton-replica", ""), reply)


def _index(app: App):
    fingerprint = file_fingerprint(app.config.model)
    return connect_index(app.redis.url, fingerprint, timeout_s=1.0)


async def _live_replicas(app: App) -> list[str]:
    index = await _index(app)
    try:
        return await index.live_replicas()
    finally:
        await index.close()


def _wait_until(predicate, timeout_s: float, what: str) -> float:
    """Seconds until `predicate()` held (polled); fails after `timeout_s`."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.25)
    return time.monotonic() - started


# ---- the faults ------------------------------------------------------------------------------


def test_more_requests_than_slots_and_queue_get_503_with_retry_after(app: App) -> None:
    replicas, ongoing = app.config.replicas, 4 * ENGINE.n_slots + 4  # see baton_serve.deploy.app
    flood = 2 * (replicas * ongoing + MAX_QUEUED)
    body = {
        "model": app.config.served_model_name,
        "prompt": "Count slowly:",
        "max_tokens": 48,
        "ignore_eos": True,
        "stream": True,
    }

    async def one(client: httpx.AsyncClient) -> tuple[int, httpx.Headers, str]:
        async with client.stream("POST", f"{app.url}/v1/completions", json=body) as response:
            text = (await response.aread()).decode()
            return response.status_code, response.headers, text

    async def all_at_once() -> list[tuple[int, httpx.Headers, str]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client) for _ in range(flood)))

    results = asyncio.run(asyncio.wait_for(all_at_once(), 90))  # never a hang
    statuses = Counter(status for status, _, _ in results)
    assert set(statuses) == {200, 503}, statuses
    assert statuses[200] >= replicas * ENGINE.n_slots
    for status, headers, text in results:
        if status == 503:
            assert headers["retry-after"] == "1"
            assert '"code":"no_capacity"' in text.replace(" ", "")
        else:
            assert text.rstrip().endswith("data: [DONE]")
    assert httpx.get(f"{app.url}/health", timeout=5).status_code == 200


def test_redis_outage_fails_no_request_and_the_index_repopulates(app: App) -> None:
    with Load(app) as load:
        _wait_until(lambda: len(load.outcomes) >= 20, 60, "the load got going")
        live_before = asyncio.run(_live_replicas(app))
        assert len(live_before) == app.config.replicas
        app.redis.stop()
        stopped_at = load.elapsed_s()
        time.sleep(OUTAGE_S)
        app.redis.start()  # empty: everything Redis held is gone
        restarted_at = load.elapsed_s()
        _wait_until(
            lambda: asyncio.run(_live_replicas(app)) == live_before, 20, "replicas re-publish"
        )
        time.sleep(2.0)  # a few more requests with the index back
    during = [o for o in load.outcomes if stopped_at <= o.at_s < restarted_at]
    assert len(during) >= 20, "the load kept running through the outage"
    assert load.failures() == [], load.failures()[:3]


def test_killed_replica_is_forgotten_replaced_and_loses_only_its_requests_in_flight(
    app: App,
) -> None:
    actors = replica_actors(APP)
    assert len(actors) == app.config.replicas
    with Load(app) as load:
        _wait_until(lambda: len(load.outcomes) >= 20, 60, "the load got going")
        victim = sorted(actors)[0]
        ray.kill(actors[victim], no_restart=True)
        killed_at = load.elapsed_s()
        forgot_s = _wait_until(
            lambda: victim not in asyncio.run(_live_replicas(app)),
            FORGET_WITHIN_S,
            "the index forgets the dead replica",
        )
        _wait_until(
            lambda: len(set(replica_actors(APP)) - {victim}) == app.config.replicas,
            90,
            "Serve starts a replacement",
        )
        wait_healthy(app.url)
        replaced_at = load.elapsed_s()
        time.sleep(3.0)  # requests reach the replacement

    # Only what the victim was running when it died failed (each worker has one request in
    # flight), answered 500 and not resent; a request routed to it after it died went to
    # the other replica (Serve's router resends a call no replica accepted).
    failures = load.failures()
    assert len(failures) <= LOAD_WORKERS, failures
    assert all(o.status == 500 and '"replica_died"' in o.error for o in failures), failures
    # Routing stopped choosing the dead replica: nothing failed once the index forgot it.
    assert all(o.at_s < killed_at + forgot_s for o in failures), failures
    after = {o.replica for o in load.outcomes if o.at_s > replaced_at and o.replica}
    assert after - set(actors), "the replacement serves requests"
    deployment = serve.status().applications[APP].deployments[REPLICA_DEPLOYMENT]
    assert deployment.status == "HEALTHY"


def test_a_request_whose_replica_dies_is_not_resent_and_its_repeat_is_refused(app: App) -> None:
    """A replica is killed (as a crash or the OOM killer would) while it runs one long
    request: no input needs to kill it, the fault is Ray's own `kill`."""
    actors = replica_actors(APP)
    poison = {
        "model": app.config.served_model_name,
        "prompt": "Poison, counted slowly:",
        "max_tokens": ENGINE.n_ctx - 64,
        "ignore_eos": True,
        "temperature": 0,
    }
    completions = f"{app.url}/v1/completions"
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(httpx.post, completions, json=poison, timeout=120)
        victim = _running_replica()
        ray.kill(actors[victim], no_restart=True)
        lost = sent.result(timeout=120)
    (survivor,) = set(actors) - {victim}

    assert lost.status_code == 500, lost.text
    error = lost.json()["error"]
    assert error["code"] == "replica_died"
    assert "not sent to another replica" in error["message"]
    assert _idle(survivor), "the other replica got the request"

    for body in (poison, poison | {"stream": True}):  # the same work, streamed or not
        started = time.monotonic()
        refused = httpx.post(completions, json=body, timeout=30)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "request_quarantined"
        assert "poison_quarantine_s" in refused.json()["error"]["message"]
        assert time.monotonic() - started < 2.0
        assert _idle(survivor), "a refused repeat reached a replica"

    other = httpx.post(completions, json=poison | {"max_tokens": 8}, timeout=60)
    assert other.status_code == 200, other.text
    assert other.headers["x-baton-replica"] != victim  # the survivor, or a replacement

    def counted() -> bool:
        counters = app_counters(APP, f"http://127.0.0.1:{metrics_export_port()}/metrics")
        lost = counters.get("ray_baton_requests_lost_with_replica_total", 0)
        return lost >= 1 and counters.get("ray_baton_requests_quarantined_total", 0) >= 2

    _wait_until(counted, 30, "the gateway counts the lost request and the refused repeats")
    _wait_until(  # leave the app as it was: two replicas
        lambda: len(set(replica_actors(APP)) - {victim}) == app.config.replicas,
        90,
        "Serve starts a replacement",
    )
    wait_healthy(app.url)


def _running_replica(timeout_s: float = 30.0) -> str:
    """The replica that has started a request (the only one in flight), polled closely: the
    request must still be running when the replica is killed."""

    async def find() -> str:
        actors = replica_actors(APP)
        while True:
            stats = await asyncio.gather(
                *(a.record_routing_stats.remote() for a in actors.values())
            )
            running = [s["replica_id"] for s in stats if s["running"]]
            if running:
                return running[0]
            await asyncio.sleep(0.01)

    return asyncio.run(asyncio.wait_for(find(), timeout_s))


def _idle(replica: str) -> bool:
    """Whether `replica` has nothing queued or running."""
    stats = {s["replica_id"]: s for s in asyncio.run(replica_stats(APP))}
    return stats[replica]["running"] == 0 and stats[replica]["queued"] == 0
