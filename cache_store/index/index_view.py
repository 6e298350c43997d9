"""A process-local copy of one model's checkpoint index, fed by its backend's change stream.

A router asks it instead of the store: a lookup is a few dictionary reads (microseconds)
rather than a network round trip. The store stays the source of truth: the view starts
from a snapshot, applies the numbered changes that follow, and on any gap (a lost
message, a restarted store) it is out of sync until a new snapshot, during which callers
look the store up directly (`synced` says which to use).

A stream can also stall without breaking (a frozen server, a follower that stopped), so the
view knows its `age`: the seconds since it last heard from its stream. Followers call
`heard` whenever the stream answers, even with nothing new (an empty long poll, a pong);
`trusted` says whether the copy is synced and young enough to route by.

A snapshot is copied in a worker thread: on the router's event loop, 100,000 entries held up
every request and stream of the gateway for 0.2-0.6 s (`baton bench serve`'s slowest
decision); the view is out of sync, so lookups go to the store, until the copy is in place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence

from baton_serve.cache_store.index.index import MAX_LOOKUP_HASHES, IndexMatch, check_hashes
from baton_serve.cache_store.index.memory_index import IndexChange, IndexSnapshot, ModelIndex

# A router trusts its copy while the change stream answered within this long (healthy
# streams answer every 1-2 s); past it, and until synced, each decision looks the index up
# directly, waiting at most LOOKUP_TIMEOUT_S. `routing.*` settings; their defaults here.
MAX_VIEW_AGE_S = 10.0
LOOKUP_TIMEOUT_S = 0.02


class IndexView:
    """One model's index as of the last change applied; not thread-safe (one event loop)."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._index = ModelIndex()
        self.seq: int | None = None  # the last change applied; None: not synced
        self._streaming = False  # a change newer than the snapshot has been applied
        self.origin = ""  # which store's numbering `seq` belongs to
        self.on_change: Callable[[IndexChange], None] | None = None  # e.g. a staleness probe
        self._heard_at = now()  # when the stream last answered (at first: when made)

    @property
    def synced(self) -> bool:
        return self.seq is not None

    @property
    def age(self) -> float:
        """Seconds since the stream last answered (since this view was made, if never)."""
        return max(0.0, self._now() - self._heard_at)

    def trusted(self, max_age_s: float) -> bool:
        """Synced, and heard from its stream within the last `max_age_s` seconds."""
        return self.synced and self.age <= max_age_s

    def heard(self) -> None:
        """The stream answered (changes or not): the view is current as of now."""
        self._heard_at = self._now()

    @property
    def entries(self) -> int:
        return self._index.size

    async def reset(self, snapshot: IndexSnapshot) -> None:
        """Start over from `snapshot`, copied in a worker thread (out of sync meanwhile)."""
        self.seq = None
        now = self._now()
        self._index = await asyncio.to_thread(_index_of, snapshot, now)
        self.seq, self.origin = snapshot.seq, snapshot.origin
        self._streaming = False
        self._heard_at = now

    def apply(self, changes: Iterable[IndexChange]) -> bool:
        """Apply changes in order (none: the stream answered with nothing new); False (and
        out of sync) at a gap in their numbering, or when it starts again (a store that lost
        its data)."""
        if self.seq is not None:
            self.heard()
        for change in changes:
            if self.seq is None:
                return False
            if change.seq <= self.seq and not self._streaming:
                continue  # from before the snapshot: already in it
            if change.seq != self.seq + 1:
                self.lost()
                return False
            self._index.apply(change, self._now())
            self.seq, self._streaming = change.seq, True
            if self.on_change is not None:
                self.on_change(change)
        return True

    def lost(self) -> None:
        """Mark the view out of sync (the stream broke); lookups go to the store."""
        self.seq = None

    def lookup(self, hashes: Sequence[bytes]) -> dict[str, IndexMatch]:
        """As `CheckpointIndex.lookup`, from this copy."""
        wanted = check_hashes(hashes, MAX_LOOKUP_HASHES)
        now = self._now()
        self._index.expire(now)
        return self._index.lookup(wanted, now)


def _index_of(snapshot: IndexSnapshot, now: float) -> ModelIndex:
    """A new index holding `snapshot`'s entries and live replicas, their times from `now`."""
    index = ModelIndex()
    for replica_id, entry, seconds_left in snapshot.entries:
        index.publish(replica_id, [entry], now + seconds_left)
    index.alive = {r: now + left for r, left in snapshot.alive.items()}
    return index
