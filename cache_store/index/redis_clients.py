"""The Redis index's connections for each kind of address (`redis_address`): one server, a
Sentinel-watched master, or a Redis Cluster.

- Commands and scripts go through one client: a `Redis` on a blocking pool (a caller waits
  for a free connection), for Sentinel a pool that asks the Sentinels for the master on every
  new connection (so after a failover the next connection reaches the new master), or a
  `RedisCluster` that routes each command to the slot's primary.
- Subscriptions use a plain `Redis` per subscriber: the master (through the Sentinels), or
  for a Cluster the node that owns the model's slot (a classic PUBLISH reaches every node).
- Scans of one model's keys read the node that owns its hash tag's slot: every key of a
  model lives there.

Creating connections contacts no server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError

from baton_serve.cache_store.index.index import IndexSettings
from baton_serve.cache_store.index.redis_address import parse_redis_address

# What a failing server, Sentinel or Cluster raises (a Cluster none of whose seed nodes
# answers: RedisClusterException, which is no RedisError).
REDIS_ERRORS = (RedisError, RedisClusterException, OSError)


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """The master's pool, waiting for a free connection as the single server's pool does."""


class RedisConnections:
    """The clients of one index address (see the module's docstring)."""

    def __init__(self, url: str, settings: IndexSettings, max_connections: int) -> None:
        self.address = parse_redis_address(url)
        timeout = settings.write_timeout_s
        self._timeouts = {"socket_connect_timeout": timeout, "socket_timeout": timeout}
        self._auth = {"username": self.address.username, "password": self.address.password}
        self._sentinel: Sentinel | None = None
        self.client: Redis | RedisCluster
        if self.address.kind == "server":
            pool = BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections,
                timeout=timeout,  # wait for a free connection
                retry=Retry(NoBackoff(), 1),  # one immediate retry: a stale pooled connection
                **self._timeouts,
            )
            kwargs = pool.connection_kwargs
            self.where = f"redis at {kwargs.get('host')}:{kwargs.get('port')}/{kwargs.get('db', 0)}"
            self.client = Redis.from_pool(pool)
        elif self.address.kind == "sentinel":
            self._sentinel = Sentinel(
                self.address.hosts,
                sentinel_kwargs={
                    "password": self.address.sentinel_password,
                    "ssl": self.address.tls,
                    **self._timeouts,
                },
            )
            self.where = self.address.describe()
            self.client = self._master(
                connection_pool_class=_BlockingSentinelPool,
                max_connections=max_connections,
                timeout=timeout,
                retry=Retry(NoBackoff(), 1),  # a stale connection, or a master turned replica
            )
        else:
            self.where = self.address.describe()
            self.client = RedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in self.address.hosts],
                max_connections=max_connections,  # per node
                ssl=self.address.tls,
                **self._auth,
                **self._timeouts,
            )

    def _master(self, **kwargs: Any) -> Redis:
        assert self._sentinel is not None
        return self._sentinel.master_for(
            self.address.master, db=self.address.db, ssl=self.address.tls, **self._auth, **kwargs
        )

    async def subscriber(self, key: str, health_check_interval: float) -> Redis:
        """A new client for one pub/sub subscription about the model that owns `key`."""
        options = {  # no socket_timeout: a quiet channel is no failure
            "health_check_interval": health_check_interval,
            "socket_connect_timeout": self._timeouts["socket_connect_timeout"],
        }
        if isinstance(self.client, RedisCluster):
            await self.client.initialize()
            node = self.client.get_node_from_key(key)
            return Redis(
                host=node.host, port=node.port, ssl=self.address.tls, **self._auth, **options
            )
        if self._sentinel is not None:
            return self._master(**options)
        return Redis.from_url(self.address.url, **options)

    async def scan(self, match: str, key: str, count: int) -> AsyncIterator[list[bytes]]:
        """Batches of the keys that match `match`, on the node that owns `key`."""
        cursor, node = 0, None
        if isinstance(self.client, RedisCluster):
            await self.client.initialize()
            node = self.client.get_node_from_key(key)
        while True:
            if node is None:
                cursor, keys = await self.client.scan(cursor, match=match, count=count)
            else:
                cursors, keys = await self.client.scan(
                    cursor, match=match, count=count, target_nodes=node
                )
                cursor = cursors[node.name]
            if keys:
                yield keys
            if cursor == 0:
                return

    async def aclose(self) -> None:
        await self.client.aclose()
        if self._sentinel is not None:
            await self._sentinel.aclose()
