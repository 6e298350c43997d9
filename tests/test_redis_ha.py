"""The index on Redis without a single point of failure: Sentinel and Cluster addresses,
a real 3-shard Redis Cluster (models on different shards), a real Sentinel failover.

The whole index contract runs on both too (`test_index_contract.py`'s backends)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import pytest
import redis

from baton_serve.cache_store.index.index import IndexEntry, IndexUnavailable
from baton_serve.cache_store.index.index_connect import connect_cluster_index, connect_index
from baton_serve.cache_store.index.index_view import IndexView
from baton_serve.cache_store.index.redis_address import RedisAddress, parse_redis_address
from baton_serve.cache_store.index.redis_index import RedisIndex, key_prefix
from baton_serve.deploy.config import ConfigError, load_config
from baton_serve.loadtests.redis_ha import MASTER_NAME, LocalRedisCluster, LocalSentinel

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def h(name: str) -> bytes:
    return name.encode().ljust(16, b".")[:16]


# --- addresses ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            "redis+sentinel://s1:26379,s2,[::1]:26380/mymaster/2",
            RedisAddress(
                "sentinel",
                "",
                (("s1", 26379), ("s2", 26379), ("::1", 26380)),
                master="mymaster",
                db=2,
            ),
        ),
        (
            "rediss+sentinel://user:p%40ss@s1/mymaster?sentinel_password=sp",
            RedisAddress(
                "sentinel",
                "",
                (("s1", 26379),),
                master="mymaster",
                username="user",
                password="p@ss",
                sentinel_password="sp",
                tls=True,
            ),
        ),
        (
            "redis+cluster://:pw@n1:7000,n2:7001,n3",
            RedisAddress("cluster", "", (("n1", 7000), ("n2", 7001), ("n3", 6379)), password="pw"),
        ),
        ("rediss://:pw@cache:6380/1", RedisAddress("server", "", tls=True)),
    ],
)
def test_address_forms(spec: str, expected: RedisAddress) -> None:
    address = parse_redis_address(spec)
    assert address == expected  # `url` is left out of comparisons: it may hold a password
    assert address.url == spec
    assert "pw" not in repr(address) and "p@ss" not in repr(address)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("redis+sentinel://s1:26379", "no master name"),
        ("redis+sentinel://s1:26379/", "no master name"),
        ("redis+sentinel:///mymaster", "no hosts"),
        ("redis+cluster://", "no hosts"),
        ("redis+cluster://:pw@", "no hosts"),
        ("sentinel://s1:26379/mymaster", "unknown Redis address scheme 'sentinel://'"),
        ("redis+sentinel://s1:port/mymaster", "bad port 'port'"),
        ("redis+sentinel://s1:26379/mymaster/zero", "database must be a number"),
        ("redis+sentinel://s1/mymaster?master=x", r"unknown option\(s\) \['master'\]"),
        ("redis+cluster://n1:7000/0", "a Redis Cluster has no databases"),
        ("redis+cluster://n1:7000?sentinel_password=x", "unknown option"),
        ("redis+cluster://n1,:7000", "a host is empty"),
    ],
)
def test_bad_addresses_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_redis_address(spec)


def test_the_config_checks_index_addresses() -> None:
    config = load_config(overrides={"index": "redis+cluster://:secret@n1:7000,n2:7001"})
    assert "secret" not in repr(config) and "n1:7000" in repr(config)
    config = load_config(overrides={"index": "redis+sentinel://s1/m?sentinel_password=secret"})
    assert "secret" not in repr(config) and "sentinel_password=***" in repr(config)
    with pytest.raises(ConfigError, match="index: redis\\+sentinel:// address has no master"):
        load_config(overrides={"index": "redis+sentinel://s1:26379"})
    with pytest.raises(ConfigError, match="index: .*'embedded' or a redis://"):
        load_config(overrides={"index": "memcached://x"})


# --- a 3-shard Redis Cluster ---------------------------------------------------------------


def _owner(cluster: LocalRedisCluster, fingerprint: bytes) -> int:
    """The port of the shard that holds the model's keys."""
    return cluster.owner(f"{key_prefix(fingerprint)}seq")


def _keys_per_shard(cluster: LocalRedisCluster, fingerprint: bytes) -> dict[int, int]:
    counts = {}
    for node in cluster.nodes:
        with redis.Redis(port=node.port) as client:
            counts[node.port] = len(list(client.scan_iter(match=f"{key_prefix(fingerprint)}*")))
    return counts


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_two_models_on_two_shards(redis_cluster: LocalRedisCluster) -> None:
    """Every key of a model lives on its shard; models spread over shards; each model's
    writes, lookups, liveness and change stream work there."""
    fingerprints: dict[int, bytes] = {}
    while len(fingerprints) < 2:
        fingerprint = os.urandom(32)
        fingerprints.setdefault(_owner(redis_cluster, fingerprint), fingerprint)
    indexes = [
        await connect_index(redis_cluster.url, fp, timeout_s=1.0) for fp in fingerprints.values()
    ]
    views = [IndexView() for _ in indexes]
    followers = [asyncio.create_task(i.follow(v)) for i, v in zip(indexes, views)]
    try:
        for n, index in enumerate(indexes):
            await index.heartbeat(f"r{n}")
            await index.publish(f"r{n}", [IndexEntry(h("shared"), 64 * (n + 1), 1)])
        for n, (port, fingerprint) in enumerate(fingerprints.items()):
            counts = _keys_per_shard(redis_cluster, fingerprint)
            assert counts[port] == 4 and sum(counts.values()) == 4  # seq, h:, r:, alive:
            assert (await indexes[n].lookup([h("shared")])).keys() == {f"r{n}"}
            assert await indexes[n].live_replicas() == [f"r{n}"]
        await _until(lambda: all(v.synced and v.lookup([h("shared")]) for v in views))
        await indexes[0].publish("r0", [IndexEntry(h("more"), 128, 1)])
        await indexes[1].forget("r1")
        await _until(lambda: views[0].lookup([h("more")]) != {})
        await _until(lambda: views[1].lookup([h("shared")]) == {})
        assert views[0].lookup([h("shared"), h("more")])["r0"].n_tokens == 128
    finally:
        for follower in followers:
            follower.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        for index in indexes:
            await index.close()


async def test_a_config_with_a_cluster_address_opens_the_index(
    redis_cluster: LocalRedisCluster,
) -> None:
    """What `baton serve` does with `--index redis+cluster://…`: the config accepts it and
    the replicas' and routers' connect opens a Cluster index."""
    config = load_config(overrides={"index": redis_cluster.url})
    index = await connect_cluster_index(config.index, os.urandom(32))
    assert isinstance(index, RedisIndex) and index.where.startswith("redis cluster of ")
    assert await index.heartbeat("r1") is False
    assert await index.live_replicas() == ["r1"]
    await index.close()


async def test_a_cluster_without_reachable_nodes_is_unavailable() -> None:
    index = RedisIndex("redis+cluster://127.0.0.1:1", os.urandom(32), write_timeout_s=0.5)
    with pytest.raises(IndexUnavailable, match="redis cluster of 127.0.0.1:1: heartbeat failed"):
        await index.heartbeat("r1")
    await index.close()


# --- a Sentinel failover ------------------------------------------------------------------


async def _until_written_to(port: int, index: RedisIndex, timeout_s: float = 25.0) -> bytes:
    """Publish fresh entries until one lands on the master at `port`; return its hash.
    Until then a write fails (IndexUnavailable) or goes to the old master and is lost."""
    deadline = time.monotonic() + timeout_s
    with redis.Redis(port=port) as client:
        while True:
            prefix_hash = os.urandom(16)
            try:
                await index.publish("r1", [IndexEntry(prefix_hash, 128, 1)])
                if client.exists(f"{index.prefix}h:{prefix_hash.hex()}"):
                    return prefix_hash
            except IndexUnavailable:
                pass
            assert time.monotonic() < deadline, "writes did not reach the new master"
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("kill_master", [False, True], ids=["sentinel-failover", "master-killed"])
async def test_the_index_follows_a_sentinel_failover(
    private_redis_sentinel: LocalSentinel, kill_master: bool
) -> None:
    """After a failover the index writes to and reads from the new master, and a follower's
    view resyncs from it; nothing crashes on the way."""
    sentinel = private_redis_sentinel
    assert sentinel.url.endswith(f"/{MASTER_NAME}/0")
    index = RedisIndex(sentinel.url, os.urandom(32), timeout_s=1.0, write_timeout_s=1.0)
    view = IndexView()
    follower = asyncio.create_task(index.follow(view, retry_s=0.2))
    try:
        await index.heartbeat("r1")
        await index.publish("r1", [IndexEntry(h("before"), 64, 1)])
        await _until(lambda: view.lookup([h("before")]) != {})
        old_master = sentinel.master_port()

        new_master = sentinel.failover(kill_master=kill_master)
        assert new_master != old_master
        after = await _until_written_to(new_master, index)
        assert await index.heartbeat("r1") is True  # the replica had copied the liveness key
        found = await index.lookup([h("before"), after])
        assert found["r1"].prefix_hash == after
        await _until(lambda: view.synced and view.lookup([after]) != {}, timeout_s=15)
        assert not follower.done()
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await index.close()


async def test_the_index_follows_a_cluster_failover(
    private_redis_cluster: LocalRedisCluster,
) -> None:
    """The primary of a model's shard dies; once its replica has taken over the slots, the
    index writes there and a follower resyncs from it."""
    cluster = private_redis_cluster
    index = RedisIndex(cluster.url, os.urandom(32), timeout_s=1.0, write_timeout_s=1.0)
    view = IndexView()
    follower = asyncio.create_task(index.follow(view, retry_s=0.2))
    try:
        await index.heartbeat("r1")
        await index.publish("r1", [IndexEntry(h("before"), 64, 1)])
        await _until(lambda: view.lookup([h("before")]) != {})
        old_primary = _owner(cluster, index.fingerprint)

        cluster.kill(old_primary)
        deadline = time.monotonic() + 20
        while (new_primary := _owner(cluster, index.fingerprint)) == old_primary:
            assert time.monotonic() < deadline, "no replica took over"
            await asyncio.sleep(0.1)
        after = await _until_written_to(new_primary, index)
        assert (await index.lookup([h("before"), after]))["r1"].prefix_hash == after
        await _until(lambda: view.synced and view.lookup([after]) != {}, timeout_s=15)
        assert not follower.done()
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await index.close()
