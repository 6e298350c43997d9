"""Handing a leaving replica's hottest checkpoints to the replicas that stay.

A replica leaves gracefully when Serve scales the deployment down or replaces it (a rolling
update): Serve stops sending it requests and lets those in flight finish, then the replica
offers its most valuable checkpoints to its live peers within a deadline. Each peer checks
an offered blob in full, as it would a pulled one, keeps it and publishes it to the index,
so routing follows the state to its new holder; the next turn of a conversation is served
from cache instead of recomputed. What is not handed off in time is still written to the
disk tier, if there is one, for a restart on the same node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from baton_serve.cache_store.checkpoints.checkpoint import Checkpoint
from baton_serve.replicas.shipping import PeerDirectory, PeerReply

logger = logging.getLogger("baton.replica")
# One offer's longest wait: a peer stopping too, or one the router does not list yet, never
# answers, and what it was offered goes to the others.
OFFER_TIMEOUT_S = 3.0
REQUEUE_POLL_S = 0.05  # a peer with nothing left to offer waits for offers that may fail


@dataclass
class HandoffReport:
    """What a hand-off achieved."""

    peers: int = 0
    offered: int = 0
    accepted: int = 0
    accepted_bytes: int = 0
    left: int = 0  # worth handing off, but not sent: out of time or of room at the peers
    seconds: float = 0.0


def handoff_order(checkpoints: Sequence[Checkpoint], *, nested: bool) -> list[Checkpoint]:
    """The checkpoints worth handing off, most valuable first.

    Value is tokens saved per byte, weighted by recency (`checkpoints` in the store's order,
    least recently used first). With `nested` (attention models: a state serves any prefix
    of its tokens) a checkpoint whose tokens begin a longer one's is left out: the longer
    one serves it."""
    n = len(checkpoints)
    by_value = sorted(
        range(n),
        key=lambda i: (i + 1) / n * checkpoints[i].n_tokens / checkpoints[i].nbytes,
        reverse=True,
    )
    chosen: list[Checkpoint] = []
    for checkpoint in (checkpoints[i] for i in by_value):
        if nested and any(_begins(checkpoint, other) for other in checkpoints):
            continue
        chosen.append(checkpoint)
    return chosen


def _begins(short: Checkpoint, long: Checkpoint) -> bool:
    """True when `short`'s tokens are a strict beginning of `long`'s."""
    n = short.n_tokens
    return long.n_tokens > n and bool((long.tokens[:n] == short.tokens).all())


async def hand_off(
    order: Sequence[Checkpoint],
    export: Callable[[Checkpoint], PeerReply | None],
    peers: PeerDirectory,
    peer_ids: Sequence[str],
    *,
    deadline_s: float,
    bytes_per_peer: int,
) -> HandoffReport:
    """Offer `order`'s checkpoints (most valuable first) to `peer_ids`, at most
    `bytes_per_peer` to each (so a peer's own hot states are not all pushed out), one blob
    at a time per peer and the peers in parallel, until `deadline_s` has passed; a peer that
    refuses, fails or does not answer within `OFFER_TIMEOUT_S` gets no more. `export`
    signs a checkpoint (it may hash it: it runs in a thread). Never raises."""
    started = time.monotonic()
    report = HandoffReport(peers=len(peer_ids))
    queue = deque(order)

    offering = [0]  # offers under way: one that fails puts its checkpoint back in `queue`

    async def offer_to(peer: str) -> None:
        room = bytes_per_peer
        while queue or offering[0]:
            if not queue:
                await asyncio.sleep(REQUEUE_POLL_S)
                continue
            if queue[0].nbytes > room:
                return
            checkpoint = queue.popleft()
            offering[0] += 1
            try:
                accepted = await offer(peer, checkpoint)
            finally:
                offering[0] -= 1
            if not accepted:  # leaving too, or not reachable (yet): the others may take it
                queue.appendleft(checkpoint)
                return
            room -= checkpoint.nbytes

    async def offer(peer: str, checkpoint: Checkpoint) -> bool:
        blob = await asyncio.to_thread(export, checkpoint)
        if blob is None:  # evicted meanwhile: nothing to hand over, nothing to retry
            return True
        report.offered += 1
        try:
            accepted = await asyncio.wait_for(peers.offer(peer, blob), OFFER_TIMEOUT_S)
        except Exception as exc:
            logger.info("hand-off to %s failed (%s)", peer, type(exc).__name__)
            return False
        if accepted:
            report.accepted += 1
            report.accepted_bytes += checkpoint.nbytes
        return accepted

    if peer_ids and queue:
        offers = [asyncio.ensure_future(offer_to(peer)) for peer in peer_ids]
        _, late = await asyncio.wait(offers, timeout=deadline_s)
        for offer in late:
            offer.cancel()
    report.left = len(queue)
    report.seconds = time.monotonic() - started
    return report
