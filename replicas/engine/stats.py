"""What an engine is doing and has done: its load (for routing) and counters since start."""

from __future__ import annotations

from dataclasses import dataclass

from baton_serve.cache_store.pull_cost import ASSUMED_PREFILL_TOKENS_PER_S


@dataclass(frozen=True)
class EngineLoad:
    """What the engine is doing right now (for routing)."""

    queued: int  # submitted, waiting for a slot
    running: int  # in a slot (prefill, decode or replay)
    free_slots: int
    backlog_tokens: int = 0  # prompt tokens waiting to be computed, about


@dataclass
class EngineStats:
    """Counters since start (written by the engine loop, readable from any thread)."""

    requests: int = 0
    decode_steps: int = 0
    # Steps of decode rows alone (no prompt piece): their llama_decode calls, logits read back
    decode_only_steps: int = 0
    decode_call_seconds: float = 0.0
    sample_seconds: float = 0.0  # streams' next tokens drawn from their logits, on the host
    prefill_steps: int = 0
    prompt_tokens_computed: int = 0
    replayed_tokens: int = 0
    images_read: int = 0  # images and audio clips decoded and tokenised by the projector
    images_encoded: int = 0  # projector runs (images and clips): a cached prefix needs none
    encode_seconds: float = 0.0
    checkpoints_saved: int = 0
    checkpoints_restored: int = 0
    checkpoints_imported: int = 0
    prefix_waits: int = 0  # requests that waited for a prefix another slot was computing
    request_faults: int = 0  # requests ended by a fault in their own work (`step_guard`)
    prefill_seconds: float = 0.0
    blobs_exported: int = 0
    exported_bytes: int = 0  # signed blobs handed to peers (head and state)
    blob_export_seconds: float = 0.0  # signing stored states for peers (any thread)
    blob_validate_seconds: float = 0.0  # checking peers' blobs before they are stored
    restore_seconds: float = 0.0  # llama_state_seq_set_data
    restored_bytes: int = 0
    last_restore_done: float = 0.0  # time.perf_counter() when the last restore finished
    save_seconds: float = 0.0  # llama_state_seq_get_data, into a new buffer
    saved_bytes: int = 0
    # Partial states (no attention KV): anchors kept in slots, and rewinds to them.
    anchors_taken: int = 0
    anchor_seconds: float = 0.0
    anchor_bytes: int = 0
    rewinds: int = 0
    rewind_seconds: float = 0.0
    rewound_bytes: int = 0
    written_back: int = 0  # finished conversations' full states stored while idle

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Measured prefill speed (prompt and replay tokens per second), once known."""
        tokens = self.prompt_tokens_computed + self.replayed_tokens
        return tokens / self.prefill_seconds if self.prefill_seconds > 0 and tokens >= 64 else None

    @property
    def prefill_speed(self) -> float:
        """Measured prefill speed, or `ASSUMED_PREFILL_TOKENS_PER_S` until then."""
        return self.prefill_tokens_per_s or ASSUMED_PREFILL_TOKENS_PER_S

    @property
    def save_bytes_per_s(self) -> float:
        """Measured speed of saving a sequence state, or a cautious 1 GB/s until then."""
        return self.saved_bytes / self.save_seconds if self.save_seconds > 0 else 1e9
