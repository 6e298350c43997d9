"""The production index backend: Redis — one server, a Sentinel-watched master, or a Redis
Cluster (`redis_address` names the forms, `redis_clients` opens them).

Keys of one model share the prefix ``baton:{<tag>}:``, where ``<tag>`` is 16 hex digits of
``blake2b(fingerprint)``; the braces make it a Redis Cluster hash tag, so every key of one
model lives in one slot (models spread over the shards). The scripts touch keys of their
model only; two derive keys they are not passed (`_FORGET_ALL`: the replica's hash keys,
`_LOOKUP`: liveness keys of the replicas it finds), which a Cluster runs because they are
in the slot of the declared keys (Redis checks that per access).

- ``…h:<hash hex>``: HASH, field = replica id, value =
  ``"<n_tokens>:<nbytes>:<expires_ms>:<ready_ms>"`` (Unix milliseconds; ready 0: held, else
  in flight until then); the key expires once its last entry would.
- ``…r:<replica id>``: SET of the hash hexes the replica published (for forget-all).
- ``…alive:<replica id>``: ``"1"`` with a TTL of `liveness_ttl_s`.
- ``…seq``: the number of the last change; every write script increments it and publishes
  ``"<seq> <change JSON>"`` on the channel ``…changes`` (`redis_follow` keeps views current
  from it).

Entry expiry is checked per field against the caller's clock, so replica clocks need only
agree to well within `entry_ttl_s`; liveness uses Redis' own key expiry.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from baton_serve.cache_store.index.index import (
    MAX_LOOKUP_HASHES,
    IndexEntry,
    IndexMatch,
    IndexSettings,
    IndexUnavailable,
    check_fingerprint,
    check_hashes,
    check_replica_id,
)
from baton_serve.cache_store.index.index_view import IndexView
from baton_serve.cache_store.index.redis_clients import REDIS_ERRORS, RedisConnections
from baton_serve.cache_store.index.redis_follow import follow_changes

T = TypeVar("T")

# Sets PEXPIRE on a key unless it already lives at least that long (never shortens it).
_EXTEND = """
local function extend(key, ttl)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end
"""

# Every write script ends by numbering its change and publishing it. KEYS[1] is the seq
# key; ARGV[1] the channel, ARGV[2] the change's JSON.
_ANNOUNCE = """
local function announce()
  local seq = redis.call('INCR', KEYS[1])
  redis.call('PUBLISH', ARGV[1], seq .. ' ' .. ARGV[2])
end
"""

# KEYS: seq, replica set, then hash keys. ARGV: channel, change, replica, ttl_ms, then one
# value per hash key.
_PUBLISH = (
    _EXTEND
    + _ANNOUNCE
    + """
local replica, ttl = ARGV[3], tonumber(ARGV[4])
for i = 3, #KEYS do
  redis.call('HSET', KEYS[i], replica, ARGV[i + 2])
  extend(KEYS[i], ttl)
  redis.call('SADD', KEYS[2], string.sub(KEYS[i], -32))
end
extend(KEYS[2], ttl)
announce()
"""
)

# KEYS: seq, replica set, then hash keys. ARGV: channel, change, replica, ttl_ms, new
# expires_ms, now_ms.
_TOUCH = (
    _EXTEND
    + _ANNOUNCE
    + """
local replica, ttl, expires, now = ARGV[3], tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local touched = false
for i = 3, #KEYS do
  local value = redis.call('HGET', KEYS[i], replica)
  if value then
    local sizes, old, ready = string.match(value, '^(%d+:%d+):(%d+):(%d+)$')
    if sizes and tonumber(old) > now then
      redis.call('HSET', KEYS[i], replica, sizes .. ':' .. expires .. ':' .. ready)
      extend(KEYS[i], ttl)
      touched = true
    end
  end
end
if touched then extend(KEYS[2], ttl) end
announce()
"""
)

# KEYS: seq, replica set, alive key. ARGV: channel, change, hash key prefix, replica.
_FORGET_ALL = (
    _ANNOUNCE
    + """
for _, hex in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  redis.call('HDEL', ARGV[3] .. hex, ARGV[4])
end
redis.call('DEL', KEYS[2], KEYS[3])
announce()
"""
)

# KEYS: seq, replica set, then hash keys. ARGV: channel, change, replica, then the hexes.
_FORGET = (
    _ANNOUNCE
    + """
for i = 3, #KEYS do
  redis.call('HDEL', KEYS[i], ARGV[3])
  redis.call('SREM', KEYS[2], ARGV[i + 1])
end
announce()
"""
)

# KEYS: seq, alive key. ARGV: channel, change, ttl_ms. Returns the old value (nil: unknown).
_HEARTBEAT = (
    _ANNOUNCE
    + """
local old = redis.call('SET', KEYS[2], '1', 'PX', ARGV[3], 'GET')
announce()
return old
"""
)

# KEYS: hash keys. ARGV: alive key prefix, now_ms.
# Returns {replica, index of its best key (1-based), value, ...} for live replicas; the
# best is `index.better_match`: most tokens, then held before in flight, then earliest.
_LOOKUP = """
local alive_prefix, now = ARGV[1], tonumber(ARGV[2])
local alive, best = {}, {}
for i = 1, #KEYS do
  local flat = redis.call('HGETALL', KEYS[i])
  for j = 1, #flat, 2 do
    local replica, value = flat[j], flat[j + 1]
    local n, expires, ready = string.match(value, '^(%d+):%d+:(%d+):(%d+)$')
    if n and tonumber(expires) > now then
      local live = alive[replica]
      if live == nil then
        live = redis.call('EXISTS', alive_prefix .. replica) == 1
        alive[replica] = live
      end
      n, ready = tonumber(n), tonumber(ready)
      local b = best[replica]
      if live and (b == nil or n > b[1] or (n == b[1] and ready == 0 and b[4] > 0)) then
        best[replica] = {n, i, value, ready}
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


def _ms_or_0(unix_s: float) -> int:
    return round(unix_s * 1000) if unix_s > 0 else 0


def change_json(kind: str, replica_id: str, **fields: object) -> str:
    """A change as the channel carries it (`redis_follow.parse_change` reads it back)."""
    return json.dumps({"kind": kind, "replica": replica_id, **fields}, separators=(",", ":"))


class RedisIndex:
    """CheckpointIndex on Redis at `url` (any `redis_address` form); creating it does not
    contact the server."""

    def __init__(
        self, url: str, fingerprint: bytes, *, max_connections: int = 32, **settings: float
    ) -> None:
        self.fingerprint = check_fingerprint(fingerprint)
        self.settings = IndexSettings(**settings)
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.connections = RedisConnections(url, self.settings, max_connections)
        self.where = self.connections.where
        self.redis = self.connections.client
        self.prefix = key_prefix(fingerprint)
        self.seq_key = f"{self.prefix}seq"
        self.channel = f"{self.prefix}changes"
        self._publish = self.redis.register_script(_PUBLISH)
        self._touch = self.redis.register_script(_TOUCH)
        self._forget_all = self.redis.register_script(_FORGET_ALL)
        self._forget = self.redis.register_script(_FORGET)
        self._heartbeat = self.redis.register_script(_HEARTBEAT)
        self._lookup = self.redis.register_script(_LOOKUP)

    def _hash_key(self, prefix_hash: bytes) -> str:
        return f"{self.prefix}h:{prefix_hash.hex()}"

    def _replica_key(self, replica_id: str) -> str:
        return f"{self.prefix}r:{replica_id}"

    def _alive_key(self, replica_id: str) -> str:
        return f"{self.prefix}alive:{replica_id}"

    async def call(self, what: str, call: Awaitable[T], timeout: float) -> T:
        try:
            return await asyncio.wait_for(call, timeout)
        except (*REDIS_ERRORS, asyncio.TimeoutError) as exc:
            if isinstance(exc, asyncio.TimeoutError):
                reason = f"no answer within {timeout:g} s"
            else:
                reason = repr(exc)
            raise IndexUnavailable(f"{self.where}: {what} failed: {reason}") from exc

    async def _write(self, what: str, script, keys: list[str], args: list, change: str):
        """Run a write script; it numbers `change` and announces it to followers."""
        call = script(keys=[self.seq_key, *keys], args=[self.channel, change, *args])
        return await self.call(what, call, self.settings.write_timeout_s)

    async def publish(self, replica_id: str, entries: Sequence[IndexEntry]) -> None:
        check_replica_id(replica_id)
        if not entries:
            return
        ttl_ms = _ms(self.settings.entry_ttl_s)
        expires = _now_ms() + ttl_ms
        keys = [self._replica_key(replica_id)]
        args: list[str | int] = [replica_id, ttl_ms]
        for entry in entries:
            if not isinstance(entry, IndexEntry):
                raise ValueError(f"entries must be IndexEntry, got {entry!r}")
            keys.append(self._hash_key(entry.prefix_hash))
            args.append(f"{entry.n_tokens}:{entry.nbytes}:{expires}:{_ms_or_0(entry.ready_at)}")
        change = change_json(
            "publish",
            replica_id,
            entries=[  # ready_at as stored: in milliseconds
                [e.prefix_hash.hex(), e.n_tokens, e.nbytes, _ms_or_0(e.ready_at) / 1000]
                for e in entries
            ],
            ttl_s=self.settings.entry_ttl_s,
        )
        await self._write("publish", self._publish, keys, args, change)

    async def lookup(self, hashes: Sequence[bytes]) -> dict[str, IndexMatch]:
        wanted = check_hashes(hashes, MAX_LOOKUP_HASHES)
        if not wanted:
            return {}
        keys = [self._hash_key(h) for h in wanted]
        args: list[str | int] = [f"{self.prefix}alive:", _now_ms()]
        flat = await self.call(
            "lookup", self._lookup(keys=keys, args=args), self.settings.timeout_s
        )
        matches: dict[str, IndexMatch] = {}
        for i in range(0, len(flat), 3):
            replica, position, value = flat[i].decode(), int(flat[i + 1]), flat[i + 2]
            n_tokens, nbytes, _, ready_ms = value.split(b":")
            matches[replica] = IndexMatch(
                replica, wanted[position - 1], int(n_tokens), int(nbytes), int(ready_ms) / 1000
            )
        return matches

    async def touch(self, replica_id: str, hashes: Sequence[bytes]) -> None:
        check_replica_id(replica_id)
        wanted = check_hashes(hashes)
        if not wanted:
            return
        now = _now_ms()
        ttl = _ms(self.settings.entry_ttl_s)
        keys = [self._replica_key(replica_id), *(self._hash_key(h) for h in wanted)]
        change = change_json(
            "touch", replica_id, hashes=[h.hex() for h in wanted], ttl_s=self.settings.entry_ttl_s
        )
        await self._write("touch", self._touch, keys, [replica_id, ttl, now + ttl, now], change)

    async def forget(self, replica_id: str, hashes: Sequence[bytes] | None = None) -> None:
        check_replica_id(replica_id)
        if hashes is None:
            keys = [self._replica_key(replica_id), self._alive_key(replica_id)]
            args = [f"{self.prefix}h:", replica_id]
            change = change_json("forget_all", replica_id)
            await self._write("forget", self._forget_all, keys, args, change)
            return
        wanted = check_hashes(hashes)
        if not wanted:
            return
        hexes = [h.hex() for h in wanted]
        keys = [self._replica_key(replica_id), *(self._hash_key(h) for h in wanted)]
        change = change_json("forget", replica_id, hashes=hexes)
        await self._write("forget", self._forget, keys, [replica_id, *hexes], change)

    async def heartbeat(self, replica_id: str) -> bool:
        key = self._alive_key(check_replica_id(replica_id))
        ttl_s = self.settings.liveness_ttl_s
        change = change_json("alive", replica_id, ttl_s=ttl_s)
        old = await self._write("heartbeat", self._heartbeat, [key], [_ms(ttl_s)], change)
        return old is not None

    async def live_replicas(self) -> list[str]:
        pattern = f"{self.prefix}alive:*"
        start = len(f"{self.prefix}alive:")

        async def scan() -> list[str]:
            batches = self.connections.scan(pattern, self.seq_key, count=1000)
            return sorted({key.decode()[start:] async for keys in batches for key in keys})

        return await self.call("live_replicas", scan(), self.settings.write_timeout_s)

    async def follow(self, view: IndexView, *, retry_s: float = 1.0) -> None:
        """Keep `view` a copy of this model's index until cancelled: a snapshot, then the
        changes channel; again from a snapshot after a gap or an outage."""
        await follow_changes(self, view, retry_s=retry_s)

    async def close(self) -> None:
        await self.call("close", self.connections.aclose(), self.settings.write_timeout_s)
