"""The in-cluster index backend: one named Ray actor holding an in-memory index.

`IndexActor` hosts a `MemoryIndex` (memory_index.py; every model, keyed by fingerprint)
in the Ray cluster, and `EmbeddedIndex` is the async client bound to one model; its
`follow` keeps a process-local `IndexView` current from the actor's change log. Expiry
times are fixed when an entry is written, from the writer's TTL, so clients with
different settings can share the actor.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import ray
from ray.actor import ActorHandle, ActorMethod
from ray.exceptions import RayError

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
from baton_serve.cache_store.index.memory_index import IndexChange, IndexSnapshot, MemoryIndex

ACTOR_NAME = "baton-index"
ACTOR_NAMESPACE = "baton"
SNAPSHOT_TIMEOUT_S = 30.0
CONNECT_ATTEMPTS = 3
CONNECT_RETRY_S = 1.0  # a whole model's entries (a million take a few seconds)
FOLLOW_POLL_S = 2.0  # the longest a follower's long poll waits for a change

# Ray destroys a non-detached actor once its creator drops the last handle, even a named
# one; so each process keeps the handle it got, per Ray node id (a new `ray.init` starts
# a new node), and a non-detached index lives as long as the process that created it.
_handles: dict[str, ActorHandle] = {}


@ray.remote(num_cpus=0, max_restarts=-1)
class IndexActor:
    """A `MemoryIndex` in the Ray cluster; a restart loses its data (heartbeats tell).

    An async actor, so followers can wait for changes (`changes`) while others write."""

    def __init__(self) -> None:
        self._index = MemoryIndex()
        self._changed: dict[bytes, asyncio.Event] = {}

    def _notify(self, fingerprint: bytes) -> None:
        event = self._changed.pop(fingerprint, None)
        if event is not None:
            event.set()

    async def ready(self) -> bool:
        return True

    async def publish(
        self, fingerprint: bytes, replica_id: str, entries: Sequence[IndexEntry], ttl_s: float
    ) -> None:
        self._index.publish(fingerprint, replica_id, entries, ttl_s)
        self._notify(fingerprint)

    async def lookup(self, fingerprint: bytes, hashes: Sequence[bytes]) -> dict[str, IndexMatch]:
        return self._index.lookup(fingerprint, hashes)

    async def touch(
        self, fingerprint: bytes, replica_id: str, hashes: Sequence[bytes], ttl_s: float
    ) -> None:
        self._index.touch(fingerprint, replica_id, hashes, ttl_s)
        self._notify(fingerprint)

    async def forget(
        self, fingerprint: bytes, replica_id: str, hashes: Sequence[bytes] | None
    ) -> None:
        self._index.forget(fingerprint, replica_id, hashes)
        self._notify(fingerprint)

    async def heartbeat(self, fingerprint: bytes, replica_id: str, ttl_s: float) -> bool:
        known = self._index.heartbeat(fingerprint, replica_id, ttl_s)
        self._notify(fingerprint)
        return known

    async def live_replicas(self, fingerprint: bytes) -> list[str]:
        return self._index.live_replicas(fingerprint)

    async def snapshot(self, fingerprint: bytes) -> IndexSnapshot:
        return self._index.snapshot(fingerprint)

    async def changes(
        self, fingerprint: bytes, origin: str, seq: int, wait_s: float
    ) -> list[IndexChange] | None:
        """The changes after `seq`, waiting up to `wait_s` for one; None when the follower
        must take a new snapshot (it fell behind the log, or this actor restarted)."""
        if origin != self._index.origin:
            return None
        changes = self._index.changes_since(fingerprint, seq)
        if changes == []:
            event = self._changed.setdefault(fingerprint, asyncio.Event())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), wait_s)
            changes = self._index.changes_since(fingerprint, seq)
        return changes


def _get_or_create(node: str, detached: bool) -> ActorHandle:
    """The actor ``baton-index``, created here if it does not exist; its handle is kept."""
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
    return actor


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
        for attempt in range(CONNECT_ATTEMPTS):
            actor = _handles.get(node) or _get_or_create(node, detached)
            try:
                await _await_ref("start", actor.ready, (), start_timeout_s)
                return cls(actor, fingerprint, checked)
            except IndexUnavailable:
                # A non-detached actor whose creator died keeps its name for a moment:
                # drop the dead handle and ask again.
                _handles.pop(node, None)
                if attempt == CONNECT_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(CONNECT_RETRY_S)
        raise AssertionError("unreachable")

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

    async def follow(
        self, view: IndexView, *, wait_s: float = FOLLOW_POLL_S, retry_s: float = 1.0
    ) -> None:
        """Keep `view` a copy of this model's index until cancelled: a snapshot, then the
        actor's changes as they happen (a long poll, answered at least every `wait_s`, which
        keeps the view's age low while nothing changes); again from a snapshot after a gap."""
        while True:
            try:
                snapshot = await self._call(
                    "snapshot", self._actor.snapshot, timeout=SNAPSHOT_TIMEOUT_S
                )
                await view.reset(snapshot)
                while view.synced:
                    changes = await self._call(
                        "changes",
                        self._actor.changes,
                        view.origin,
                        view.seq,
                        wait_s,
                        timeout=wait_s + self.settings.write_timeout_s,
                    )
                    if changes is None or not view.apply(changes):
                        view.lost()
            except IndexUnavailable:
                view.lost()
                await asyncio.sleep(retry_s)

    async def close(self) -> None:
        """Nothing to release: the actor is shared by every client and keeps running."""
