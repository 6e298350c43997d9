"""The index as an in-memory data structure, and the changes that keep copies of it current.

`ModelIndex` holds the entries of one model (who holds which prefix, until when, and which
replicas are alive). `MemoryIndex` holds one per model and logs every write as an
`IndexChange` — what the embedded actor serves to followers; Redis carries the same
changes over pub/sub. `IndexView` (index_view.py) is a `ModelIndex` fed by those changes.

Times inside are on the structure's own clock (`now`); changes carry durations (TTLs), so
a copy in another process converts them to its own clock. `ready_at` is Unix time (a hint
for cost models, compared with `time.time()`).
"""

from __future__ import annotations

import heapq
import math
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from baton_serve.cache_store.index.index import (
    MAX_LOOKUP_HASHES,
    IndexEntry,
    IndexMatch,
    check_fingerprint,
    check_hashes,
    check_replica_id,
)

CHANGE_LOG_SIZE = 100_000  # changes a follower may lag behind before it must resync


# One replica's holding of one prefix: (n_tokens, nbytes, expires_at, ready_at), read by the
# positions below. A plain tuple, not a class: the garbage collector stops tracking a tuple of
# numbers, and then the dict of a prefix's holders, so a process holding an index of 100,000
# entries has ~19k objects for each full collection to walk instead of ~219k (14 ms instead
# of 34 on the 2-core development machine; a router's copy sits in every gateway).
_Held = tuple[int, int, float, float]
_N_TOKENS, _NBYTES, _EXPIRES_AT, _READY_AT = range(4)
# An entry as a plain tuple, for the same reason: (prefix_hash, n_tokens, nbytes, ready_at).
HeldPrefix = tuple[bytes, int, int, float]


@dataclass(frozen=True)
class IndexChange:
    """One write to one model's index, numbered in order (`seq`).

    kind: ``publish`` (`entries`, each held for `ttl_s`), ``touch`` (`hashes`, `ttl_s`),
    ``forget`` (`hashes`), ``forget_all``, or ``alive`` (a heartbeat: alive for `ttl_s`).
    """

    seq: int
    kind: str
    replica_id: str
    entries: tuple[IndexEntry, ...] = ()
    hashes: tuple[bytes, ...] = ()
    ttl_s: float = 0.0


@dataclass(frozen=True)
class IndexSnapshot:
    """A whole model's index as of change `seq` of the store `origin` (changes after it
    must be applied on top): (replica, entry, seconds left), and the live replicas with
    their seconds of liveness left."""

    seq: int
    entries: tuple[tuple[str, IndexEntry, float], ...]
    alive: dict[str, float]
    origin: str = ""


@dataclass
class ModelIndex:
    """Everything the index knows about one model; not thread-safe."""

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
        heapq.heappush(self.expiry, (held[_EXPIRES_AT], prefix_hash, replica_id))
        if len(self.expiry) > 2 * self.size + 1024:  # drop stale heap items
            self.expiry = [
                (held[_EXPIRES_AT], h, r)
                for h, by_replica in self.holders.items()
                for r, held in by_replica.items()
            ]
            heapq.heapify(self.expiry)

    def publish(self, replica_id: str, entries: Sequence[IndexEntry], expires_at: float) -> None:
        held = ((e.prefix_hash, e.n_tokens, e.nbytes, e.ready_at) for e in entries)
        self.hold(replica_id, held, expires_at)

    def hold(self, replica_id: str, entries: Iterable[HeldPrefix], expires_at: float) -> None:
        """`publish` for entries as plain tuples (a router's own record of what it sent)."""
        for prefix_hash, n_tokens, nbytes, ready_at in entries:
            self.put(prefix_hash, replica_id, (n_tokens, nbytes, expires_at, ready_at))

    def touch(self, replica_id: str, hashes: Sequence[bytes], expires_at: float) -> None:
        for prefix_hash in hashes:
            held = self.holders.get(prefix_hash, {}).get(replica_id)
            if held is not None:
                self.put(
                    prefix_hash,
                    replica_id,
                    (held[_N_TOKENS], held[_NBYTES], expires_at, held[_READY_AT]),
                )

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

    def forget(self, replica_id: str, hashes: Sequence[bytes] | None) -> None:
        if hashes is None:
            hashes = list(self.by_replica.get(replica_id, ()))
            self.alive.pop(replica_id, None)
        for prefix_hash in hashes:
            self.remove(prefix_hash, replica_id)

    def expire(self, now: float) -> None:
        while self.expiry and self.expiry[0][0] <= now:
            _, prefix_hash, replica_id = heapq.heappop(self.expiry)
            held = self.holders.get(prefix_hash, {}).get(replica_id)
            if held is not None and held[_EXPIRES_AT] <= now:
                self.remove(prefix_hash, replica_id)

    def is_alive(self, replica_id: str, now: float) -> bool:
        return self.alive.get(replica_id, -math.inf) > now

    def lookup(self, hashes: Sequence[bytes], now: float) -> dict[str, IndexMatch]:
        """Each live replica's best unexpired entry among `hashes` (`better_match`)."""
        # Best entries are kept as (entry, hash) and turned into matches once at the end: a
        # prefix held by hundreds of replicas is compared once per replica and block.
        best: dict[str, tuple[_Held, bytes]] = {}
        live: dict[str, bool] = {}
        known_best, holders = best.get, self.holders
        for prefix_hash in hashes:
            for replica_id, held in holders.get(prefix_hash, {}).items():
                if held[_EXPIRES_AT] <= now:
                    continue
                known = known_best(replica_id)
                if known is not None:  # `better_match`, inlined
                    than = known[0]
                    if held[_N_TOKENS] != than[_N_TOKENS]:
                        if held[_N_TOKENS] < than[_N_TOKENS]:
                            continue
                    elif not held[_READY_AT] == 0 < than[_READY_AT]:
                        continue
                alive = live.get(replica_id)
                if alive is None:
                    alive = live[replica_id] = self.is_alive(replica_id, now)
                if alive:
                    best[replica_id] = (held, prefix_hash)
        return {
            rid: IndexMatch(rid, prefix_hash, held[_N_TOKENS], held[_NBYTES], held[_READY_AT])
            for rid, (held, prefix_hash) in best.items()
        }

    def snapshot(self, seq: int, now: float, origin: str) -> IndexSnapshot:
        entries = tuple(
            (r, IndexEntry(h, n_tokens, nbytes, ready_at), expires_at - now)
            for h, by_replica in self.holders.items()
            for r, (n_tokens, nbytes, expires_at, ready_at) in by_replica.items()
            if expires_at > now
        )
        alive = {r: until - now for r, until in self.alive.items() if until > now}
        return IndexSnapshot(seq=seq, entries=entries, alive=alive, origin=origin)

    def apply(self, change: IndexChange, now: float) -> None:
        """Make the write `change` describes (its TTLs counted from `now`)."""
        until = now + change.ttl_s
        if change.kind == "publish":
            self.publish(change.replica_id, change.entries, until)
        elif change.kind == "touch":
            self.touch(change.replica_id, change.hashes, until)
        elif change.kind == "forget":
            self.forget(change.replica_id, change.hashes)
        elif change.kind == "forget_all":
            self.forget(change.replica_id, None)
        elif change.kind == "alive":
            self.alive[change.replica_id] = until
        else:
            raise ValueError(f"unknown index change {change.kind!r}")


@dataclass
class _Logged:
    """One model's index and the log of its recent changes."""

    index: ModelIndex = field(default_factory=ModelIndex)
    log: deque[IndexChange] = field(default_factory=lambda: deque(maxlen=CHANGE_LOG_SIZE))
    seq: int = 0


class MemoryIndex:
    """In-memory checkpoint index for any number of models, keyed by fingerprint, with a
    log of recent changes per model for followers (`changes_since`).

    Not thread-safe; `now` is the clock all expiry uses (injectable for tests).
    """

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._models: dict[bytes, _Logged] = {}
        self.origin = uuid.uuid4().hex  # followers of an earlier instance must resync

    def _model(self, fingerprint: bytes) -> tuple[ModelIndex, float]:
        logged = self._models.setdefault(check_fingerprint(fingerprint), _Logged())
        now = self._now()
        logged.index.expire(now)
        return logged.index, now

    def _log(self, fingerprint: bytes, kind: str, replica_id: str, **fields: object) -> None:
        logged = self._models[fingerprint]
        logged.seq += 1
        logged.log.append(IndexChange(logged.seq, kind, replica_id, **fields))  # type: ignore[arg-type]

    def publish(
        self, fingerprint: bytes, replica_id: str, entries: Sequence[IndexEntry], ttl_s: float
    ) -> None:
        check_replica_id(replica_id)
        for entry in entries:
            if not isinstance(entry, IndexEntry):
                raise ValueError(f"entries must be IndexEntry, got {entry!r}")
        model, now = self._model(fingerprint)
        model.publish(replica_id, entries, now + ttl_s)
        self._log(fingerprint, "publish", replica_id, entries=tuple(entries), ttl_s=ttl_s)

    def lookup(self, fingerprint: bytes, hashes: Sequence[bytes]) -> dict[str, IndexMatch]:
        wanted = check_hashes(hashes, MAX_LOOKUP_HASHES)
        model, now = self._model(fingerprint)
        return model.lookup(wanted, now)

    def touch(
        self, fingerprint: bytes, replica_id: str, hashes: Sequence[bytes], ttl_s: float
    ) -> None:
        check_replica_id(replica_id)
        wanted = check_hashes(hashes)
        model, now = self._model(fingerprint)
        model.touch(replica_id, wanted, now + ttl_s)
        self._log(fingerprint, "touch", replica_id, hashes=tuple(wanted), ttl_s=ttl_s)

    def forget(
        self, fingerprint: bytes, replica_id: str, hashes: Sequence[bytes] | None = None
    ) -> None:
        check_replica_id(replica_id)
        wanted = None if hashes is None else check_hashes(hashes)
        model, _ = self._model(fingerprint)
        model.forget(replica_id, wanted)
        if wanted is None:
            self._log(fingerprint, "forget_all", replica_id)
        else:
            self._log(fingerprint, "forget", replica_id, hashes=tuple(wanted))

    def heartbeat(self, fingerprint: bytes, replica_id: str, ttl_s: float) -> bool:
        check_replica_id(replica_id)
        model, now = self._model(fingerprint)
        known = model.is_alive(replica_id, now)
        model.alive[replica_id] = now + ttl_s
        self._log(fingerprint, "alive", replica_id, ttl_s=ttl_s)
        return known

    def live_replicas(self, fingerprint: bytes) -> list[str]:
        model, now = self._model(fingerprint)
        for replica_id in [r for r in model.alive if not model.is_alive(r, now)]:
            del model.alive[replica_id]
        return sorted(model.alive)

    def snapshot(self, fingerprint: bytes) -> IndexSnapshot:
        model, now = self._model(fingerprint)
        return model.snapshot(self._models[fingerprint].seq, now, self.origin)

    def changes_since(self, fingerprint: bytes, seq: int) -> list[IndexChange] | None:
        """The changes after `seq`, oldest first; None if some of them have left the log
        (the follower must take a new snapshot)."""
        logged = self._models.setdefault(check_fingerprint(fingerprint), _Logged())
        if seq >= logged.seq:
            return []
        oldest = logged.log[0].seq if logged.log else logged.seq + 1
        if seq + 1 < oldest:
            return None
        newer = []
        for change in reversed(logged.log):  # the newest few, without walking the whole log
            if change.seq <= seq:
                break
            newer.append(change)
        return newer[::-1]
