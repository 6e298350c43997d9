"""Getting a prompt's prefix from a peer before the request runs.

Baton's router decides where a request goes and how it gets its prefix, and the decision
travels with the request (`ReplicaRequest.plan`): this replica holds it (cached), is
computing it (in flight), pulls it from a named donor, or computes it. `PrefixPuller`
executes that plan with no index lookup. It decides again only on evidence the router
could not have — the state the plan counts on is not here, or the donor failed, missed or
sent a bad blob — each counted (`baton_replans`, `ReplicaStats.replans`); then, and for a
request without a plan (another router, a direct call), it looks the gateway's hash chain
up in the index and pulls when `pull_pays` (the router's and the simulator's rule). A
pull never fails a request: a dead or slow peer or a bad blob only costs a recompute. A
peer still computing the state at the deadline is waited for on while that still pays.

A pull under way here counts as a prefix in flight here (the router records it so): a
request planned to join it (in flight), or to pull as much of the same prompt, waits for
that pull instead of computing the prefix or fetching it a second time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from baton_serve.cache_store.checkpoints.state_blob import BlobError
from baton_serve.cache_store.index.index import CheckpointIndex, IndexUnavailable
from baton_serve.cache_store.telemetry import metrics, tracing
from baton_serve.cache_store.telemetry.logs import request_fields
from baton_serve.cache_store.wire.protocol import EngineError, ReplicaRequest
from baton_serve.cache_store.wire.route_plan import CACHED, IN_FLIGHT, PULL
from baton_serve.replicas.engine.checkpoint_policy import MIN_PIECE
from baton_serve.replicas.engine.engine_face import EngineFace
from baton_serve.replicas.off_loop import OffLoop, lookup_chain
from baton_serve.replicas.plan_receipt import PlanReceipt
from baton_serve.replicas.pull_choice import HELD_HERE, best_donor, pull_gain, stale_plan
from baton_serve.replicas.request_telemetry import RequestTelemetry
from baton_serve.replicas.shipping import (
    PeerDirectory,
    ShippedBlob,
    ShipPolicy,
    StillComputing,
    shipped_nbytes,
)

logger = logging.getLogger("baton.replica")

JOIN_GRACE_S = 0.5  # past a joined pull's deadline: its blob may still be being stored
REPLY_MARGIN_S = 0.25  # a peer's answer at its wait's end must reach the puller in time


@dataclass
class ReplicaStats:
    """What a replica's pulls, exports and hand-overs came to."""

    pulls: int = 0
    pulled_bytes: int = 0
    pulls_skipped: int = 0  # a peer had more, but recomputing was estimated cheaper
    pull_misses: int = 0  # the peer had nothing better after all
    pull_failures: int = 0  # peer dead, unreachable or past the deadline
    pull_waits_extended: int = 0  # a peer still computing the state was waited for longer
    pulls_rejected: int = 0  # the blob failed validation
    exports: int = 0
    exported_bytes: int = 0
    streamed_exports: int = 0  # of `exports`, sent over the pulling peer's own stream
    adopted: int = 0  # checkpoints a leaving peer handed over
    adopted_bytes: int = 0
    index_errors: int = 0
    index_lookups: int = 0  # before requests: those without a plan, and re-decisions
    replans: dict[str, int] = field(default_factory=dict)  # router plans decided again, by reason
    plans_missing: dict[str, int] = field(default_factory=dict)  # by reason (`plan_receipt`)


@dataclass
class _PullUnderway:
    """A pull this replica is making: the prompt prefix it brings, and until when."""

    tokens: tuple[int, ...]
    deadline: float  # time.perf_counter()
    done: asyncio.Event = field(default_factory=asyncio.Event)
    start_at: float = 0.0  # Unix time this replica could compute it itself (the router's)

    def busy_s(self) -> float:
        """Seconds before this replica could start computing the prefix itself."""
        return max(0.0, self.start_at - time.time())


class PrefixPuller:
    """A replica's pulls: the router's plan executed, or its own decision without one."""

    def __init__(
        self,
        replica_id: str,
        engine: EngineFace,
        index: CheckpointIndex | None,
        peers: PeerDirectory | None,
        policy: ShipPolicy,
        stats: ReplicaStats,
        off_loop: OffLoop,
        *,
        expects_plans: bool = False,
    ) -> None:
        self.replica_id = replica_id
        self.receipt = PlanReceipt(replica_id, expected=expects_plans, counts=stats.plans_missing)
        self.engine = engine
        self.index = index
        self.peers = peers
        self.policy = policy
        self.stats = stats
        self.off_loop = off_loop
        self.on_index_error: Callable[[], None] = lambda: None
        self._underway: list[_PullUnderway] = []

    async def prepare(self, request: ReplicaRequest, telemetry: RequestTelemetry) -> None:
        """Get the prompt's prefix as the router planned (`request.plan`), with no index
        lookup: pull it from the planned donor, or reuse what is here. Decide here (by
        `pull_pays`, the router's rule) only for a request without a plan, or on evidence
        the router lacked — the state the plan counts on is not here, the donor failed —
        each counted (`baton_replans`). Never raises; never waits past a deadline."""
        plan = self.receipt.plan_for_here(request)  # None if not this replica's (counted)
        tokens = request.generation.prompt.tokens
        if plan is not None and plan.kind in (IN_FLIGHT, PULL):
            needed = plan.reused_tokens if plan.kind == IN_FLIGHT else plan.donor_tokens
            if await self._join_pull_underway(tokens, needed, telemetry):
                return
        if self.peers is None or (plan is not None and plan.kind not in (CACHED, PULL)):
            return  # computing it, or joining the prefix this engine computes now
        usable = len(tokens) - MIN_PIECE  # the engine always computes the last piece itself
        least = self.policy.cost.min_gain_tokens
        reason = None
        if plan is not None and plan.kind == PULL and plan.donor_id:
            # announced before the lookup below, so a request planned a moment later to
            # join this pull finds it
            wait_s = max(0.0, plan.ready_at - time.time())
            until = time.perf_counter() + wait_s + self.policy.deadline_s
            prefix = tokens[: min(plan.donor_tokens, usable)]
            with self._pull_underway(prefix, until, plan.start_at) as underway:
                local, restore_s = await self.off_loop.run(
                    self.engine.local_reuse, tokens, request.prefix_hashes
                )
                reason = stale_plan(plan, local, usable, least)
                if reason is None:
                    gain = pull_gain(plan.donor_tokens, usable, local)
                    outcome = await self._pull_from(
                        plan.donor_id, tokens, local, gain, plan.ready_at, telemetry, underway
                    )
                    reason = None if outcome == "pulled" else f"donor_{outcome}"
        else:
            local, restore_s = await self.off_loop.run(
                self.engine.local_reuse, tokens, request.prefix_hashes
            )
            if plan is None:
                await self._decide(request, local, restore_s, telemetry)
                return
            reason = stale_plan(plan, local, usable, least) if plan.kind == CACHED else None
        if reason is None:
            return
        self.stats.replans[reason] = self.stats.replans.get(reason, 0) + 1
        metrics.REPLANS.inc(reason=reason)
        telemetry.span.set_attribute("baton.replan", reason)
        if reason != HELD_HERE:
            await self._decide(request, local, restore_s, telemetry, not_from=plan.donor_id)

    async def _decide(
        self,
        request: ReplicaRequest,
        local: int,
        restore_s: float,
        telemetry: RequestTelemetry,
        not_from: str | None = None,
    ) -> None:
        """Pull a longer prefix from a peer (but `not_from`) when the index says one has it
        and `pull_pays`, given `local` tokens here (`restore_s` to read them from disk)."""
        tokens = request.generation.prompt.tokens
        usable = len(tokens) - MIN_PIECE
        if self.index is None or usable - local < self.policy.cost.min_gain_tokens:
            return  # no peer could hold enough more: no lookup
        chain = await self.off_loop.run(lookup_chain, self.engine, tokens, request.prefix_hashes)
        self.stats.index_lookups += 1
        started = time.perf_counter()
        try:
            with tracing.span("index.lookup", parent=telemetry.context):
                matches = await self.index.lookup(chain)
        except IndexUnavailable:
            self.on_index_error()
            return
        finally:
            metrics.INDEX_LOOKUP.observe(time.perf_counter() - started, caller="replica")
        best = best_donor(matches, exclude=(self.replica_id, not_from))
        if best is None:
            return
        gain = pull_gain(best.n_tokens, usable, local)
        wait_s = max(0.0, best.ready_at - time.time()) if best.in_flight else 0.0
        prefill_speed = self.engine.stats.prefill_tokens_per_s
        if self.policy.pays(
            gain, best.nbytes, prefill_speed, wait_s=wait_s, local_restore_s=restore_s
        ):
            with self._pull_underway(tokens[: local + gain], 0.0) as underway:
                await self._pull_from(
                    best.replica_id, tokens, local, gain, best.ready_at, telemetry, underway
                )
        elif gain > 0:
            self.stats.pulls_skipped += 1
            metrics.PULLS.inc(outcome="skipped")

    async def _pull_from(
        self,
        peer: str,
        tokens: tuple[int, ...],
        local: int,
        gain: int,
        ready_at: float,
        telemetry: RequestTelemetry,
        underway: _PullUnderway,
    ) -> str:
        """Pull `gain` more tokens than `local` from `peer`, whose state is expected at Unix
        time `ready_at` (0: held now; one still being computed is waited for whole, not
        taken in part on the way); the outcome (see `_pull`). `underway`: the pull as
        announced to other requests here, given its prefix and deadline now."""
        wait_s = max(0.0, ready_at - time.time())
        speed = self.engine.stats.prefill_tokens_per_s
        deadline = self.policy.deadline(gain, speed, wait_s=wait_s, busy_s=underway.busy_s())
        attributes = {
            "baton.peer": peer,
            "baton.pull.gain_tokens": gain,
            "baton.pull.wait_s": wait_s,
        }
        floor = local + gain - 1 if ready_at > 0 else local
        underway.tokens = tokens[: local + gain]
        underway.deadline = time.perf_counter() + deadline
        with tracing.span("pull", parent=telemetry.context, attributes=attributes) as span:
            outcome = await self._pull(peer, tokens, local, floor, underway, span, telemetry)
            span.set_attribute("baton.pull.outcome", outcome)
        metrics.PULLS.inc(outcome=outcome)
        return outcome

    async def _fetch(
        self,
        peer: str,
        tokens: tuple[int, ...],
        local: int,
        floor: int,
        underway: _PullUnderway,
        span: Span,
    ) -> ShippedBlob | None:
        """The peer's blob giving more than `floor` tokens, or None. A peer still computing
        it at the deadline says how far it is: the wait so far is spent, so the pull waits
        on (to a new deadline, `underway`'s too) while the rest of the wait still pays
        against computing those tokens here now, and the peer's prefill keeps moving."""
        assert self.peers is not None
        gain, computed = len(underway.tokens) - local, -1
        while True:
            wait_s = max(0.0, underway.deadline - time.perf_counter())
            # The peer stops waiting a little early, so its answer is here in time.
            reply = await asyncio.wait_for(
                self.peers.fetch(
                    peer, tokens, floor, wait_s=wait_s - min(REPLY_MARGIN_S, wait_s / 4)
                ),
                wait_s,
            )
            if not isinstance(reply, StillComputing):
                return reply
            speed = self.engine.stats.prefill_tokens_per_s
            nbytes = self.engine.state_bytes(floor + 1)
            busy_s = underway.busy_s()
            if reply.computed <= computed or not self.policy.pays(
                gain, nbytes, speed, wait_s=reply.eta_s, busy_s=busy_s
            ):
                return None
            computed = reply.computed
            deadline = self.policy.deadline(gain, speed, wait_s=reply.eta_s, busy_s=busy_s)
            underway.deadline = time.perf_counter() + deadline
            self.stats.pull_waits_extended += 1
            span.add_event("baton.pull.wait_extended", {"baton.pull.eta_s": reply.eta_s})

    @contextlib.contextmanager
    def _pull_underway(
        self, tokens: tuple[int, ...], deadline: float, start_at: float = 0.0
    ) -> Iterator[_PullUnderway]:
        """A pull of `tokens` (a prompt prefix) under way here until the block ends, for
        other requests to join (`_join_pull_underway`); `start_at` is the plan's."""
        underway = _PullUnderway(tokens, deadline, start_at=start_at)
        self._underway.append(underway)
        try:
            yield underway
        finally:
            self._underway.remove(underway)
            underway.done.set()

    async def _join_pull_underway(
        self, tokens: tuple[int, ...], needed: int, telemetry: RequestTelemetry
    ) -> bool:
        """Wait (until its deadline) for the deepest pull under way here of a prefix of
        `tokens` that brings at least `needed` of them (the plan's) or all it can use; True
        if there was one. Whether it succeeded or not, the engine then finds what is here."""
        usable = len(tokens) - MIN_PIECE
        enough = max(min(needed, usable), self.policy.cost.min_gain_tokens)
        joined = max(
            (
                u
                for u in self._underway
                if len(u.tokens) >= enough and tokens[: len(u.tokens)] == u.tokens
            ),
            key=lambda u: len(u.tokens),
            default=None,
        )
        if joined is None:
            return False
        telemetry.span.set_attribute("baton.pull.joined_tokens", len(joined.tokens))
        while not joined.done.is_set():  # its deadline may move on (`_fetch`)
            remaining_s = joined.deadline + JOIN_GRACE_S - time.perf_counter()
            if remaining_s <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(joined.done.wait(), remaining_s)
        return True

    async def _pull(
        self,
        peer: str,
        tokens: tuple[int, ...],
        local: int,
        floor: int,
        underway: _PullUnderway,
        span: Span,
        telemetry: RequestTelemetry,
    ) -> str:
        """Fetch a state giving more than `floor` (≥ `local`, what is here) tokens of `tokens`
        from the peer (waiting for it until `underway.deadline`), check it and store it; the
        outcome: pulled, miss, failed or rejected."""
        started = time.perf_counter()
        try:
            blob = await self._fetch(peer, tokens, local, floor, underway, span)
        except Exception as exc:  # a dead, slow or unreachable peer only costs a recompute
            self.stats.pull_failures += 1
            logger.info(
                "pull from %s failed (%s)",
                peer,
                type(exc).__name__,
                extra=request_fields(telemetry.request_id),
            )
            return "failed"
        if blob is None:
            self.stats.pull_misses += 1
            return "miss"
        fetched_s = time.perf_counter() - started
        nbytes = shipped_nbytes(blob)
        if floor <= local:  # nothing was waited for: the time is the transfer's
            self.policy.record_pull(nbytes, fetched_s)
        span.set_attributes({"baton.pull.bytes": nbytes, "baton.pull.fetch_ms": 1e3 * fetched_s})
        try:
            await asyncio.to_thread(self.engine.import_checkpoint, blob)
        except (BlobError, EngineError) as exc:
            self.stats.pulls_rejected += 1
            reason = exc.reason if isinstance(exc, BlobError) else "over_budget"
            span.set_attribute("baton.pull.reject_reason", reason)
            logger.warning(
                "rejected a state blob from %s: %s",
                peer,
                exc,
                extra=request_fields(telemetry.request_id),
            )
            return "rejected"
        self.stats.pulls += 1
        self.stats.pulled_bytes += nbytes
        metrics.PULLED_BYTES.inc(nbytes)
        return "pulled"
