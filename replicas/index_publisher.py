"""What one replica tells the cluster index: the prefixes its checkpoints hold, the prefixes
its requests are computing, and that it is alive.

Lookups send a prompt's block hashes, so a checkpoint is published under block hashes: an
attention state under every block it covers (it serves each of its prefixes, cut back), a
hybrid or recurrent state once, under its last whole block, with its exact length. A request
announces the positions it will checkpoint as soon as it is admitted (under the gateway's
hashes of its prompt, carried, not hashed again), *in flight* with the time they are expected; the held entry replaces that, and what never came is forgotten when
the request ends. Writes are batched by a background task; when the index is unreachable
they wait for its next heartbeat, and an index that lost its data is told everything again.
Both loops are `supervised`: any other exception is logged and the loop starts again (what
it was writing is kept for the next try).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from baton_serve.cache_store.checkpoints.checkpoint_store import Checkpoint
from baton_serve.cache_store.index.index import CheckpointIndex, IndexEntry, IndexUnavailable
from baton_serve.cache_store.index.index_entries import index_entries, prefix_ready_at
from baton_serve.cache_store.supervised import supervised
from baton_serve.cache_store.wire.protocol import ReplicaRequest
from baton_serve.replicas.engine.engine_face import EngineFace

# Entries per index write: a whole backlog (thousands of entries after a restart or a burst)
# packed in one write stalls the replica's event loop for tens of milliseconds.
PUBLISH_CHUNK = 256


class IndexPublisher:
    """Keeps the index in step with one replica's engine (its store's `CheckpointListener`)."""

    def __init__(
        self,
        replica_id: str,
        engine: EngineFace,
        index: CheckpointIndex | None,
        *,
        heartbeat_s: float,
        default_prefill_tokens_per_s: float,
        on_error: Callable[[], None],
    ) -> None:
        self.replica_id = replica_id
        self.engine = engine
        self.index = index
        self.heartbeat_s = heartbeat_s
        self._default_speed = default_prefill_tokens_per_s
        self._on_error = on_error
        # index hash → {checkpoint hash: (tokens it gives there, checkpoint bytes)}
        self._held: dict[bytes, dict[bytes, tuple[int, int]]] = {}
        # index hash → {request id: (tokens, bytes, ready_at)}: prefixes being computed now
        self._in_flight: dict[bytes, dict[str, tuple[int, int, float]]] = {}
        # checkpoint hash → the (index hash, tokens) it is published under: hashed once
        self._published: dict[bytes, list[tuple[bytes, int]]] = {}
        self._lock = threading.Lock()
        self._dirty: set[bytes] = set()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        engine.add_checkpoint_listener(self)

    def start(self) -> list[asyncio.Task[None]]:
        """Take in the store's contents and start publishing (on the serving loop); the
        tasks to cancel at close."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        for checkpoint in self.engine.checkpoints(on_disk=True):
            self.checkpoint_added(checkpoint)
        if self.index is None:
            return []
        return [
            supervised("index_publisher.heartbeat", self._heartbeat_loop),
            supervised("index_publisher.publish", self._publish_loop),
        ]

    # ---- the local store (CheckpointListener; called on the engine thread) ---------------

    def checkpoint_added(self, checkpoint: Checkpoint, chain: Sequence[bytes] = ()) -> None:
        entries = self._block_entries(checkpoint.tokens, checkpoint.n_tokens, chain)
        with self._lock:
            self._published[checkpoint.prefix_hash] = entries
            for prefix_hash, n_tokens in entries:
                by_checkpoint = self._held.setdefault(prefix_hash, {})
                by_checkpoint[checkpoint.prefix_hash] = (n_tokens, checkpoint.nbytes)
        self._mark_dirty(h for h, _ in entries)

    def checkpoint_used(self, checkpoint: Checkpoint) -> None:
        # Publishing again refreshes the entries' TTL.
        self._mark_dirty(h for h, _ in self._entries_of(checkpoint))

    def checkpoint_removed(self, checkpoint: Checkpoint) -> None:
        with self._lock:
            entries = self._published.pop(checkpoint.prefix_hash, None)
        if entries is None:
            entries = self._entries_of(checkpoint)
        with self._lock:
            for prefix_hash, _ in entries:
                by_checkpoint = self._held.get(prefix_hash, {})
                by_checkpoint.pop(checkpoint.prefix_hash, None)
                if not by_checkpoint:
                    self._held.pop(prefix_hash, None)
        self._mark_dirty(h for h, _ in entries)

    def _entries_of(self, checkpoint: Checkpoint) -> list[tuple[bytes, int]]:
        """(index hash, tokens) a checkpoint is published under (`index_entries`)."""
        with self._lock:
            entries = self._published.get(checkpoint.prefix_hash)
        return entries or self._block_entries(checkpoint.tokens, checkpoint.n_tokens)

    def _block_entries(
        self, tokens: Sequence[int], n_tokens: int, known: Sequence[bytes] = ()
    ) -> list[tuple[bytes, int]]:
        """`known`: the chain of the prompt `tokens` begin (the gateway's), not hashed again."""
        block = self.engine.config.block_tokens
        covered = n_tokens // block * block
        if not covered:
            return []
        chain = self.engine.hash_chain(tokens[:covered], known)
        every_block = not self.engine.kind.needs_checkpoints
        return index_entries(chain, n_tokens, block, every_block=every_block)

    # ---- prefixes being computed ---------------------------------------------------------

    def announce(self, request: ReplicaRequest) -> None:
        """Tell the index which prefixes this request will leave here, and when: other
        routers and replicas can then wait for them instead of computing them too."""
        if self.index is None:
            return
        prompt = request.generation.prompt
        positions = self.engine.checkpoint_positions(prompt)
        if not positions:
            return
        known = self.engine.carried_chain(prompt.tokens, request.prefix_hashes)
        speed = self.engine.stats.prefill_tokens_per_s or self._default_speed
        backlog = self.engine.load().backlog_tokens  # this prompt's tokens included
        request_id = request.generation.request_id
        now = time.time()
        end_at = now + backlog / speed
        with self._lock:
            marked = []
            for position in positions:
                # not before now: what this engine holds of the prompt is not in its backlog
                ready_at = max(now, prefix_ready_at(end_at, len(prompt), position, speed))
                size = self.engine.state_bytes(position)
                for prefix_hash, n_tokens in self._block_entries(prompt.tokens, position, known):
                    held = self._held.get(prefix_hash, {})
                    if max((n for n, _ in held.values()), default=0) >= n_tokens:
                        continue
                    self._in_flight.setdefault(prefix_hash, {})[request_id] = (
                        n_tokens,
                        size,
                        ready_at,
                    )
                    marked.append(prefix_hash)
        self._mark_dirty(marked)

    def announced_done(self, request: ReplicaRequest) -> None:
        """The request ended: what it announced is held now, or never will be."""
        request_id = request.generation.request_id
        with self._lock:
            done = [h for h, by_request in self._in_flight.items() if request_id in by_request]
            for prefix_hash in done:
                del self._in_flight[prefix_hash][request_id]
                if not self._in_flight[prefix_hash]:
                    del self._in_flight[prefix_hash]
        self._mark_dirty(done)

    def _mark_dirty(self, hashes: Iterable[bytes]) -> None:
        with self._lock:
            self._dirty.update(hashes)
        if self._loop is not None and self._wake is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the serving loop has closed: nobody publishes any more
                pass

    def _entry(self, prefix_hash: bytes) -> IndexEntry | None:
        """What to publish under `prefix_hash` now (lock held): the longest checkpoint here,
        or else the longest one being computed; None: forget it."""
        held = self._held.get(prefix_hash)
        if held:
            n_tokens, nbytes = max(held.values())
            return IndexEntry(prefix_hash=prefix_hash, n_tokens=n_tokens, nbytes=nbytes)
        coming = self._in_flight.get(prefix_hash)
        if coming:
            n_tokens, nbytes, ready_at = max(coming.values())
            return IndexEntry(prefix_hash, n_tokens, nbytes, ready_at)
        return None

    async def _publish_loop(self) -> None:
        assert self.index is not None and self._wake is not None
        self._wake.set()  # (re)started: write what is pending now
        while True:
            await self._wake.wait()
            self._wake.clear()
            with self._lock:
                dirty = set(itertools.islice(self._dirty, PUBLISH_CHUNK))
                self._dirty -= dirty
                current = {h: self._entry(h) for h in dirty}
                more = bool(self._dirty)
            entries = [e for e in current.values() if e is not None]
            gone = [h for h, e in current.items() if e is None]
            try:
                if entries:
                    await self.index.publish(self.replica_id, entries)
                if gone:
                    await self.index.forget(self.replica_id, gone)
                if more:
                    self._wake.set()  # the rest in the next write, after others had the loop
            except IndexUnavailable:
                self._on_error()
                with self._lock:
                    self._dirty |= dirty  # retried after the index answers a heartbeat again
            except BaseException:
                with self._lock:
                    self._dirty |= dirty  # retried when the supervisor restarts this loop
                raise

    async def _heartbeat_loop(self) -> None:
        assert self.index is not None and self._wake is not None
        while True:
            try:
                known = await self.index.heartbeat(self.replica_id)
            except IndexUnavailable:
                self._on_error()
            else:
                with self._lock:
                    if not known:  # first beat, or the index lost its data: publish it all
                        self._dirty |= set(self._held) | set(self._in_flight)
                    pending = bool(self._dirty)
                if pending:
                    self._wake.set()
            await asyncio.sleep(self.heartbeat_s)
