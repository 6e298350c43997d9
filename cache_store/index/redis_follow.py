"""Keeping an `IndexView` current from Redis: subscribe to the changes channel, read a
snapshot, then apply each numbered change as it arrives.

Changes published between the subscription and the snapshot's reads are applied on top
of it, in order: every change sets or deletes one (hash, replica) entry, so replaying ones
the snapshot already holds ends in the same state. A gap in the numbering (a lost message,
a Redis restarted empty) or a dropped connection means a new snapshot. A quiet channel is
pinged every `PING_IDLE_S`, and every answer counts as hearing from the stream (`IndexView.age`).
Messages are JSON, checked field by field; nothing from the network is unpickled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

from redis.asyncio import Redis, RedisCluster

from baton_serve.cache_store.index.index import IndexEntry, IndexSettings, IndexUnavailable
from baton_serve.cache_store.index.index_view import IndexView
from baton_serve.cache_store.index.memory_index import IndexChange, IndexSnapshot
from baton_serve.cache_store.index.redis_clients import REDIS_ERRORS, RedisConnections

T = TypeVar("T")


class RedisIndex(Protocol):
    """What following needs of `redis_index.RedisIndex` (which imports this module)."""

    where: str
    redis: Redis | RedisCluster
    connections: RedisConnections
    prefix: str
    seq_key: str
    channel: str
    settings: IndexSettings

    async def call(self, what: str, call: Awaitable[T], timeout: float) -> T: ...


logger = logging.getLogger("baton.index")

SCAN_BATCH = 1000
HEALTH_CHECK_S = 10  # seconds without traffic before the subscriber pings the server
PING_IDLE_S = 1.0  # seconds without a message before the follower pings (its pong is heard)
_KINDS = {"publish", "touch", "forget", "forget_all", "alive"}


async def follow_changes(index: RedisIndex, view: IndexView, *, retry_s: float) -> None:
    """Keep `view` current until cancelled (see the module's docstring)."""
    while True:
        subscriber = pubsub = None
        try:
            subscriber = await index.call(
                "subscribe",
                index.connections.subscriber(
                    index.seq_key,
                    health_check_interval=HEALTH_CHECK_S,  # a dead connection is noticed
                ),
                index.settings.write_timeout_s,
            )
            pubsub = subscriber.pubsub(ignore_subscribe_messages=False)
            await _subscribe(pubsub, index)
            await view.reset(await read_snapshot(index))
            while view.synced:
                message = await pubsub.get_message(timeout=PING_IDLE_S)
                if message is None:  # quiet: ask, so a stalled stream shows in the view's age
                    await pubsub.ping()
                    continue
                view.heard()
                if message["type"] != "message":
                    continue
                change = parse_change(message["data"])
                if change is None or not view.apply([change]):
                    view.lost()
        except (*REDIS_ERRORS, IndexUnavailable, asyncio.TimeoutError) as exc:
            view.lost()
            logger.info("index view: %s; resyncing in %g s", exc, retry_s)
            await asyncio.sleep(retry_s)
        finally:
            await asyncio.shield(_close(pubsub, subscriber))


async def _subscribe(pubsub: Any, index: RedisIndex) -> None:
    await pubsub.subscribe(index.channel)
    deadline = time.monotonic() + index.settings.write_timeout_s
    while time.monotonic() < deadline:
        message = await pubsub.get_message(timeout=index.settings.write_timeout_s)
        if message is not None and message["type"] == "subscribe":
            return
    raise IndexUnavailable(f"{index.where}: no subscription to {index.channel}")


async def _close(pubsub: Any, subscriber: Redis | None) -> None:
    try:
        if pubsub is not None:
            await pubsub.aclose()
        if subscriber is not None:
            await subscriber.aclose()
    except REDIS_ERRORS:
        pass


async def read_snapshot(index: RedisIndex) -> IndexSnapshot:
    """Every entry and live replica of the model, as of the change number read first."""
    timeout = index.settings.write_timeout_s
    seq = int(await index.call("snapshot", index.redis.get(index.seq_key), timeout) or 0)
    now_ms = time.time() * 1000
    entries: list[tuple[str, IndexEntry, float]] = []
    async for hex_hash, fields in _each(index, "h:", "hgetall"):
        for replica, value in fields.items():
            n_tokens, nbytes, expires, ready = (int(v) for v in value.split(b":"))
            if expires > now_ms:
                entry = IndexEntry(bytes.fromhex(hex_hash), n_tokens, nbytes, ready / 1000)
                entries.append((replica.decode(), entry, (expires - now_ms) / 1000))
    alive = {
        replica: ttl_ms / 1000
        async for replica, ttl_ms in _each(index, "alive:", "pttl")
        if ttl_ms > 0
    }
    return IndexSnapshot(seq=seq, entries=tuple(entries), alive=alive, origin=index.where)


async def _each(index: RedisIndex, kind: str, command: str) -> AsyncIterator[tuple[str, Any]]:
    """(key suffix, `command`'s answer) for every key of the model under `kind`, scanned and
    asked in pipelined batches."""
    prefix, timeout = f"{index.prefix}{kind}", index.settings.write_timeout_s
    batches = aiter(index.connections.scan(f"{prefix}*", index.seq_key, SCAN_BATCH))
    while (keys := await index.call("snapshot", anext(batches, None), timeout)) is not None:
        pipe = index.redis.pipeline(transaction=False)
        for key in keys:
            getattr(pipe, command)(key)
        answers = await index.call("snapshot", pipe.execute(), timeout)
        for key, answer in zip(keys, answers):
            yield key.decode()[len(prefix) :], answer


def parse_change(data: bytes) -> IndexChange | None:
    """A change message (``"<seq> <JSON>"``), or None if it is malformed."""
    try:
        seq_text, body = data.split(b" ", 1)
        fields = json.loads(body)
        kind, replica = fields["kind"], fields["replica"]
        if kind not in _KINDS or not isinstance(replica, str) or not replica:
            return None
        ttl_s = float(fields.get("ttl_s", 0.0))
        entries = tuple(
            IndexEntry(bytes.fromhex(h), int(n), int(size), float(ready))
            for h, n, size, ready in fields.get("entries", ())
        )
        hashes = tuple(bytes.fromhex(h) for h in fields.get("hashes", ()))
        if any(len(h) != 16 for h in hashes):
            return None
        return IndexChange(int(seq_text), kind, replica, entries, hashes, ttl_s)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
