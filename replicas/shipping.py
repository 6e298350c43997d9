"""Deciding whether to pull a prefix state from a peer, and how peers are reached.

Pulling pays a round trip plus the blob's bytes over the wire; recomputing pays prefill
time; a state on the replica's own disk tier pays a read (measured by the disk tier). Both rates are measured as the replica runs (prefill speed from its own engine,
bandwidth from its own pulls), starting from conservative guesses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


class PeerDirectory(Protocol):
    """How a replica asks a peer for its best checkpoint of a prompt."""

    async def fetch(
        self, replica_id: str, tokens: tuple[int, ...], min_tokens: int
    ) -> np.ndarray | None:
        """The peer's signed blob for its longest checkpoint prefixing `tokens`, if longer
        than `min_tokens`; None if it has none. Raises if the peer is unreachable."""
        ...


@dataclass
class ShipPolicy:
    """When a pull beats recomputing, and how long a pull may take at most."""

    min_gain_tokens: int = 64  # below this, recomputing is always cheap enough
    safety: float = 0.5  # pull only if estimated to take < safety × the recompute time
    deadline_s: float = 2.0  # never wait longer than this for a peer
    prefill_tokens_per_s: float = 200.0  # until the engine has measured its own
    bandwidth_bytes_per_s: float = 200e6  # until a pull has been measured
    latency_s: float = 0.01
    smoothing: float = 0.3  # weight of a new bandwidth measurement

    def should_pull(
        self,
        gain_tokens: int,
        nbytes: int,
        measured_prefill: float | None,
        local_restore_s: float = 0.0,
    ) -> bool:
        """True when pulling `nbytes` is clearly faster than computing `gain_tokens` after
        restoring what is local (`local_restore_s`: reading it from this node's disk, which
        the pull makes unnecessary)."""
        if gain_tokens < self.min_gain_tokens:
            return False
        recompute_s = gain_tokens / (measured_prefill or self.prefill_tokens_per_s)
        return self.pull_seconds(nbytes) < self.safety * recompute_s + local_restore_s

    def pull_seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def deadline(self, gain_tokens: int, measured_prefill: float | None) -> float:
        """Wait at most the time recomputing would take, and never past `deadline_s`."""
        recompute_s = gain_tokens / (measured_prefill or self.prefill_tokens_per_s)
        return min(self.deadline_s, recompute_s)

    def record_pull(self, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            measured = nbytes / seconds
            self.bandwidth_bytes_per_s += self.smoothing * (measured - self.bandwidth_bytes_per_s)
