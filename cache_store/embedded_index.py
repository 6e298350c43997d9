"""The in-cluster index backend: one named Ray actor holding an in-memory index.

`MemoryIndex` is the synchronous data structure (it serves several models, keyed by
fingerprint), `IndexActor` hosts it in the Ray cluster, and `EmbeddedIndex` is the async
client bound to one model. Expiry times are fixed when an entry is written, from the
writer's TTL, so clients with different settings can share the actor.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.actor import ActorHandle, ActorMethod
from ray.exceptions import RayError

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

ACTOR_NAME = "baton-index"
ACTOR_NAMESPACE = "baton"

# Ray destroys a non-detached actor once its creator drops the last handle, even a named
# one; so each process keeps the handle it got, per Ray node id (a new `ray.init` starts
# a new node), and a non-detached index lives as long as the process that created it.
_handles: dict[str, ActorHandle] = {}


@dataclass(slots=True)
class _Held:
    n_tokens: int
    nbytes: int
    expires_at: float


@dataclass
class _Model:
    """Everything the index knows about one model."""

    holders: dict[bytes, dict[str, _Held]] = field(default_factory=dict)
    by_replica: dict[str, set[bytes]] = field(default_factory=dict)
    alive: dict[str, float] = field(default_factory=dict)  # replica -> liveness deadline
    expiry: list[tuple[float, bytes, str]] = field(default_factory=list)  # heap, may be stale
    size: int = 0

    def put(self, prefix_hash: bytes, replica_id: str, held: _Held) -> None:
        replicas = self.holders.setdefault(prefix_hash, {})
        self.size += replica_id not in replicas
        replicas[replica_id] = held
        self.by_replica.setdefault(replica_id, set()).add(prefix_hash)
        heapq.heappush(self.expiry, (held.expires_at, prefix_hash, replica_id))
        if len(self.expiry) > 2 * self.size + 1024:  # drop stale heap items
            self.expiry = [
                (entry.expires_at, h, r)
                for h, by_replica in self.holders.items()
                for r, entry in by_replica.items()
            ]
            heapq.heapify(self.expiry)

    def remove(self, prefix_hash: bytes, replica_id: str) -> None:
        replicas = self.holders.get(prefix_hash)
        if replicas is None or replicas.pop(replica_id, None) is None:
            return
        self.size -= 1
        if not replicas:
            del self.holders[prefix_hash]
        hashes = self.by_replica[replica_id]
        hashes.discard(prefix_hash)
        if not hashes:
            del self.by_replica[replica_id]

    def expire(self, now: float) -> None:
        while self.expiry and self.expiry[0][0] <= now:
            _, prefix_hash, replica_id = heapq.heappop(self.expiry)
            held = self.holders.get(prefix_hash, {}).get(replica_id)
            if held is not None and held.expires_at <= now:
                self.remove(prefix_hash, replica_id)

    def is_alive(self, replica_id: str, now: float) -> bool:
        return self.alive.get(replica_id, -math.inf) > now


class MemoryIndex:
    """In-memory checkpoint index for any number of models, keyed by fingerprint.

    Not thread-safe; `now` is the clock all expiry uses (injectable for tests).
    """

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._models: dict[bytes, _Model] = {}

    def _model(self, fingerprint: bytes) -> tuple[_Model, float]:
        model = self._models.setdefault(check_fingerprint(fingerprint), _Model())
        now = self._now()
        model.expire(now)
        return model, now

    def publish(
        self, fingerprint: bytes, replica_id: str, entries: Sequence[IndexEntry], ttl_s: float
    ) -> None:
        check_replica_id(replica_id)
        model, now = self._model(fingerprint)
        for entry in entries:
            if not isinstance(entry, IndexEntry):
                raise ValueError(f"entries must be IndexEntry, got {entry!r}")
            model.put(
                entry.prefix_hash, replica_id, _Held(entry.n_tokens, entry.nbytes, now + ttl_s)
            )

    def lookup(self, fingerprint: bytes, hashes: Sequence[bytes]) -> dict[str, IndexMatch]:
        wanted = check_hashes(hashes, MAX_LOOKUP_HASHES)
        model, now = self._model(fingerprint)
        best: dict[str, IndexMatch] = {}
        for prefix_hash in wanted:
            for replica_id, held in model.holders.get(prefix_hash, {}).items():
                current = best.get(replica_id)
                if (current is None or held.n_tokens > current.n_tokens) and model.is_alive(
                    replica_id, now
                ):
                    best[replica_id] = IndexMatch(
                        replica_id, prefix_hash, held.n_tokens, held.nbytes
                    )
        return best

    def touch(
        self, fingerprint: bytes, replica_id: str, hashes: Sequence[bytes], ttl_s: float
    ) -> None:
        check_replica_id(replica_id)
        wanted = check_hashes(hashes)
        model, now = self._model(fingerprint)
        for prefix_hash in wanted:
            held = model.holders.get(prefix_hash, {}).get(replica_id)
            if held is not None:
                model.put(prefix_hash, replica_id, _Held(held.n_tokens, held.nbytes, now + ttl_s))

    def forget(
        self, fingerprint: bytes, replica_id: str, hashes: Sequence[bytes] | None = None
    ) -> None:
        check_replica_id(replica_id)
        wanted = None if hashes is None else check_hashes(hashes)
        model, _ = self._model(fingerprint)
        if wanted is None:
            wanted = list(model.by_replica.get(replica_id, ()))
            model.alive.pop(replica_id, None)
        for prefix_hash in wanted:
            model.remove(prefix_hash, replica_id)

    def heartbeat(self, fingerprint: bytes, replica_id: str, ttl_s: float) -> bool:
        check_replica_id(replica_id)
        model, now = self._model(fingerprint)
        known = model.is_alive(replica_id, now)
        model.alive[replica_id] = now + ttl_s
        return known

    def live_replicas(self, fingerprint: bytes) -> list[str]:
        model, now = self._model(fingerprint)
        for replica_id in [r for r in model.alive if not model.is_alive(r, now)]:
            del model.alive[replica_id]
        return sorted(model.alive)


@ray.remote(num_cpus=0, max_restarts=-1)
class IndexActor:
    """A `MemoryIndex` in the Ray cluster; a restart loses its data (heartbeats tell)."""

    def __init__(self) -> None:
        self._index = MemoryIndex()

    def ready(self) -> bool:
        return True

    def publish(
        self, fingerprint: bytes, replica_id: str, entries: Sequence[IndexEntry], ttl_s: float
    ) -> None:
        self._index.publish(fingerprint, replica_id, entries, ttl_s)

    def lookup(self, fingerprint: bytes, hashes: Sequence[bytes]) -> dict[str, IndexMatch]:
        return self._index.lookup(fingerprint, hashes)

    def touch(
        self, fingerprint: bytes, replica_id: str, hashes: Sequence[bytes], ttl_s: float
    ) -> None:
        self._index.touch(fingerprint, replica_id, hashes, ttl_s)

    def forget(self, fingerprint: bytes, replica_id: str, hashes: Sequence[bytes] | None) -> None:
        self._index.forget(fingerprint, replica_id, hashes)

    def heartbeat(self, fingerprint: bytes, replica_id: str, ttl_s: float) -> bool:
        return self._index.heartbeat(fingerprint, replica_id, ttl_s)

    def live_replicas(self, fingerprint: bytes) -> list[str]:
        return self._index.live_replicas(fingerprint)


async def _await_ref(what: str, method: ActorMethod, args: tuple[Any, ...], timeout: float) -> Any:
    """The call's result, or `IndexUnavailable` after `timeout`. `asyncio.wait`, not
    `wait_for`: the future of a call to an actor whose owner died may never settle, not even
    when cancelled, and `wait_for` waits for the cancellation."""
    future = asyncio.ensure_future(method.remote(*args))
    try:
        done, _ = await asyncio.wait({future}, timeout=timeout)
    except asyncio.CancelledError:
        future.cancel()
        raise
    if not done:
        future.cancel()
        raise IndexUnavailable(f"embedded index: {what} failed: no answer within {timeout:g} s")
    try:
        return future.result()
    except RayError as exc:
        raise IndexUnavailable(f"embedded index: {what} failed: {exc!r}") from exc


class EmbeddedIndex:
    """CheckpointIndex client of the named `IndexActor`; open it with `connect`."""

    def __init__(self, actor: ActorHandle, fingerprint: bytes, settings: IndexSettings) -> None:
        self.fingerprint = check_fingerprint(fingerprint)
        self.settings = settings
        self._actor = actor

    @classmethod
    async def connect(
        cls,
        fingerprint: bytes,
        *,
        detached: bool = False,
        start_timeout_s: float = 30.0,
        **settings: float,
    ) -> EmbeddedIndex:
        """Get or create the actor ``baton-index`` (namespace ``baton``) and wait until it
        answers. Ray must be initialised. A non-detached actor dies with the process that
        created it (create it from the driver); `detached` keeps it until the cluster stops.
        The first call in a process decides; later ones reuse its handle."""
        check_fingerprint(fingerprint)
        checked = IndexSettings(**settings)
        if not ray.is_initialized():
            raise RuntimeError("the embedded index needs Ray: call ray.init() first")
        node = ray.get_runtime_context().get_node_id()
        actor = _handles.get(node)
        if actor is None:
            options: dict[str, Any] = {
                "name": ACTOR_NAME,
                "namespace": ACTOR_NAMESPACE,
                "get_if_exists": True,
            }
            if detached:
                options["lifetime"] = "detached"
            try:
                actor = IndexActor.options(**options).remote()  # type: ignore[attr-defined]
            except RayError as exc:
                raise IndexUnavailable(f"embedded index: cannot start the actor: {exc!r}") from exc
            _handles.clear()  # handles of an earlier Ray session are useless
            _handles[node] = actor
        await _await_ref("start", actor.ready, (), start_timeout_s)
        return cls(actor, fingerprint, checked)

    async def _call(self, what: str, method: ActorMethod, *args: Any, timeout: float) -> Any:
        return await _await_ref(what, method, (self.fingerprint, *args), timeout)

    async def publish(self, replica_id: str, entries: Sequence[IndexEntry]) -> None:
        check_replica_id(replica_id)
        if not entries:
            return
        await self._call(
            "publish",
            self._actor.publish,
            replica_id,
            list(entries),
            self.settings.entry_ttl_s,
            timeout=self.settings.write_timeout_s,
        )

    async def lookup(self, hashes: Sequence[bytes]) -> dict[str, IndexMatch]:
        wanted = check_hashes(hashes, MAX_LOOKUP_HASHES)
        if not wanted:
            return {}
        return await self._call(
            "lookup", self._actor.lookup, wanted, timeout=self.settings.timeout_s
        )

    async def touch(self, replica_id: str, hashes: Sequence[bytes]) -> None:
        check_replica_id(replica_id)
        wanted = check_hashes(hashes)
        if not wanted:
            return
        await self._call(
            "touch",
            self._actor.touch,
            replica_id,
            wanted,
            self.settings.entry_ttl_s,
            timeout=self.settings.write_timeout_s,
        )

    async def forget(self, replica_id: str, hashes: Sequence[bytes] | None = None) -> None:
        check_replica_id(replica_id)
        wanted = None if hashes is None else check_hashes(hashes)
        if wanted == []:
            return
        await self._call(
            "forget",
            self._actor.forget,
            replica_id,
            wanted,
            timeout=self.settings.write_timeout_s,
        )

    async def heartbeat(self, replica_id: str) -> bool:
        check_replica_id(replica_id)
        return await self._call(
            "heartbeat",
            self._actor.heartbeat,
            replica_id,
            self.settings.liveness_ttl_s,
            timeout=self.settings.write_timeout_s,
        )

    async def live_replicas(self) -> list[str]:
        return await self._call(
            "live_replicas", self._actor.live_replicas, timeout=self.settings.write_timeout_s
        )

    async def close(self) -> None:
        """Nothing to release: the actor is shared by every client and keeps running."""
