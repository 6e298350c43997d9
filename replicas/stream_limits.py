"""The largest blob a replica takes over the state stream (what its model can hold), and
how many streams its receiver takes at once."""

from __future__ import annotations

from dataclasses import dataclass

from baton_serve.cache_store.checkpoints.state_blob import head_bytes


@dataclass(frozen=True)
class ReceiverBounds:
    """How much a replica's state-stream receiver (`StateReceiver`) takes at once: the
    `routing.stream_*` settings, whose defaults these are."""

    max_pending: int = 64  # connections reading their prefix at once
    max_streams: int = 8  # worker threads receiving blobs under live tickets
    ticket_deadline_s: float = 2.0  # from accept until the whole prefix is in, however it trickles


@dataclass(frozen=True)
class StreamLimits:
    """The largest blob a pulling replica takes over a stream: the head (header and token
    ids) and the state of the longest prefix its model can hold."""

    max_head_bytes: int
    max_state_bytes: int

    @classmethod
    def for_model(cls, n_ctx: int, largest_state_bytes: int) -> StreamLimits:
        """The limits of a model whose sequences hold up to `n_ctx` tokens, in states of up
        to `largest_state_bytes` (what its engine measured at start)."""
        return cls(head_bytes(n_ctx), largest_state_bytes)

    def refusal(self, head_len: int, state_len: int) -> str | None:
        """Why a blob of these lengths cannot be this model's; None when it can be."""
        if head_len > self.max_head_bytes or state_len > self.max_state_bytes:
            return (
                f"a stream announced a {head_len}-byte head and a {state_len}-byte state; this"
                f" model's largest blob has a {self.max_head_bytes}-byte head and a"
                f" {self.max_state_bytes}-byte state"
            )
        return None
