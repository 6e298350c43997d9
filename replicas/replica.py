"""A replica: one engine, its entries in the cluster index, and state pulls from peers.

The index is only ever a hint. It is told which prefixes this replica holds and is
computing (`index_publisher`). Before a request runs, the replica gets its prefix as the
router planned — pulling it from a named peer — or, without a plan, as the index suggests
(`prefix_pull`). A peer exports its checkpoint giving the longest prefix of the prompt
(waiting for it if it is still being computed); this replica validates it fully and
restores it. When the index is down or slow, a peer dies, a blob is bad or a deadline
passes, the request simply computes what it must: it never fails for that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator

from baton_serve.cache_store.checkpoints.checkpoint import Checkpoint
from baton_serve.cache_store.checkpoints.state_blob import BlobError
from baton_serve.cache_store.index.index import CheckpointIndex, IndexUnavailable
from baton_serve.cache_store.supervised import supervised
from baton_serve.cache_store.telemetry import metrics
from baton_serve.cache_store.wire.protocol import (
    Admitted,
    Completion,
    EngineError,
    ReplicaRequest,
    TokenEvent,
)
from baton_serve.replicas.engine.engine_face import EngineFace
from baton_serve.replicas.handoff import HandoffReport, hand_off, handoff_order
from baton_serve.replicas.index_publisher import IndexPublisher
from baton_serve.replicas.loop_lag import LoopLagMonitor
from baton_serve.replicas.off_loop import OffLoop, submit
from baton_serve.replicas.prefix_pull import PrefixPuller, ReplicaStats
from baton_serve.replicas.request_telemetry import RequestTelemetry
from baton_serve.replicas.shipping import (
    PeerDirectory,
    PeerReply,
    ShipPolicy,
    StillComputing,
    received_blob,
    shipped_blob,
    shipped_nbytes,
)
from baton_serve.replicas.state_stream import STREAMED, StreamOffer, StreamSender

logger = logging.getLogger("baton.replica")
CLOSE_TIMEOUT_S = 5.0
FINISH_S = 5.0  # leaving, the longest wait for replays of replies already sent

GAUGE_PERIOD_S = 1.0  # how often the queue, slot and store gauges are sampled
EXPORT_POLL_S = 0.02  # how often an export waiting for a checkpoint being computed looks


class Replica:
    """Serves requests from one engine and keeps the cluster index in step with it."""

    def __init__(
        self,
        replica_id: str,
        engine: EngineFace,
        *,
        index: CheckpointIndex | None = None,
        peers: PeerDirectory | None = None,
        policy: ShipPolicy | None = None,
        heartbeat_s: float = 5.0,
        expects_plans: bool = False,
    ) -> None:
        """`expects_plans`: Baton's router sends its requests (each should carry a plan)."""
        self.replica_id = replica_id
        self.engine = engine
        self.index = index
        self.peers = peers
        self.policy = policy or ShipPolicy()
        self.heartbeat_s = heartbeat_s
        self.stats = ReplicaStats()
        self.publisher = IndexPublisher(
            replica_id,
            engine,
            index,
            heartbeat_s=heartbeat_s,
            default_prefill_tokens_per_s=self.policy.prefill_tokens_per_s,
            on_error=self._index_error,
        )
        self.streams = StreamSender()
        self.off_loop = OffLoop()  # per-request CPU work: token scans, grammars, hashing
        self.puller = PrefixPuller(
            replica_id,
            engine,
            index,
            peers,
            self.policy,
            self.stats,
            self.off_loop,
            expects_plans=expects_plans,
        )
        self.puller.on_index_error = self._index_error
        self.loop_lag = LoopLagMonitor()
        self._tasks: list[asyncio.Task[None]] = []
        self._leaving = False

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Start publishing to the index (call once, on the loop that serves requests)."""
        self._tasks += self.publisher.start()
        self._tasks.append(self.loop_lag.start())
        if metrics.enabled():
            self._tasks.append(supervised("replica.gauges", self._gauge_loop))

    def check_health(self) -> None:
        """Raise `EngineStalled` if the engine loop is stuck or gone (Serve's probe)."""
        self.engine.check_health()

    async def leave(self, handoff_s: float) -> HandoffReport:
        """Leave for good, once no request is left: let the engine finish the work in hand
        (replies already sent are replayed into exact states), stop it (its idle slots'
        states go to the store), offer the hottest checkpoints to live peers for up to
        `handoff_s`, then `close`. The engine itself is closed by the caller."""
        self._leaving = True
        await asyncio.to_thread(self.engine.wait_idle, FINISH_S)
        await asyncio.to_thread(self.engine.stop)
        report = await self._hand_off(handoff_s)
        await self.close()
        return report

    async def _hand_off(self, deadline_s: float) -> HandoffReport:
        if self.index is None or self.peers is None or deadline_s <= 0:
            return HandoffReport()
        try:
            live = await asyncio.wait_for(self.index.live_replicas(), CLOSE_TIMEOUT_S)
        except (IndexUnavailable, TimeoutError):
            self._index_error()
            return HandoffReport()
        nested = not self.engine.kind.needs_checkpoints
        order = await asyncio.to_thread(handoff_order, self.engine.checkpoints(), nested=nested)
        report = await hand_off(
            order,
            self._export_checkpoint,
            self.peers,
            [rid for rid in live if rid != self.replica_id],
            deadline_s=deadline_s,
            bytes_per_peer=self.engine.store_figures().budget_bytes // 2,
        )
        logger.info(
            "handed %d of %d checkpoints (%.1f MB) to %d peers in %.2f s; %d left",
            report.accepted,
            report.offered,
            report.accepted_bytes / 1e6,
            report.peers,
            report.seconds,
            report.left,
        )
        return report

    def _export_checkpoint(self, checkpoint: Checkpoint) -> PeerReply | None:
        parts = self.engine.export_checkpoint(checkpoint.prefix_hash)
        return None if parts is None else self._shipped((parts, checkpoint.shared))

    async def adopt(self, reply: PeerReply) -> bool:
        """Keep a checkpoint a leaving peer hands over: checked in full like a pulled one,
        then published to the index. False if refused (this replica is leaving too, or
        the blob is bad)."""
        if self._leaving:
            return False
        try:
            blob = await received_blob(reply)
            await asyncio.to_thread(self.engine.import_checkpoint, blob)
        except (BlobError, EngineError) as exc:
            logger.warning("refused a handed-off state blob: %s", exc)
            return False
        except Exception as exc:  # its copy in the object store is gone with the peer
            logger.info("a handed-off state blob could not be fetched (%s)", type(exc).__name__)
            return False
        self.stats.adopted += 1
        self.stats.adopted_bytes += shipped_nbytes(blob)
        return True

    async def close(self) -> None:
        """Stop, and remove this replica's entries from the index (best effort, bounded:
        an index that stopped answering must not keep a replica from closing)."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=CLOSE_TIMEOUT_S)
        self.off_loop.close()
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
            await self.puller.prepare(request, telemetry)
            telemetry.submitting()
            handle = await submit(self.off_loop, self.engine, self.publisher, request)
            try:
                done = await handle.aresult()
            finally:
                self.publisher.announced_done(request)
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
            await self.off_loop.run(self.engine.check, request.generation)
            yield Admitted(replica_id=self.replica_id)
            await self.puller.prepare(request, telemetry)
            telemetry.submitting()
            handle = await submit(self.off_loop, self.engine, self.publisher, request)
            try:
                async for event in handle.aiter():
                    yield event
                done = handle.result()
                telemetry.finished(done)
                yield done.model_copy(update={"replica_id": self.replica_id})
            finally:
                self.publisher.announced_done(request)
                if not handle.done:
                    handle.cancel()

    async def export_when_ready(
        self,
        tokens: tuple[int, ...],
        min_tokens: int,
        wait_s: float = 0.0,
        offer: StreamOffer | None = None,
    ) -> PeerReply | StillComputing | str | None:
        """For a peer: our checkpoint giving the longest prefix of `tokens`, signed, waiting
        up to `wait_s` for one being computed or replayed here (`StillComputing` if one
        being computed is not done by then). Sent over the peer's stream
        `offer` when it is on another node (then `STREAMED`); otherwise its state is the
        ObjectRef of its copy in the object store (see `share_in_object_store`), or a uint8
        view of the stored one (Ray copies it into the object store then)."""
        deadline = time.monotonic() + wait_s
        # A conversation being replayed here is stored whole in a moment: worth waiting for
        # (for up to half of `wait_s`, leaving time to ship) rather than an older state now.
        coming = self.engine.replay_share(tokens)
        wanted, settle_by = max(min_tokens, coming - 1), time.monotonic() + wait_s / 2
        if wait_s > 0:  # a prefill computing the prefix here saves it where the prompts part
            self.engine.keep_for_peer(tokens, min_tokens, wait_s)
        while True:
            if wanted > min_tokens and time.monotonic() >= settle_by:
                wanted = min_tokens  # not stored in time: the best there is now
            # A first export seals the whole state: keep the event loop free meanwhile.
            found = await asyncio.to_thread(self.engine.export_best, tokens, wanted)
            if found is not None:
                (head, state), _ = found
                if await self.streams.send(offer, head, state):
                    self._count_export(len(head) + len(state))
                    self.stats.streamed_exports += 1
                    return STREAMED
                return self._shipped(found)
            if time.monotonic() >= deadline:
                return self._still_computing(tokens, min_tokens)
            await asyncio.sleep(EXPORT_POLL_S)

    def _still_computing(self, tokens: tuple[int, ...], min_tokens: int) -> StillComputing | None:
        """How far a prefill here is from the state a peer asked for, if one is computing it
        (the peer decides whether to wait on); None if none is."""
        progress = self.engine.prefill_progress(tokens, min_tokens)
        if progress is None:
            return None
        computed, position = progress
        return StillComputing(
            computed, max(0, position - computed) / self.engine.stats.prefill_speed
        )

    def _shipped(self, found: tuple[tuple[bytes, memoryview], object | None]) -> PeerReply:
        """A stored checkpoint's signed blob parts and shared handle in their travelling
        form, counted."""
        (head, state), shared = found
        self._count_export(len(head) + len(state))
        return shipped_blob(head, state, shared)

    def _count_export(self, nbytes: int) -> None:
        self.stats.exports += 1
        self.stats.exported_bytes += nbytes
        metrics.CHECKPOINTS_SHIPPED.inc()
        metrics.SHIPPED_BYTES.inc(nbytes)

    async def _gauge_loop(self) -> None:
        while True:
            load = self.engine.load()
            metrics.QUEUE_LENGTH.set(load.queued)
            metrics.SLOTS_IN_USE.set(load.running)
            metrics.STORE_BYTES.set(self.engine.store_figures().used_bytes)
            # Every period: Ray exports a gauge's value only in the period it was set.
            metrics.DEVICE.set(1, device=self.engine.model.device)
            await asyncio.sleep(GAUGE_PERIOD_S)

    def _index_error(self) -> None:
        self.stats.index_errors += 1
        metrics.INDEX_ERRORS.inc(caller="replica")
