"""A replica's side of pulling prefix states from peers, and how peers are reached.

Whether a pull pays is `cache_store/pull_cost.pull_pays` (the router's and the simulator's
rule too). `ShipPolicy` holds what is the replica's own: the rates it measures as it runs
(prefill speed from its engine, bandwidth from its pulls, starting from `ShipCost`'s
defaults) and how long it waits for a peer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import ray

from baton_serve.cache_store.checkpoints.checkpoint import Checkpoint
from baton_serve.cache_store.pull_cost import (
    ASSUMED_PREFILL_TOKENS_PER_S,
    PULL_DEADLINE_S,
    ShipCost,
    pull_budget_s,
    pull_pays,
)
from baton_serve.replicas.state_stream import STREAMED, StateReceiver, StreamOffer

# A signed state blob as it arrives from a peer: its head (header and token ids) and the
# state as a uint8 array, a read-only view of Ray's object store (the receiver validates
# and restores it there: no copy out of the store).
ShippedBlob = tuple[bytes, np.ndarray]
# What a peer answers: the state itself, or the ObjectRef of a copy it put in the object
# store when the checkpoint was saved (`share_in_object_store`): no copy on the way.
PeerReply = tuple[bytes, np.ndarray | ray.ObjectRef]


@dataclass(frozen=True)
class StillComputing:
    """A peer's answer when the state asked for was not there by the pull's deadline but
    one of its slots is computing it now: `computed` tokens of the prompt done, the state
    expected in `eta_s` at its measured prefill speed."""

    computed: int
    eta_s: float


def shipped_blob(head: bytes, state: memoryview, shared: object | None = None) -> PeerReply:
    """The travelling form of `encode_parts`' output (no copy): the state's `shared`
    ObjectRef where it has one, a uint8 view of it otherwise."""
    if isinstance(shared, ray.ObjectRef):
        return head, shared
    return head, np.frombuffer(state, dtype=np.uint8)


async def received_blob(reply: PeerReply | None) -> ShippedBlob | None:
    """A peer's reply with its state here: a shared one is fetched from the object store
    (a view of it on this node; a copy from the peer's node otherwise)."""
    if isinstance(reply, tuple) and len(reply) == 2 and isinstance(reply[1], ray.ObjectRef):
        return reply[0], await reply[1]
    return reply


def share_in_object_store(checkpoint: Checkpoint) -> None:
    """Put a new checkpoint's state in Ray's object store and keep it there instead: its
    `state` becomes a read-only view of that copy (the private buffer is let go, so it is
    not held twice) and its ObjectRef the `shared` handle its exports hand out. Runs in the
    background after a save, so the copy into the store is not on any pull's path."""
    ref = ray.put(np.frombuffer(checkpoint.state, dtype=np.uint8))
    checkpoint.state = ray.get(ref).data.cast("B")
    checkpoint.shared = ref


async def fetch_offering_stream(
    receiver: StateReceiver,
    ask: Callable[[StreamOffer], Awaitable[PeerReply | StillComputing | str | None]],
) -> ShippedBlob | StillComputing | None:
    """Ask a peer for a blob (`ask`), offering it a stream to `receiver`: a peer on another
    node sends the blob over it and answers `STREAMED`; one on this node answers through the
    object store; one still computing the state past its wait says how far it is."""
    offer, received = receiver.offer()
    try:
        reply = await ask(offer)
        if reply == STREAMED:
            return await asyncio.wrap_future(received)
        if isinstance(reply, StillComputing):
            return reply
        return await received_blob(reply)  # type: ignore[arg-type]
    finally:
        receiver.forget(offer.ticket)


def shipped_nbytes(blob: object) -> int:
    """Bytes of a blob that came from a peer (0 for anything but a ShippedBlob)."""
    if isinstance(blob, tuple) and len(blob) == 2:
        head, state = blob
        if isinstance(head, bytes) and isinstance(state, np.ndarray):
            return len(head) + state.nbytes
    return 0


class PeerDirectory(Protocol):
    """How a replica asks a peer for its best checkpoint of a prompt, or hands one over."""

    async def fetch(
        self, replica_id: str, tokens: tuple[int, ...], min_tokens: int, wait_s: float = 0.0
    ) -> ShippedBlob | StillComputing | None:
        """The peer's signed blob for its longest checkpoint sharing a prefix with `tokens`,
        if it gives more than `min_tokens`, waiting up to `wait_s` for one the peer is
        computing; `StillComputing` if that is not done by then; None if it has none.
        Raises if the peer is unreachable."""
        ...

    async def offer(self, replica_id: str, blob: PeerReply) -> bool:
        """Hand a checkpoint to the peer (this replica is leaving); True if it kept it.
        Raises if the peer is unreachable."""
        ...


@dataclass
class ShipPolicy:
    """A replica's own side of pulling: the agreed rule's costs (`cost`, its bandwidth
    replaced by what this replica's pulls measure), how long a pull may take at most, and
    what its pulls took."""

    cost: ShipCost = ShipCost()
    deadline_s: float = PULL_DEADLINE_S  # never wait longer than this for a peer
    prefill_tokens_per_s: float = ASSUMED_PREFILL_TOKENS_PER_S  # until the engine measures
    smoothing: float = 0.3  # weight of a new bandwidth measurement
    fetch_seconds: float = 0.0  # all measured pulls: asking the peer until its blob is here
    last_pull_started: float = 0.0  # time.perf_counter() when the last measured pull began

    def pays(
        self,
        gain_tokens: int,
        nbytes: int,
        measured_prefill: float | None,
        *,
        wait_s: float = 0.0,
        local_restore_s: float = 0.0,
        busy_s: float = 0.0,
    ) -> bool:
        """`pull_pays` at this replica's measured speeds (its prefill speed, until measured
        `prefill_tokens_per_s`), busy for `busy_s` before it could compute them itself."""
        speed = measured_prefill or self.prefill_tokens_per_s
        return pull_pays(gain_tokens, nbytes, wait_s, speed, self.cost, local_restore_s, busy_s)

    def deadline(
        self,
        gain_tokens: int,
        measured_prefill: float | None,
        *,
        wait_s: float = 0.0,
        busy_s: float = 0.0,
    ) -> float:
        """Wait at most the pull's budget (`pull_budget_s`: the time before this replica could
        start computing them itself, `busy_s`, plus the time recomputing would take, a share
        more for a state the peer is still computing), and never more than `deadline_s` past
        the time the peer's state is expected (`wait_s` from now; a peer still computing it
        then tells how much longer, and the puller decides again)."""
        speed = measured_prefill or self.prefill_tokens_per_s
        budget_s = pull_budget_s(gain_tokens, wait_s, speed, self.cost, busy_s)
        return min(wait_s + self.deadline_s, budget_s)

    def record_pull(self, nbytes: int, seconds: float) -> None:
        """A pull that fetched `nbytes` in `seconds`, just now."""
        self.fetch_seconds += seconds
        self.last_pull_started = time.perf_counter() - seconds
        if seconds > 0 and nbytes > 0:
            bandwidth = self.cost.bandwidth_bytes_per_s
            bandwidth += self.smoothing * (nbytes / seconds - bandwidth)
            self.cost = replace(self.cost, bandwidth_bytes_per_s=bandwidth)
