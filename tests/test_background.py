"""Background work never dies silently: the supervisor, the replica's publisher and gauge
loops, and the router's copy of the index (its follower, its age, its fallback)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from baton_serve.cache_store.index.index import IndexEntry
from baton_serve.cache_store.index.index_connect import connect_index
from baton_serve.cache_store.index.redis_follow import read_snapshot
from baton_serve.cache_store.index.redis_index import key_prefix
from baton_serve.cache_store.prefix_hash import PrefixHasher
from baton_serve.cache_store.supervised import Backoff, supervised
from baton_serve.cache_store.telemetry import metrics
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import GenerationRequest, ReplicaRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.replica import Replica
from baton_serve.router.routing.request_router import BatonRouter
from baton_serve.router.routing.routing_metrics import decision_counts, view_figures

SUPERVISOR = "baton.background"
SYSTEM = "You are a careful assistant who answers in short sentences. " * 10


async def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        await asyncio.sleep(0.02)


async def _stopped(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _failures(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == SUPERVISOR and f"'{name}' failed" in r.message]


# ---- the supervisor ------------------------------------------------------------------------


def test_a_failing_loop_is_logged_and_restarted_after_doubling_pauses(caplog) -> None:
    started: list[float] = []

    async def loop() -> None:
        started.append(time.monotonic())
        if len(started) <= 3:
            raise RuntimeError(f"fault {len(started)}")
        await asyncio.sleep(3600)

    async def scenario() -> asyncio.Task[None]:
        task = supervised("test.loop", loop, Backoff(first_s=0.05, max_s=1.0))
        await _until(lambda: len(started) == 4, 5.0, "the fourth run")
        await _stopped(task)
        return task

    with caplog.at_level(logging.ERROR, logger=SUPERVISOR):
        task = asyncio.run(scenario())
    assert task.cancelled()  # cancelling still stops it
    failures = _failures(caplog, "test.loop")
    assert [r.exc_info[1].args[0] for r in failures] == ["fault 1", "fault 2", "fault 3"]
    pauses = [b - a for a, b in zip(started, started[1:])]
    assert all(p >= want for p, want in zip(pauses, (0.05, 0.1, 0.2))), pauses
    assert Backoff().pause_s(1) == 0.1 and Backoff().pause_s(30) == 10.0


# ---- the replica's loops -------------------------------------------------------------------


class _FaultOnce:
    """A real index whose named methods each raise `RuntimeError` on their first call.

    A fake fault, on purpose: a real index raises only `IndexUnavailable`, which the loops
    already handle; an unexpected exception (a bug, a new error of a client library) cannot
    be caused through a real index."""

    def __init__(self, index: object, *methods: str) -> None:
        self._index = index
        self._armed = set(methods)

    def __getattr__(self, name: str) -> object:
        method = getattr(self._index, name)
        if name not in self._armed:
            return method

        async def failing(*args: object, **kwargs: object) -> object:
            if name in self._armed:
                self._armed.discard(name)
                raise RuntimeError(f"injected fault in {name}")
            return await method(*args, **kwargs)

        return failing


def test_each_replica_loop_is_restarted_after_an_exception(
    tiny_model, make_engine, redis_server, monkeypatch, caplog
) -> None:
    engine = make_engine(tiny_model("llama"))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
    engine.generate(engine.chat_prompt(messages), SamplingParams(max_tokens=4))
    engine.wait_idle()
    held = engine.checkpoints(on_disk=True)
    assert held, "the engine kept no checkpoint to publish"
    # The gauges run only where metrics are on; an engine whose load() raises once is a
    # fake fault (a real engine's load() has no failure to cause).
    monkeypatch.setattr(metrics, "enabled", lambda: True)
    real_load, loads = engine.load, []

    def load_failing_once():
        loads.append(1)
        if len(loads) == 1:
            raise RuntimeError("injected fault in load")
        return real_load()

    monkeypatch.setattr(engine, "load", load_failing_once)

    async def scenario() -> tuple[list[str], dict]:
        index = await connect_index(redis_server.url, engine.fingerprint, timeout_s=1.0)
        faulty = _FaultOnce(index, "heartbeat", "publish")
        replica = Replica("survivor", engine, index=faulty, heartbeat_s=0.2)
        try:
            await replica.start()
            chain = engine.hash_chain(held[0].tokens)
            await _until(lambda: len(loads) >= 2, 5.0, "the gauges read again")
            deadline = time.monotonic() + 5.0
            while "survivor" not in (found := await index.lookup(chain)):
                assert time.monotonic() < deadline, "the checkpoints were never published"
                await asyncio.sleep(0.05)
            return await index.live_replicas(), found
        finally:
            await replica.close()
            await index.close()

    with caplog.at_level(logging.ERROR, logger=SUPERVISOR):
        live, found = asyncio.run(scenario())
    assert "survivor" in live  # a heartbeat after the failed one
    assert found["survivor"].n_tokens > 0  # published after the failed publish
    for name in ("index_publisher.heartbeat", "index_publisher.publish", "replica.gauges"):
        assert len(_failures(caplog, name)) == 1, name


# ---- the router's copy of the index --------------------------------------------------------


DEPLOYMENT = DeploymentID(name="Replica", app_name="background")


class _Replica:
    """What `BatonRouter` reads of a `RunningReplica`: its id and routing stats."""

    def __init__(self, name: str) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.routing_stats: dict = {}


def _router(spec: str, fingerprint: bytes, **settings: object) -> BatonRouter:
    router = BatonRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(index=spec, fingerprint_hex=fingerprint.hex(), **settings)
    return router


def _tokens(n: int) -> tuple[int, ...]:
    """Request `n`'s prompt: 640 tokens, distinct per request."""
    return tuple(range(1000 * n, 1000 * n + 640))


def _chain(fingerprint: bytes, n: int = 0) -> tuple[bytes, ...]:
    return tuple(PrefixHasher(fingerprint, 64).chain(_tokens(n)))


def _pending(chain: tuple[bytes, ...], n: int = 0) -> PendingRequest:
    request = ReplicaRequest(
        generation=GenerationRequest(prompt=Prompt(tokens=_tokens(n))), prefix_hashes=chain
    )
    metadata = RequestMetadata(request_id=f"bg-{n}", internal_request_id=f"bg-{n}")
    return PendingRequest(args=[request], kwargs={}, metadata=metadata)


def _route(router: BatonRouter, chain: tuple[bytes, ...], n: int = 0) -> Awaitable[list]:
    return router.choose_replicas([_Replica("a"), _Replica("b")], _pending(chain, n))


def test_the_follower_restarts_after_a_poisoned_snapshot(redis_server, caplog) -> None:
    """A real fault: a malformed entry stored in Redis makes the snapshot read raise."""
    fingerprint = secrets.token_bytes(32)
    poisoned = f"{key_prefix(fingerprint)}h:{'00' * 16}"

    async def scenario() -> BatonRouter:
        index = await connect_index(redis_server.url, fingerprint, timeout_s=1.0)
        await index.redis.hset(poisoned, "a", "not-an-entry")
        router = _router(redis_server.url, fingerprint, lookup_timeout_s=1.0)
        try:
            await _route(router, _chain(fingerprint))  # starts following
            await _until(lambda: _failures(caplog, "router.index_follower"), 5.0, "the log")
            assert not router.view.synced
            await index.redis.delete(poisoned)
            await _until(lambda: router.view.synced, 5.0, "the copy syncing again")
            return router
        finally:
            if router._follower is not None:
                await _stopped(router._follower)
            await index.close()

    with caplog.at_level(logging.ERROR, logger=SUPERVISOR):
        asyncio.run(scenario())
    assert isinstance(_failures(caplog, "router.index_follower")[0].exc_info[1], ValueError)


def test_the_copy_ages_while_the_stream_stalls_and_is_not_trusted(
    private_redis_server, caplog
) -> None:
    fingerprint = secrets.token_bytes(32)
    url = private_redis_server.url

    async def scenario() -> tuple[float, float, int]:
        router = _router(url, fingerprint, max_view_age_s=1.5)
        try:
            await _route(router, _chain(fingerprint))
            await _until(lambda: router.view.synced, 5.0, "the copy syncing")
            await asyncio.sleep(1.5)  # quiet, but answering a ping every second
            assert router.view.age < 1.5
            before = decision_counts().get("index_timeout", 0)
            private_redis_server.pause()  # frozen: connections stay open, nothing answers
            try:
                await asyncio.sleep(2.5)
                stalled_age, reported_age = router.view.age, view_figures()["age_s"]
                await _route(router, _chain(fingerprint), 1)  # a direct lookup: no answer
                timeouts = decision_counts().get("index_timeout", 0) - before
            finally:
                private_redis_server.resume()
            await _until(lambda: router.view.age < 1.5, 5.0, "the copy hearing again")
            await _until(lambda: "answers again" in caplog.text, 3.0, "the all-clear logged")
            return stalled_age, reported_age, timeouts
        finally:
            await _stopped(router._follower)
            await _stopped(router._age_reporter)

    with caplog.at_level(logging.INFO, logger="baton.router"):
        stalled_age, reported_age, timeouts = asyncio.run(scenario())
    assert stalled_age >= 2.0
    assert reported_age > 1.0  # the metric, as last set while the stream stalled
    assert timeouts == 1  # the copy was not used while it was too old
    assert "nothing heard from the change stream" in caplog.text


def test_a_copy_older_than_its_bound_falls_back_to_direct_lookups(redis_server) -> None:
    """The follower is stopped (never started): the copy stays as its snapshot left it."""
    fingerprint = secrets.token_bytes(32)
    chains = [_chain(fingerprint, n) for n in (0, 1)]
    found_b = ("prefix_hit", "peer_pull")  # b's entry used: run there, or pulled from there

    def counts() -> Counter[str]:
        return Counter(decision_counts())

    async def scenario() -> tuple[Counter[str], Counter[str], float]:
        index = await connect_index(redis_server.url, fingerprint, timeout_s=1.0)
        router = _router(
            redis_server.url,
            fingerprint,
            follow_index=False,
            lookup_timeout_s=1.0,
            max_view_age_s=1.5,
        )
        try:
            await router.view.reset(await read_snapshot(index))
            await index.heartbeat("b")
            await index.publish("b", [IndexEntry(c[-1], 640, 1000) for c in chains])
            before = counts()
            await _route(router, chains[0])  # young copy: used, and it lacks the entries
            assert router.view.age < 1.5, "too slow to see the copy young"
            young, before = counts() - before, counts()
            await _until(lambda: router.view.age > 1.5, 3.0, "the copy growing old")
            stale_before = view_figures()["stale_lookups"]
            await _route(router, chains[1], 1)  # old copy: the index is asked
            return young, counts() - before, view_figures()["stale_lookups"] - stale_before
        finally:
            await index.close()

    young, old, stale = asyncio.run(scenario())
    assert young == Counter(load_fallback=1)
    assert sum(old[r] for r in found_b) == 1 and stale == 1


class _Recording:
    """A real index whose `publish` calls are recorded (sizes only), nothing changed."""

    def __init__(self, index: object) -> None:
        self._index = index
        self.published: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._index, name)

    async def publish(self, replica_id: str, entries: list[IndexEntry]) -> None:
        self.published.append(len(entries))
        await self._index.publish(replica_id, entries)


def test_a_backlog_is_published_in_chunks(
    tiny_model, make_engine, redis_server, monkeypatch
) -> None:
    """Thousands of entries packed in one write stall the replica's loop: the publisher
    writes at most `PUBLISH_CHUNK` at a time (2 here) until every entry is in the index."""
    from baton_serve.replicas import index_publisher

    monkeypatch.setattr(index_publisher, "PUBLISH_CHUNK", 2)
    engine = make_engine(tiny_model("llama"))
    messages = [{"role": "system", "content": SYSTEM * 3}, {"role": "user", "content": "Hi!"}]
    engine.generate(engine.chat_prompt(messages), SamplingParams(max_tokens=4))
    engine.wait_idle()
    held = max(engine.checkpoints(on_disk=True), key=lambda checkpoint: checkpoint.n_tokens)
    chain = engine.hash_chain(held.tokens)
    assert len(chain) >= 4, "too few blocks to need several writes"

    async def scenario() -> tuple[list[int], dict]:
        index = await connect_index(redis_server.url, engine.fingerprint, timeout_s=1.0)
        recording = _Recording(index)
        replica = Replica("chunked", engine, index=recording, heartbeat_s=0.2)
        try:
            await replica.start()
            deadline = time.monotonic() + 5.0
            while (await index.lookup(chain)).get("chunked") is None or sum(
                recording.published
            ) < len(chain):
                assert time.monotonic() < deadline, "the backlog was never all published"
                await asyncio.sleep(0.05)
            return recording.published, await index.lookup(chain)
        finally:
            await replica.close()
            await index.close()

    published, found = asyncio.run(scenario())
    assert max(published) <= 2 and len(published) >= len(chain) // 2
    assert found["chunked"].n_tokens == held.n_tokens
