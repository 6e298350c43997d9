"""A replica: one engine, its entries in the cluster index, and state pulls from peers.

The index is only ever a hint. It is told which prefixes this replica holds (each
checkpoint under the hash of the last whole block it covers, with its exact length) and
is asked, before a request runs, whether a peer holds a longer prefix. The peer then
exports its longest checkpoint that exactly prefixes the prompt; this replica validates
it fully and restores it. When the index is down or slow, a peer dies, a blob is bad or
a deadline passes, the request simply computes what it must: it never fails for that.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import numpy as np
from opentelemetry.trace import Span

from baton_serve.cache_store.checkpoint_store import Checkpoint
from baton_serve.cache_store.index import CheckpointIndex, IndexEntry, IndexUnavailable
from baton_serve.cache_store.state_blob import BlobError
from baton_serve.replicas.engine.checkpoint_policy import MIN_PIECE
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.protocol import (
    Admitted,
    Completion,
    EngineError,
    ReplicaRequest,
    TokenEvent,
)
from baton_serve.replicas.request_telemetry import RequestTelemetry
from baton_serve.replicas.shipping import PeerDirectory, ShipPolicy
from baton_serve.replicas.telemetry import metrics, tracing
from baton_serve.replicas.telemetry.logs import request_fields

logger = logging.getLogger("baton.replica")
CLOSE_TIMEOUT_S = 5.0

GAUGE_PERIOD_S = 1.0  # how often the queue, slot and store gauges are sampled


@dataclass
class ReplicaStats:
    pulls: int = 0
    pulled_bytes: int = 0
    pulls_skipped: int = 0  # a peer had more, but recomputing was estimated cheaper
    pull_misses: int = 0  # the peer had nothing better after all
    pull_failures: int = 0  # peer dead, unreachable or past the deadline
    pulls_rejected: int = 0  # the blob failed validation
    exports: int = 0
    exported_bytes: int = 0
    index_errors: int = 0


class Replica:
    """Serves requests from one engine and keeps the cluster index in step with it."""

    def __init__(
        self,
        replica_id: str,
        engine: Engine,
        *,
        index: CheckpointIndex | None = None,
        peers: PeerDirectory | None = None,
        policy: ShipPolicy | None = None,
        heartbeat_s: float = 5.0,
    ) -> None:
        self.replica_id = replica_id
        self.engine = engine
        self.index = index
        self.peers = peers
        self.policy = policy or ShipPolicy()
        self.heartbeat_s = heartbeat_s
        self.stats = ReplicaStats()
        self._anchors: dict[bytes, dict[int, int]] = {}  # anchor hash → {n_tokens: nbytes}
        self._lock = threading.Lock()
        self._dirty: set[bytes] = set()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        engine.cache.listener = self

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Start publishing to the index (call once, on the loop that serves requests)."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        for checkpoint in self.engine.cache.store.entries():  # RAM and disk
            self.checkpoint_added(checkpoint)
        if self.index is not None:
            self._tasks += [
                asyncio.create_task(self._heartbeat_loop()),
                asyncio.create_task(self._publish_loop()),
            ]
        if metrics.enabled():
            self._tasks.append(asyncio.create_task(self._gauge_loop()))

    async def close(self) -> None:
        """Stop, and remove this replica's entries from the index (best effort, bounded:
        an index that stopped answering must not keep a replica from closing)."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=CLOSE_TIMEOUT_S)
        if self.index is not None:
            forget = asyncio.ensure_future(self.index.forget(self.replica_id))
            done, _ = await asyncio.wait({forget}, timeout=CLOSE_TIMEOUT_S)
            if not done:
                forget.cancel()
            elif (error := forget.exception()) and not isinstance(error, IndexUnavailable):
                raise error

    # ---- requests ------------------------------------------------------------------------

    async def generate(self, request: ReplicaRequest) -> Completion:
        """Run one request to completion (after pulling a peer's prefix if worth it)."""
        with RequestTelemetry(request, self.replica_id) as telemetry:
            await self.prepare(request.generation.prompt.tokens, telemetry)
            telemetry.submitting()
            handle = self.engine.submit(request.generation)
            try:
                done = await handle.aresult()
            finally:
                if not handle.done:  # the caller went away: free the slot
                    handle.cancel()
            telemetry.finished(done)
        return done.model_copy(update={"replica_id": self.replica_id})

    async def stream(
        self, request: ReplicaRequest
    ) -> AsyncGenerator[Admitted | TokenEvent | Completion, None]:
        """`Admitted` once the request passed the engine's checks, then its tokens, then its
        `Completion`. Closing the stream early (a client that went away) cancels the
        generation and frees its slot."""
        with RequestTelemetry(request, self.replica_id) as telemetry:
            self.engine.check(request.generation)
            yield Admitted(replica_id=self.replica_id)
            await self.prepare(request.generation.prompt.tokens, telemetry)
            telemetry.submitting()
            handle = self.engine.submit(request.generation)
            try:
                async for event in handle.aiter():
                    yield event
                done = handle.result()
                telemetry.finished(done)
                yield done.model_copy(update={"replica_id": self.replica_id})
            finally:
                if not handle.done:
                    handle.cancel()

    async def prepare(self, tokens: tuple[int, ...], telemetry: RequestTelemetry) -> None:
        """Pull a longer prefix from a peer when the index says one has it and that is
        estimated faster than computing it. Never raises; never waits past a deadline."""
        if self.index is None or self.peers is None:
            return
        usable = len(tokens) - MIN_PIECE  # the engine always computes the last piece itself
        local, local_restore_s = self.engine.local_reuse(tokens)
        if usable - local < self.policy.min_gain_tokens:
            return  # no peer can hold enough more to be worth a pull: skip the lookup
        chain = self.engine.cache.hasher.chain(tokens[:usable])
        if not chain:
            return
        started = time.perf_counter()
        try:
            with tracing.span("index.lookup", parent=telemetry.context):
                matches = await self.index.lookup(chain)
        except IndexUnavailable:
            self._index_error()
            return
        finally:
            metrics.INDEX_LOOKUP.observe(time.perf_counter() - started, caller="replica")
        peers = [m for rid, m in matches.items() if rid != self.replica_id]
        if not peers:
            return
        best = max(peers, key=lambda m: m.n_tokens)
        gain = min(best.n_tokens, usable) - local
        prefill_speed = self.engine.stats.prefill_tokens_per_s
        if not self.policy.should_pull(gain, best.nbytes, prefill_speed, local_restore_s):
            if gain > 0:
                self.stats.pulls_skipped += 1
                metrics.PULLS.inc(outcome="skipped")
            return
        deadline = self.policy.deadline(gain, prefill_speed)
        attributes = {"baton.peer": best.replica_id, "baton.pull.gain_tokens": gain}
        with tracing.span("pull", parent=telemetry.context, attributes=attributes) as span:
            outcome = await self._pull(
                best.replica_id, tokens, local, deadline, span, telemetry.request_id
            )
            span.set_attribute("baton.pull.outcome", outcome)
        metrics.PULLS.inc(outcome=outcome)

    async def _pull(
        self,
        peer: str,
        tokens: tuple[int, ...],
        local: int,
        deadline: float,
        span: Span,
        request_id: str,
    ) -> str:
        """Fetch, check and store the peer's state; the outcome: pulled, miss, failed or
        rejected."""
        assert self.peers is not None
        started = time.perf_counter()
        try:
            blob = await asyncio.wait_for(self.peers.fetch(peer, tokens, local), deadline)
        except Exception as exc:  # a dead, slow or unreachable peer only costs a recompute
            self.stats.pull_failures += 1
            logger.info(
                "pull from %s failed (%s); computing instead",
                peer,
                type(exc).__name__,
                extra=request_fields(request_id),
            )
            return "failed"
        if blob is None:
            self.stats.pull_misses += 1
            return "miss"
        fetched_s = time.perf_counter() - started
        self.policy.record_pull(blob.nbytes, fetched_s)
        span.set_attributes(
            {"baton.pull.bytes": blob.nbytes, "baton.pull.fetch_ms": 1e3 * fetched_s}
        )
        try:
            await asyncio.to_thread(self.engine.cache.import_checkpoint, blob)
        except (BlobError, EngineError) as exc:
            self.stats.pulls_rejected += 1
            reason = exc.reason if isinstance(exc, BlobError) else "over_budget"
            span.set_attribute("baton.pull.reject_reason", reason)
            logger.warning(
                "rejected a state blob from %s: %s",
                peer,
                exc,
                extra=request_fields(request_id),
            )
            return "rejected"
        self.stats.pulls += 1
        self.stats.pulled_bytes += blob.nbytes
        metrics.PULLED_BYTES.inc(blob.nbytes)
        return "pulled"

    def export_best(self, tokens: tuple[int, ...], min_tokens: int) -> np.ndarray | None:
        """For a peer: our longest checkpoint prefixing `tokens`, as a uint8 array (the
        cheapest type to move through Ray's object store)."""
        blob = self.engine.cache.export_best(tokens, min_tokens)
        if blob is None:
            return None
        self.stats.exports += 1
        self.stats.exported_bytes += len(blob)
        metrics.CHECKPOINTS_SHIPPED.inc()
        metrics.SHIPPED_BYTES.inc(len(blob))
        return np.frombuffer(blob, dtype=np.uint8)

    # ---- index bookkeeping (CheckpointListener; called on the engine thread) -------------

    def checkpoint_added(self, checkpoint: Checkpoint) -> None:
        anchor = self._anchor(checkpoint)
        if anchor is not None:
            with self._lock:
                self._anchors.setdefault(anchor, {})[checkpoint.n_tokens] = checkpoint.nbytes
            self._mark_dirty(anchor)

    def checkpoint_used(self, checkpoint: Checkpoint) -> None:
        anchor = self._anchor(checkpoint)
        if anchor is not None:
            self._mark_dirty(anchor)  # publishing again refreshes the entry's TTL

    def checkpoint_removed(self, checkpoint: Checkpoint) -> None:
        anchor = self._anchor(checkpoint)
        if anchor is not None:
            with self._lock:
                held = self._anchors.get(anchor, {})
                held.pop(checkpoint.n_tokens, None)
                if not held:
                    self._anchors.pop(anchor, None)
            self._mark_dirty(anchor)

    def _anchor(self, checkpoint: Checkpoint) -> bytes | None:
        """The hash of the last whole block a checkpoint covers: what lookups send."""
        block = self.engine.cache.hasher.block_tokens
        covered = checkpoint.n_tokens // block * block
        return self.engine.cache.hasher.prefix_hash(checkpoint.tokens, covered) if covered else None

    def _mark_dirty(self, anchor: bytes) -> None:
        with self._lock:
            self._dirty.add(anchor)
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _publish_loop(self) -> None:
        assert self.index is not None and self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            with self._lock:
                dirty, self._dirty = self._dirty, set()
                held = {a: dict(self._anchors[a]) for a in dirty if a in self._anchors}
            entries = [
                IndexEntry(prefix_hash=a, n_tokens=max(sizes), nbytes=sizes[max(sizes)])
                for a, sizes in held.items()
            ]
            gone = [a for a in dirty if a not in held]
            try:
                if entries:
                    await self.index.publish(self.replica_id, entries)
                if gone:
                    await self.index.forget(self.replica_id, gone)
            except IndexUnavailable:
                self._index_error()
                with self._lock:
                    self._dirty |= dirty  # retried after the index answers a heartbeat again

    async def _heartbeat_loop(self) -> None:
        assert self.index is not None and self._wake is not None
        while True:
            try:
                known = await self.index.heartbeat(self.replica_id)
            except IndexUnavailable:
                self._index_error()
            else:
                with self._lock:
                    if not known:  # first beat, or the index lost its data: publish it all
                        self._dirty |= set(self._anchors)
                    pending = bool(self._dirty)
                if pending:
                    self._wake.set()
            await asyncio.sleep(self.heartbeat_s)

    async def _gauge_loop(self) -> None:
        while True:
            load = self.engine.load()
            metrics.QUEUE_LENGTH.set(load.queued)
            metrics.SLOTS_IN_USE.set(load.running)
            metrics.STORE_BYTES.set(self.engine.cache.store.used_bytes)
            await asyncio.sleep(GAUGE_PERIOD_S)

    def _index_error(self) -> None:
        self.stats.index_errors += 1
        metrics.INDEX_ERRORS.inc(caller="replica")
