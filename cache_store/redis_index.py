"""The production index backend: Redis (standalone, or Cluster thanks to one hash tag).

Keys of one model share the prefix ``baton:{<tag>}:``, where ``<tag>`` is 16 hex digits of
``blake2b(fingerprint)``; the braces make it a Redis Cluster hash tag, so every key of one
model lives in one slot and the Lua scripts may touch keys they derive themselves.

- ``…h:<hash hex>``: HASH, field = replica id, value = ``"<n_tokens>:<nbytes>:<expires_ms>"``
  (Unix milliseconds); the key expires once its last entry would.
- ``…r:<replica id>``: SET of the hash hexes the replica published (for forget-all).
- ``…alive:<replica id>``: ``"1"`` with a TTL of `liveness_ttl_s`.

Entry expiry is checked per field against the caller's clock, so replica clocks need only
agree to well within `entry_ttl_s`; liveness uses Redis' own key expiry.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from baton_serve.cache_store.index import (
    MAX_LOOKUP_HASHES,
    IndexEntry,
    IndexMatch,
    IndexSettings,
    IndexUnavailable,
    check_fingerprint,
    check_hashes,
    check_replica_id,
)

T = TypeVar("T")

# Sets PEXPIRE on a key unless it already lives at least that long (never shortens it).
_EXTEND = """
local function extend(key, ttl)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end
"""

# KEYS: replica set, then hash keys. ARGV: replica, ttl_ms, then one value per hash key.
_PUBLISH = (
    _EXTEND
    + """
local replica, ttl = ARGV[1], tonumber(ARGV[2])
for i = 2, #KEYS do
  redis.call('HSET', KEYS[i], replica, ARGV[i + 1])
  extend(KEYS[i], ttl)
  redis.call('SADD', KEYS[1], string.sub(KEYS[i], -32))
end
extend(KEYS[1], ttl)
"""
)

# KEYS: replica set, then hash keys. ARGV: replica, ttl_ms, new expires_ms, now_ms.
_TOUCH = (
    _EXTEND
    + """
local replica, ttl, expires, now = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local touched = false
for i = 2, #KEYS do
  local value = redis.call('HGET', KEYS[i], replica)
  if value then
    local sizes, old = string.match(value, '^(%d+:%d+):(%d+)$')
    if sizes and tonumber(old) > now then
      redis.call('HSET', KEYS[i], replica, sizes .. ':' .. expires)
      extend(KEYS[i], ttl)
      touched = true
    end
  end
end
if touched then extend(KEYS[1], ttl) end
"""
)

# KEYS: replica set, alive key. ARGV: hash key prefix, replica.
_FORGET_ALL = """
for _, hex in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  redis.call('HDEL', ARGV[1] .. hex, ARGV[2])
end
redis.call('DEL', KEYS[1], KEYS[2])
"""

# KEYS: hash keys. ARGV: alive key prefix, now_ms.
# Returns {replica, index of its best key (1-based), value, ...} for live replicas.
_LOOKUP = """
local alive_prefix, now = ARGV[1], tonumber(ARGV[2])
local alive, best = {}, {}
for i = 1, #KEYS do
  local flat = redis.call('HGETALL', KEYS[i])
  for j = 1, #flat, 2 do
    local replica, value = flat[j], flat[j + 1]
    local n, expires = string.match(value, '^(%d+):%d+:(%d+)$')
    if n and tonumber(expires) > now then
      local live = alive[replica]
      if live == nil then
        live = redis.call('EXISTS', alive_prefix .. replica) == 1
        alive[replica] = live
      end
      n = tonumber(n)
      if live and (best[replica] == nil or n > best[replica][1]) then
        best[replica] = {n, i, value}
      end
    end
  end
end
local out = {}
for replica, b in pairs(best) do
  out[#out + 1] = replica
  out[#out + 1] = b[2]
  out[#out + 1] = b[3]
end
return out
"""


def key_prefix(fingerprint: bytes) -> str:
    """Return the key prefix of one model, ``baton:{<16 hex>}:``."""
    tag = hashlib.blake2b(check_fingerprint(fingerprint), digest_size=8).hexdigest()
    return f"baton:{{{tag}}}:"


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _now_ms() -> int:
    return int(time.time() * 1000)


class RedisIndex:
    """CheckpointIndex on Redis; creating it does not contact the server."""

    def __init__(
        self, url: str, fingerprint: bytes, *, max_connections: int = 32, **settings: float
    ) -> None:
        self.fingerprint = check_fingerprint(fingerprint)
        self.settings = IndexSettings(**settings)
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        pool = BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=self.settings.write_timeout_s,  # wait for a free connection
            socket_connect_timeout=self.settings.write_timeout_s,
            socket_timeout=self.settings.write_timeout_s,
            retry=Retry(NoBackoff(), 1),  # one immediate retry: a stale pooled connection
        )
        kwargs = pool.connection_kwargs
        self._where = f"redis at {kwargs.get('host')}:{kwargs.get('port')}/{kwargs.get('db', 0)}"
        self._redis = Redis.from_pool(pool)
        self._prefix = key_prefix(fingerprint)
        self._publish = self._redis.register_script(_PUBLISH)
        self._touch = self._redis.register_script(_TOUCH)
        self._forget_all = self._redis.register_script(_FORGET_ALL)
        self._lookup = self._redis.register_script(_LOOKUP)

    def _hash_key(self, prefix_hash: bytes) -> str:
        return f"{self._prefix}h:{prefix_hash.hex()}"

    def _replica_key(self, replica_id: str) -> str:
        return f"{self._prefix}r:{replica_id}"

    def _alive_key(self, replica_id: str) -> str:
        return f"{self._prefix}alive:{replica_id}"

    async def _call(self, what: str, call: Awaitable[T], timeout: float) -> T:
        try:
            return await asyncio.wait_for(call, timeout)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            if isinstance(exc, asyncio.TimeoutError):
                reason = f"no answer within {timeout:g} s"
            else:
                reason = repr(exc)
            raise IndexUnavailable(f"{self._where}: {what} failed: {reason}") from exc

    async def publish(self, replica_id: str, entries: Sequence[IndexEntry]) -> None:
        check_replica_id(replica_id)
        if not entries:
            return
        expires = _now_ms() + _ms(self.settings.entry_ttl_s)
        keys = [self._replica_key(replica_id)]
        args: list[str | int] = [replica_id, _ms(self.settings.entry_ttl_s)]
        for entry in entries:
            if not isinstance(entry, IndexEntry):
                raise ValueError(f"entries must be IndexEntry, got {entry!r}")
            keys.append(self._hash_key(entry.prefix_hash))
            args.append(f"{entry.n_tokens}:{entry.nbytes}:{expires}")
        await self._call(
            "publish", self._publish(keys=keys, args=args), self.settings.write_timeout_s
        )

    async def lookup(self, hashes: Sequence[bytes]) -> dict[str, IndexMatch]:
        wanted = check_hashes(hashes, MAX_LOOKUP_HASHES)
        if not wanted:
            return {}
        keys = [self._hash_key(h) for h in wanted]
        args: list[str | int] = [f"{self._prefix}alive:", _now_ms()]
        flat = await self._call(
            "lookup", self._lookup(keys=keys, args=args), self.settings.timeout_s
        )
        matches: dict[str, IndexMatch] = {}
        for i in range(0, len(flat), 3):
            replica, position, value = flat[i].decode(), int(flat[i + 1]), flat[i + 2]
            n_tokens, nbytes, _ = value.split(b":")
            matches[replica] = IndexMatch(replica, wanted[position - 1], int(n_tokens), int(nbytes))
        return matches

    async def touch(self, replica_id: str, hashes: Sequence[bytes]) -> None:
        check_replica_id(replica_id)
        wanted = check_hashes(hashes)
        if not wanted:
            return
        now = _now_ms()
        ttl = _ms(self.settings.entry_ttl_s)
        keys = [self._replica_key(replica_id), *(self._hash_key(h) for h in wanted)]
        await self._call(
            "touch",
            self._touch(keys=keys, args=[replica_id, ttl, now + ttl, now]),
            self.settings.write_timeout_s,
        )

    async def forget(self, replica_id: str, hashes: Sequence[bytes] | None = None) -> None:
        check_replica_id(replica_id)
        if hashes is None:
            keys = [self._replica_key(replica_id), self._alive_key(replica_id)]
            call = self._forget_all(keys=keys, args=[f"{self._prefix}h:", replica_id])
            await self._call("forget", call, self.settings.write_timeout_s)
            return
        wanted = check_hashes(hashes)
        if not wanted:
            return
        pipe = self._redis.pipeline(transaction=False)
        for h in wanted:
            pipe.hdel(self._hash_key(h), replica_id)
        pipe.srem(self._replica_key(replica_id), *(h.hex() for h in wanted))
        await self._call("forget", pipe.execute(), self.settings.write_timeout_s)

    async def heartbeat(self, replica_id: str) -> bool:
        key = self._alive_key(check_replica_id(replica_id))
        call = self._redis.set(key, "1", px=_ms(self.settings.liveness_ttl_s), get=True)
        return await self._call("heartbeat", call, self.settings.write_timeout_s) is not None

    async def live_replicas(self) -> list[str]:
        pattern = f"{self._prefix}alive:*"
        start = len(f"{self._prefix}alive:")

        async def scan() -> list[str]:
            keys = [key async for key in self._redis.scan_iter(match=pattern, count=1000)]
            return sorted({key.decode()[start:] for key in keys})

        return await self._call("live_replicas", scan(), self.settings.write_timeout_s)

    async def close(self) -> None:
        await self._call("close", self._redis.aclose(), self.settings.write_timeout_s)
