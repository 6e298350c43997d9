"""Redis fixtures: a real `redis-server` per test session (skipped when it is not installed).

Import the fixtures into a test module (or into conftest.py to share one server).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from baton_serve.loadtests.redis_server import RedisServer, redis_server_path

NO_REDIS = "redis-server is not on PATH (install it with `make redis-server`)"


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
