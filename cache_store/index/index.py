"""The checkpoint index: which replica holds a checkpoint of which prefix.

Every backend is bound to one model fingerprint, so two models sharing a backend never
see each other's entries. Entries expire `entry_ttl_s` after they were last published or
touched; a replica that stops heartbeating drops out of `lookup` after `liveness_ttl_s`.
Every method raises `IndexUnavailable` when the backend is down or too slow, and callers
then fall back to reuse of their local checkpoints only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from baton_serve.cache_store.prefix_hash import HASH_BYTES

MAX_LOOKUP_HASHES = 2_000
EMBEDDED_SPEC = "embedded"


class IndexUnavailable(RuntimeError):
    """The index did not answer in time or is down; callers fall back to local-only reuse."""


def check_hash(prefix_hash: object) -> bytes:
    """Return `prefix_hash` if it is a 16-byte prefix hash, else raise ValueError."""
    if not isinstance(prefix_hash, bytes) or len(prefix_hash) != HASH_BYTES:
        raise ValueError(f"a prefix hash must be {HASH_BYTES} bytes, got {prefix_hash!r}")
    return prefix_hash


def check_hashes(hashes: Sequence[bytes], limit: int | None = None) -> list[bytes]:
    """Validate each hash (and the count against `limit`); return them as a list."""
    if isinstance(hashes, (bytes, str)):
        raise ValueError("hashes must be a sequence of 16-byte hashes, not a single value")
    checked = [check_hash(h) for h in hashes]
    if limit is not None and len(checked) > limit:
        raise ValueError(f"at most {limit} hashes per lookup, got {len(checked)}")
    return checked


def check_replica_id(replica_id: object) -> str:
    """Return `replica_id` if it is a non-empty string, else raise ValueError."""
    if not isinstance(replica_id, str) or not replica_id:
        raise ValueError(f"replica_id must be a non-empty string, got {replica_id!r}")
    return replica_id


def check_fingerprint(fingerprint: object) -> bytes:
    """Return `fingerprint` if it is non-empty bytes, else raise ValueError."""
    if not isinstance(fingerprint, bytes) or not fingerprint:
        raise ValueError("fingerprint must be non-empty bytes")
    return fingerprint


def _is_count(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


@dataclass(frozen=True)
class IndexEntry:
    """One checkpoint a replica holds: the prefix it covers, its length and its size.

    `ready_at` (Unix seconds) marks a checkpoint still being computed — *in flight* — and
    when it is expected; 0 means held now. An in-flight entry is published with a short
    TTL and replaced by the real one once the state exists.
    """

    prefix_hash: bytes
    n_tokens: int
    nbytes: int
    ready_at: float = 0.0

    def __post_init__(self) -> None:
        check_hash(self.prefix_hash)
        if not _is_count(self.n_tokens, 1):
            raise ValueError(f"n_tokens must be an integer >= 1, got {self.n_tokens!r}")
        if not _is_count(self.nbytes, 0):
            raise ValueError(f"nbytes must be an integer >= 0, got {self.nbytes!r}")
        if not (isinstance(self.ready_at, (int, float)) and math.isfinite(self.ready_at)):
            raise ValueError(f"ready_at must be a finite number, got {self.ready_at!r}")
        if self.ready_at < 0:
            raise ValueError(f"ready_at must be >= 0, got {self.ready_at!r}")

    @property
    def in_flight(self) -> bool:
        return self.ready_at > 0


@dataclass(frozen=True)
class IndexMatch:
    """The longest checkpoint one live replica holds among the hashes looked up (held
    ones win ties with in-flight ones); `ready_at` as in `IndexEntry`."""

    replica_id: str
    prefix_hash: bytes
    n_tokens: int
    nbytes: int
    ready_at: float = 0.0

    @property
    def in_flight(self) -> bool:
        return self.ready_at > 0


def better_match(n_tokens: int, ready_at: float, than: IndexMatch | None) -> bool:
    """The lookup rule every backend applies: more tokens win; on a tie, held beats in
    flight, and an earlier entry of the chain beats a later one."""
    if than is None:
        return True
    if n_tokens != than.n_tokens:
        return n_tokens > than.n_tokens
    return ready_at == 0 < than.ready_at


@dataclass(frozen=True)
class IndexSettings:
    """Expiry and timeouts shared by every backend (seconds).

    `timeout_s` bounds `lookup` (it sits on the request path); `write_timeout_s` bounds
    every other call.
    """

    entry_ttl_s: float = 3600.0
    liveness_ttl_s: float = 15.0
    timeout_s: float = 0.05
    write_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{field.name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{field.name} must be positive and finite, got {value!r}")


class CheckpointIndex(Protocol):
    """Async index of checkpoints held by the replicas of one model (`fingerprint`)."""

    fingerprint: bytes

    async def publish(self, replica_id: str, entries: Sequence[IndexEntry]) -> None:
        """Record (or refresh) checkpoints that `replica_id` holds."""
        ...

    async def lookup(self, hashes: Sequence[bytes]) -> dict[str, IndexMatch]:
        """In one round trip (at most `MAX_LOOKUP_HASHES` hashes), return for each live
        replica its best entry among `hashes` (`better_match`)."""
        ...

    async def touch(self, replica_id: str, hashes: Sequence[bytes]) -> None:
        """Restart the expiry of entries `replica_id` holds; unknown hashes are ignored."""
        ...

    async def forget(self, replica_id: str, hashes: Sequence[bytes] | None = None) -> None:
        """Drop some entries of `replica_id`, or (None) all of them and its liveness."""
        ...

    async def heartbeat(self, replica_id: str) -> bool:
        """Mark `replica_id` alive for `liveness_ttl_s`; False when the index did not know
        it was alive (first beat, expired, or data lost): the replica re-publishes then."""
        ...

    async def live_replicas(self) -> list[str]:
        """Return the replicas whose last heartbeat has not expired, sorted."""
        ...

    async def follow(self, view: Any) -> None:
        """Keep `view` (an `index_view.IndexView`, which imports this module) a copy of this
        model's index until cancelled: a snapshot, then the backend's change stream;
        `view.synced` is False while it is not current."""
        ...

    async def close(self) -> None:
        """Release the client's resources (the index's data stays)."""
        ...
