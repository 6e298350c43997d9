"""One contract for every checkpoint index backend (Redis, embedded Ray actor), plus
backend-specific checks: Redis outages, the embedded actor's restart, MemoryIndex expiry."""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import ray

from baton_serve.cache_store.index.embedded_index import ACTOR_NAME, ACTOR_NAMESPACE, EmbeddedIndex
from baton_serve.cache_store.index.index import (
    CheckpointIndex,
    IndexEntry,
    IndexMatch,
    IndexUnavailable,
)
from baton_serve.cache_store.index.index_connect import connect_index
from baton_serve.cache_store.index.index_view import IndexView
from baton_serve.cache_store.index.memory_index import IndexSnapshot, MemoryIndex
from baton_serve.cache_store.index.redis_index import RedisIndex, key_prefix
from baton_serve.loadtests.redis_server import RedisServer

pytestmark = pytest.mark.anyio

MakeIndex = Callable[..., Awaitable[CheckpointIndex]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["redis", "redis-cluster", "redis-sentinel", "embedded"])
async def make_index(request: pytest.FixtureRequest) -> AsyncIterator[MakeIndex]:
    """`await make_index(fingerprint=None, **settings)` → an index of this test's backend
    (Redis: one server, a 3-shard Cluster, a master behind a Sentinel).

    Each call without a fingerprint gets a fresh one, so tests never see each other's data.
    """
    servers = {"redis": "redis_server", "redis-cluster": "redis_cluster"}
    if request.param.startswith("redis"):
        spec = request.getfixturevalue(servers.get(request.param, "redis_sentinel")).url
    else:
        request.getfixturevalue("ray_cluster")
        spec = "embedded"
    opened: list[CheckpointIndex] = []

    async def make(fingerprint: bytes | None = None, **settings: float) -> CheckpointIndex:
        settings = {"timeout_s": 1.0, **settings}  # no flaky lookups on a busy 2-core machine
        index = await connect_index(spec, fingerprint or os.urandom(32), **settings)
        opened.append(index)
        return index

    yield make
    for index in opened:
        await index.close()


def h(name: str | int) -> bytes:
    return str(name).encode().ljust(16, b".")[:16]


def chain(doc: str, length: int) -> list[bytes]:
    return [h(f"{doc}-{i}") for i in range(length)]


def entries(hashes: list[bytes], block: int = 64) -> list[IndexEntry]:
    """Entries for hashes of one chain: the i-th covers (i + 1) * block tokens."""
    return [IndexEntry(x, (i + 1) * block, 1000 * (i + 1)) for i, x in enumerate(hashes)]


async def test_publish_then_lookup(make_index: MakeIndex) -> None:
    index = await make_index()
    await index.heartbeat("r1")
    await index.publish("r1", [IndexEntry(h("a"), 64, 1234)])
    assert await index.lookup([h("a")]) == {"r1": IndexMatch("r1", h("a"), 64, 1234)}
    assert await index.lookup([]) == {}


async def test_longest_match_per_replica(make_index: MakeIndex) -> None:
    index = await make_index()
    doc = chain("doc", 10)
    for replica, depth in (("deep", 9), ("mid", 5), ("shallow", 1)):
        await index.heartbeat(replica)
        await index.publish(replica, entries(doc)[:depth])
    await index.publish("mid", [IndexEntry(h("elsewhere"), 9999, 1)])  # not in the chain
    found = await index.lookup(doc)
    assert found == {
        "deep": IndexMatch("deep", doc[8], 9 * 64, 9000),
        "mid": IndexMatch("mid", doc[4], 5 * 64, 5000),
        "shallow": IndexMatch("shallow", doc[0], 64, 1000),
    }
    # a prompt that diverges after 3 blocks only reaches the first 3 hashes
    diverged = await index.lookup(doc[:3] + chain("other", 7))
    assert {r: m.n_tokens for r, m in diverged.items()} == {"deep": 192, "mid": 192, "shallow": 64}


async def test_unknown_hashes_find_nothing(make_index: MakeIndex) -> None:
    index = await make_index()
    await index.heartbeat("r1")
    await index.publish("r1", entries(chain("known", 3)))
    assert await index.lookup(chain("unknown", 5)) == {}


async def test_forget_some_entries(make_index: MakeIndex) -> None:
    index = await make_index()
    doc = chain("doc", 4)
    await index.heartbeat("r1")
    await index.heartbeat("r2")
    await index.publish("r1", entries(doc))
    await index.publish("r2", entries(doc))
    await index.forget("r1", [doc[3], doc[2]])
    found = await index.lookup(doc)
    assert found["r1"].prefix_hash == doc[1] and found["r2"].prefix_hash == doc[3]
    await index.forget("r1", [])
    assert (await index.lookup(doc))["r1"].prefix_hash == doc[1]


async def test_forget_whole_replica(make_index: MakeIndex) -> None:
    index = await make_index()
    doc = chain("doc", 4)
    for replica in ("r1", "r2"):
        await index.heartbeat(replica)
        await index.publish(replica, entries(doc))
    await index.forget("r1")
    assert set(await index.lookup(doc)) == {"r2"}
    assert await index.live_replicas() == ["r2"]
    assert await index.heartbeat("r1") is False  # its liveness went too
    assert set(await index.lookup(doc)) == {"r2"}  # and it holds nothing any more


async def test_entries_expire(make_index: MakeIndex) -> None:
    index = await make_index(entry_ttl_s=0.6, liveness_ttl_s=10)
    await index.heartbeat("r1")
    await index.publish("r1", [IndexEntry(h("old"), 64, 1)])
    await asyncio.sleep(0.4)
    await index.publish("r1", [IndexEntry(h("new"), 128, 1)])
    await asyncio.sleep(0.35)
    assert await index.lookup([h("old"), h("new")]) == {"r1": IndexMatch("r1", h("new"), 128, 1)}
    await index.touch("r1", [h("old")])  # too late: expired entries stay expired
    await asyncio.sleep(0.4)
    assert await index.lookup([h("old"), h("new")]) == {}


async def test_touch_keeps_an_entry_alive(make_index: MakeIndex) -> None:
    index = await make_index(entry_ttl_s=0.6, liveness_ttl_s=10)
    await index.heartbeat("r1")
    await index.publish("r1", [IndexEntry(h("kept"), 64, 7), IndexEntry(h("dropped"), 64, 7)])
    for _ in range(3):  # 1.2 s in all, twice the TTL
        await asyncio.sleep(0.4)
        await index.touch("r1", [h("kept"), h("never-published")])
    assert await index.lookup([h("kept"), h("dropped")]) == {
        "r1": IndexMatch("r1", h("kept"), 64, 7)
    }
    assert await index.lookup([h("never-published")]) == {}  # touch creates nothing


async def test_silent_replica_drops_out_and_comes_back(make_index: MakeIndex) -> None:
    index = await make_index(liveness_ttl_s=0.5)
    for replica in ("quiet", "chatty"):
        await index.heartbeat(replica)
        await index.publish(replica, [IndexEntry(h("x"), 64, 1)])
    assert await index.live_replicas() == ["chatty", "quiet"]
    for _ in range(3):
        await asyncio.sleep(0.25)
        assert await index.heartbeat("chatty") is True
    assert set(await index.lookup([h("x")])) == {"chatty"}
    assert await index.live_replicas() == ["chatty"]
    assert await index.heartbeat("quiet") is False  # expired: it should re-publish
    assert set(await index.lookup([h("x")])) == {"chatty", "quiet"}


async def test_unpublished_replica_is_not_matched_until_alive(make_index: MakeIndex) -> None:
    index = await make_index()
    await index.publish("r1", [IndexEntry(h("x"), 64, 1)])
    assert await index.lookup([h("x")]) == {}
    assert await index.live_replicas() == []
    assert await index.heartbeat("r1") is False
    assert await index.heartbeat("r1") is True
    assert set(await index.lookup([h("x")])) == {"r1"}


async def test_fingerprints_are_namespaces(make_index: MakeIndex) -> None:
    a = await make_index(fingerprint=b"\x01" * 32)
    b = await make_index(fingerprint=b"\x01" * 31 + b"\x02")
    await a.heartbeat("r1")
    await a.publish("r1", [IndexEntry(h("x"), 64, 1)])
    assert await b.lookup([h("x")]) == {}
    assert await b.live_replicas() == []
    assert await b.heartbeat("r1") is False
    await b.publish("r1", [IndexEntry(h("x"), 128, 2)])
    await b.forget("r1")
    assert await a.lookup([h("x")]) == {"r1": IndexMatch("r1", h("x"), 64, 1)}


async def test_lookup_of_2000_hashes(make_index: MakeIndex) -> None:
    index = await make_index()
    doc = chain("long", 2000)
    await index.heartbeat("r1")
    await index.heartbeat("r2")
    await index.publish("r1", entries(doc, block=16))
    await index.publish("r2", entries(doc[:700], block=16)[::7])
    found = await index.lookup(doc)
    assert found["r1"] == IndexMatch("r1", doc[-1], 32_000, 2_000_000)
    assert found["r2"] == IndexMatch("r2", doc[693], 694 * 16, 694_000)
    with pytest.raises(ValueError, match="at most 2000"):
        await index.lookup(doc + [h("one-too-many")])


async def test_arguments_are_checked(make_index: MakeIndex) -> None:
    index = await make_index()
    with pytest.raises(ValueError, match="16 bytes"):
        await index.lookup([b"short"])
    with pytest.raises(ValueError, match="replica_id"):
        await index.heartbeat("")
    with pytest.raises(ValueError, match="n_tokens"):
        IndexEntry(h("x"), 0, 1)


async def test_in_flight_entries(make_index: MakeIndex) -> None:
    """A prefix being computed is published with the time it is expected, and the held
    entry replaces it; on equal length a held entry beats one in flight."""
    index = await make_index()
    doc = chain("doc", 4)
    ready_at = time.time() + 5
    for replica in ("r1", "r2"):
        await index.heartbeat(replica)
    await index.publish("r1", [IndexEntry(doc[3], 256, 100, ready_at)])
    await index.publish("r2", [IndexEntry(doc[3], 256, 100)])
    found = await index.lookup(doc)
    assert found["r1"].in_flight and abs(found["r1"].ready_at - ready_at) < 0.002
    assert not found["r2"].in_flight
    await index.publish("r2", [IndexEntry(doc[2], 256, 100, ready_at)])  # same length, later
    assert not (await index.lookup(doc))["r2"].in_flight
    await index.publish("r1", [IndexEntry(doc[3], 256, 100)])  # now it has it
    assert not (await index.lookup(doc))["r1"].in_flight
    with pytest.raises(ValueError, match="ready_at"):
        IndexEntry(h("x"), 1, 1, -1.0)


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_followers_view_keeps_up_with_every_change(make_index: MakeIndex) -> None:
    """A view starts from a snapshot (what was there before), then applies each change as
    it happens; its lookups answer what the store's do. After a gap it resyncs."""
    index = await make_index(liveness_ttl_s=30)
    doc, other = chain("doc", 6), chain("other", 3)
    await index.heartbeat("r1")
    await index.publish("r1", entries(doc[:2]))  # before the view exists: from the snapshot
    view = IndexView()
    follower = asyncio.create_task(index.follow(view))
    try:
        await _until(lambda: view.synced and "r1" in view.lookup(doc))
        assert view.lookup(doc) == await index.lookup(doc)

        await index.heartbeat("r2")
        await index.publish("r2", entries(doc))
        await index.publish("r1", [IndexEntry(other[2], 192, 7, time.time() + 3)])
        await _until(lambda: "r2" in view.lookup(doc) and "r1" in view.lookup(other))
        for chain_ in (doc, other):
            assert view.lookup(chain_) == await index.lookup(chain_)

        await index.forget("r2", [doc[5], doc[4]])
        await _until(lambda: view.lookup(doc)["r2"].prefix_hash == doc[3])
        await index.touch("r2", [doc[0]])
        await index.forget("r1")
        await _until(lambda: "r1" not in view.lookup(doc + other))
        assert view.lookup(doc) == await index.lookup(doc)

        view.lost()  # as after a lost message: a new snapshot, then changes again
        await index.publish("r2", [IndexEntry(other[0], 64, 1)])
        await _until(lambda: view.synced and "r2" in view.lookup(other))
        assert view.lookup(doc + other) == await index.lookup(doc + other)
        with pytest.raises(ValueError, match="16 bytes"):
            view.lookup([b"short"])
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)


async def test_connect_index_rejects_unknown_specs() -> None:
    with pytest.raises(ValueError, match="'embedded' or a redis://"):
        await connect_index("memcached://localhost", b"fp")


# --- Redis only ---------------------------------------------------------------------------


async def _assert_unavailable_within(call: Awaitable[object], limit_s: float) -> None:
    start = time.monotonic()
    with pytest.raises(IndexUnavailable):
        await call
    assert time.monotonic() - start < limit_s


async def test_redis_outage_raises_index_unavailable_then_recovers(
    private_redis_server: RedisServer,  # noqa: F811
) -> None:
    server = private_redis_server
    index = RedisIndex(server.url, os.urandom(32), timeout_s=0.05, write_timeout_s=0.3)
    await index.heartbeat("r1")
    await index.publish("r1", [IndexEntry(h("x"), 64, 1)])
    assert set(await index.lookup([h("x")])) == {"r1"}

    for outage in (server.pause, server.stop):  # hung server, then no server
        outage()
        await _assert_unavailable_within(index.lookup([h("x")]), 0.05 + 0.2)
        await _assert_unavailable_within(index.publish("r1", [IndexEntry(h("y"), 1, 1)]), 0.6)
        await _assert_unavailable_within(index.touch("r1", [h("x")]), 0.6)
        await _assert_unavailable_within(index.forget("r1", [h("x")]), 0.6)
        await _assert_unavailable_within(index.forget("r1"), 0.6)
        await _assert_unavailable_within(index.heartbeat("r1"), 0.6)
        await _assert_unavailable_within(index.live_replicas(), 0.6)
        if outage == server.pause:
            server.resume()
            assert await index.heartbeat("r1") is True  # the same server came back

    server.start()  # same port, no data
    assert await index.heartbeat("r1") is False
    assert await index.lookup([h("x")]) == {}
    await index.publish("r1", [IndexEntry(h("x"), 64, 1)])
    assert set(await index.lookup([h("x")])) == {"r1"}
    await index.close()


async def test_redis_keys_share_one_hash_tag(redis_server: RedisServer) -> None:  # noqa: F811
    fingerprint = os.urandom(32)
    prefix = key_prefix(fingerprint)
    assert re.fullmatch(r"baton:\{[0-9a-f]{16}\}:", prefix)
    index = RedisIndex(redis_server.url, fingerprint)
    await index.heartbeat("r1")
    await index.publish("r1", [IndexEntry(h("x"), 64, 1)])
    keys = [k.decode() async for k in index.redis.scan_iter(match=f"{prefix}*")]
    assert sorted(k[len(prefix) :].split(":")[0] for k in keys) == ["alive", "h", "r", "seq"]
    await index.forget("r1")
    assert [k async for k in index.redis.scan_iter(match=f"{prefix}*")] == [
        b"%sseq" % prefix.encode()
    ]
    await index.close()


# --- embedded only ------------------------------------------------------------------------


async def test_embedded_actor_restart_loses_data_and_heartbeat_says_so(
    ray_cluster: None,  # noqa: F811
) -> None:
    index = await connect_index("embedded", os.urandom(32), timeout_s=1.0, write_timeout_s=1.0)
    await index.heartbeat("r1")
    await index.publish("r1", [IndexEntry(h("x"), 64, 1)])
    ray.kill(ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE), no_restart=False)
    deadline = time.monotonic() + 20
    while True:  # True until the kill lands, then IndexUnavailable, then False once
        assert time.monotonic() < deadline, "the index actor did not restart"
        try:
            if await index.heartbeat("r1") is False:
                break
        except IndexUnavailable:
            pass
        await asyncio.sleep(0.05)
    assert await index.lookup([h("x")]) == {}


def test_embedded_index_needs_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="ray.init"):
        asyncio.run(EmbeddedIndex.connect(b"fp"))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_memory_index_expiry_with_injected_clock() -> None:
    clock = Clock()
    index = MemoryIndex(now=clock)
    fp, other = b"model-a", b"model-b"
    assert index.heartbeat(fp, "r1", ttl_s=15) is False
    index.publish(fp, "r1", [IndexEntry(h("a"), 64, 1), IndexEntry(h("b"), 128, 2)], ttl_s=100)
    index.publish(other, "r1", [IndexEntry(h("a"), 999, 9)], ttl_s=100)
    clock.t += 14.9
    assert index.heartbeat(fp, "r1", ttl_s=15) is True
    assert index.lookup(fp, [h("a"), h("b")]) == {"r1": IndexMatch("r1", h("b"), 128, 2)}
    clock.t += 60
    index.touch(fp, "r1", [h("a")], ttl_s=100)  # a now expires at 1174.9, b at 1100
    clock.t = 1099.99
    assert index.lookup(fp, [h("b")]) == {}  # r1's liveness (until 1029.9) has lapsed
    assert index.live_replicas(fp) == []
    assert index.heartbeat(fp, "r1", ttl_s=1000) is False
    assert index.lookup(fp, [h("a"), h("b")])["r1"].prefix_hash == h("b")
    clock.t = 1100.0
    assert index.lookup(fp, [h("a"), h("b")])["r1"].prefix_hash == h("a")
    clock.t = 1174.9
    assert index.lookup(fp, [h("a"), h("b")]) == {}
    assert index.lookup(other, [h("a")]) == {}  # other model: r1 never heartbeat there


def test_memory_index_heap_stays_bounded_under_touches() -> None:
    clock = Clock()
    index = MemoryIndex(now=clock)
    index.publish(b"fp", "r1", [IndexEntry(h(i), 64, 1) for i in range(100)], ttl_s=10)
    for _ in range(100):
        clock.t += 1
        index.touch(b"fp", "r1", [h(i) for i in range(100)], ttl_s=10)
    model = index._models[b"fp"].index
    assert model.size == 100 and len(model.expiry) <= 2 * 100 + 1024 + 100
    clock.t += 10
    index.heartbeat(b"fp", "r1", ttl_s=10)
    assert index.lookup(b"fp", [h(i) for i in range(100)]) == {} and model.size == 0


async def test_a_large_snapshot_is_copied_while_the_event_loop_serves_others() -> None:
    """A view copying a snapshot of 200,000 entries (a router's resync) is out of sync
    while it copies — lookups go to the store — and the event loop it shares with every
    request keeps running meanwhile; then it answers from the copy."""
    entries = tuple(
        (f"r{i % 64}", IndexEntry(os.urandom(16), 64 * (1 + i % 8), 1000), 600.0)
        for i in range(200_000)
    )
    alive = {f"r{i}": 30.0 for i in range(64)}
    snapshot = IndexSnapshot(seq=7, entries=entries, alive=alive, origin="store")
    view = IndexView()
    ticks, copying = 0, True

    async def other_work() -> None:
        nonlocal ticks
        while copying:
            ticks += 1
            assert not view.synced
            await asyncio.sleep(0)

    ticker = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    await view.reset(snapshot)
    copying = False
    await ticker
    assert ticks > 1, "the event loop ran nothing else while the snapshot was copied"
    assert view.synced and view.seq == 7 and view.origin == "store"
    assert view.entries == len(entries)
    replica, entry, _ = entries[12_345]
    assert view.lookup([entry.prefix_hash]) == {
        replica: IndexMatch(replica, entry.prefix_hash, entry.n_tokens, entry.nbytes)
    }
