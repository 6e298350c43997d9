"""Redis fixtures: a real `redis-server` per test session (skipped when it is not installed).

Import the fixtures into a test module (or into conftest.py to share one server).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from baton_serve.loadtests.redis_ha import LocalRedisCluster, LocalSentinel, redis_ha_available
from baton_serve.loadtests.redis_server import RedisServer, redis_server_path

NO_REDIS = "redis-server is not on PATH (install it with `make redis-server`)"
NO_REDIS_HA = "redis-server and redis-cli must be on PATH (install them with `make redis-server`)"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session; tests must not stop it (use `private_redis_server`)."""
    if redis_server_path() is None:
        pytest.skip(NO_REDIS)
    with RedisServer() as server:
        yield server


@pytest.fixture
def private_redis_server() -> Iterator[RedisServer]:
    """A redis-server of this test alone, free to `stop`, `pause` and `start` again."""
    if redis_server_path() is None:
        pytest.skip(NO_REDIS)
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    """A 3-shard Redis Cluster (primaries only) for the session; tests must not change it."""
    if not redis_ha_available():
        pytest.skip(NO_REDIS_HA)
    with LocalRedisCluster(shards=3) as cluster:
        yield cluster


@pytest.fixture
def private_redis_cluster() -> Iterator[LocalRedisCluster]:
    """A 3-shard Redis Cluster with a replica per primary, of this test alone: free to kill
    a primary."""
    if not redis_ha_available():
        pytest.skip(NO_REDIS_HA)
    with LocalRedisCluster(shards=3, replicas=1) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[LocalSentinel]:
    """A Sentinel-watched master and replica for the session; tests must not fail it over
    (use `private_redis_sentinel`)."""
    if not redis_ha_available():
        pytest.skip(NO_REDIS_HA)
    with LocalSentinel() as sentinel:
        yield sentinel


@pytest.fixture
def private_redis_sentinel() -> Iterator[LocalSentinel]:
    """A Sentinel-watched master and replica of this test alone, free to fail over."""
    if not redis_ha_available():
        pytest.skip(NO_REDIS_HA)
    with LocalSentinel() as sentinel:
        yield sentinel
