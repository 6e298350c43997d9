"""Prefix reuse, exact to the bit: which cached state serves a prompt, and the states kept.

- Attention-only models keep each idle slot's KV and cut it back to the matched prefix; a
  slot's state is saved to the checkpoint store when the slot is given to another prompt,
  and a stored state serves any prompt sharing its beginning (restored, then cut back).
- Hybrid and recurrent models cannot cut their recurrent state back, so full sequence
  states are saved at exact positions (`checkpoint_policy`) and the longest one that
  prefixes a new prompt is restored.
- Signed state blobs (`checkpoint_codec`) move checkpoints between engines and to disk;
  each is validated completely before llama.cpp sees it.

Everything here runs on the engine thread, except `local_reuse` (a read-only estimate).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from typing import Protocol

from baton_serve.cache_store.checkpoint_store import Checkpoint, CheckpointStore, Stored
from baton_serve.cache_store.disk_tier import DiskEntry, DiskTier
from baton_serve.cache_store.prefix_hash import PrefixHasher, common_prefix_length
from baton_serve.cache_store.state_blob import BlobError, BlobParts, Buffer
from baton_serve.replicas.engine.checkpoint_codec import CheckpointCodec, frozen
from baton_serve.replicas.engine.checkpoint_policy import (
    MIN_PIECE,
    prefill_checkpoints,
    worth_saving,
)
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_context import LlamaContext, StateRestoreError
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.prompt import Prompt
from baton_serve.replicas.engine.protocol import EngineError
from baton_serve.replicas.engine.slots import Phase, Running, Slot
from baton_serve.replicas.engine.stats import EngineStats
from baton_serve.replicas.telemetry import metrics

logger = logging.getLogger("baton.engine")


class CheckpointListener(Protocol):
    """Told about the local store's contents; called on the engine thread, must be quick."""

    def checkpoint_added(self, checkpoint: Checkpoint) -> None: ...

    def checkpoint_used(self, checkpoint: Checkpoint) -> None: ...

    def checkpoint_removed(self, checkpoint: Checkpoint) -> None: ...


class PrefixCache:
    """One engine's cached prefixes: its slots' live states and its checkpoint store."""

    def __init__(
        self,
        model: LlamaModel,
        context: LlamaContext,
        config: EngineConfig,
        stats: EngineStats,
        *,
        hmac_key: bytes,
    ) -> None:
        self.model = model
        self.context = context
        self.config = config
        self.stats = stats
        self.kind = model.kind
        self.fingerprint = model.fingerprint
        self._hmac_key = hmac_key
        self.hasher = PrefixHasher(self.fingerprint, config.block_tokens)
        self.state_size = self._measure_state_size()  # before any blob is read
        self.listener: CheckpointListener | None = None
        self.codec = CheckpointCodec(
            self.fingerprint, self.hasher, hmac_key, self.state_size, stats
        )
        self._waits: dict[Hashable, tuple[Running, int]] = {}  # queued request -> its wait
        self.store = CheckpointStore(
            config.store_budget_bytes, on_evict=self._evicted, disk=self._disk_tier()
        )

    def export_checkpoint(self, prefix_hash: bytes) -> tuple[bytes, memoryview] | None:
        """A signed state blob of a stored checkpoint as its two parts, `(head, state)`,
        the state not copied; None if it is not here.

        Runs on any thread. A checkpoint's payload is hashed once: in the background after
        it was saved, or by its first export if that has not happened yet.
        """
        checkpoint = self.store.get(prefix_hash)
        return None if checkpoint is None else self.codec.parts(checkpoint)

    def _disk_tier(self) -> DiskTier | None:
        """The disk tier of `checkpoint_dir`: the same signed blobs, checked the same way."""
        if self.config.checkpoint_dir is None:
            return None
        disk = DiskTier(
            self.config.checkpoint_dir,
            self.fingerprint,
            self.config.disk_budget_bytes,
            encode=self.codec.blob,
            decode=self.codec.checked,
            decode_head=self.codec.checked_head,
        )

        def beats_recompute(entry: DiskEntry) -> bool:
            speed = self.stats.prefill_tokens_per_s
            return speed is None or disk.restore_seconds(entry.file_bytes) < entry.n_tokens / speed

        disk.should_load = beats_recompute
        return disk

    def close(self) -> None:
        """Keep what RAM holds on disk for a restart (with a disk tier); after the engine loop."""
        self.store.close()

    def import_checkpoint(self, blob: Buffer | BlobParts) -> Checkpoint:
        """Validate a state blob (contiguous, or its two parts) fully and keep it in the
        local store.

        Raises `BlobError` for anything that is not an authentic, intact blob of this
        model: llama.cpp only ever sees a blob that passed every check. A read-only blob
        (what Ray's object store hands out) is kept where it is, not copied; a writable
        one is copied first, so that nobody can change it after it was checked.
        """
        try:
            checkpoint = self.codec.checked(frozen(blob))
        except BlobError as exc:
            metrics.BLOBS_REJECTED.inc(reason=exc.reason)
            raise
        if not self.store.put(checkpoint):
            metrics.BLOBS_REJECTED.inc(reason="over_budget")
            raise EngineError(
                f"a {checkpoint.nbytes}-byte checkpoint exceeds the store budget "
                f"({self.store.budget_bytes} bytes)"
            )
        self.stats.checkpoints_imported += 1
        self._added(checkpoint)
        return checkpoint

    def export_best(
        self, tokens: tuple[int, ...] | list[int], min_tokens: int = 0
    ) -> tuple[tuple[bytes, memoryview], object | None] | None:
        """The signed blob parts of the stored checkpoint that gives the longest prefix of
        `tokens`, if that is more than `min_tokens` (what a peer asks for before pulling):
        one that prefixes them, or for attention models any that shares their beginning (the
        peer cuts it back); with its `shared` handle (None if it has none)."""
        checkpoint, reused = self._stored_prefix(tuple(tokens), len(tokens), touch=False)
        if checkpoint is None or reused <= min_tokens:
            return None
        parts = self.export_checkpoint(checkpoint.prefix_hash)
        return None if parts is None else (parts, checkpoint.shared)

    def state_bytes(self, n_tokens: int) -> int:
        """The size of an `n_tokens`-token state (0 where it is not linear: sliding windows)."""
        if self.state_size is None:
            return 0
        fixed, per_token = self.state_size
        return fixed + per_token * n_tokens

    def local_reuse(self, tokens: tuple[int, ...], slots: list[Slot]) -> tuple[int, float]:
        """About how many tokens of `tokens` this engine could reuse right now, and the
        estimated seconds to read that state from disk first (0 in RAM or in a slot).

        An estimate (idle slots are read without stopping the engine loop) for deciding
        whether pulling a longer prefix from a peer is worth it.
        """
        limit = max(0, len(tokens) - MIN_PIECE)
        checkpoint, stored = self._stored_prefix(tokens, limit, touch=False)
        live = max(
            (self._live_reuse(s, tokens, limit) for s in slots if s.running is None),
            default=0,
        )
        if live >= stored:
            return live, 0.0
        on_disk = isinstance(checkpoint, DiskEntry) and self.store.disk is not None
        restore_s = self.store.disk.restore_seconds(checkpoint.file_bytes) if on_disk else 0.0
        return stored, restore_s

    def _measure_state_size(self) -> tuple[int, int] | None:
        """The exact size of a state, so a signed but malformed blob never reaches llama.cpp.

        Sliding-window caches keep at most a window of tokens, so their size is not linear:
        for those models only the blob's own checks apply.
        """
        if self.model.sliding_window:
            return None
        return self.context.state_size_line(0, self.model.any_token)

    def replay_pending_for(self, prompt: tuple[int, ...], running: list[Running]) -> bool:
        """True while one of `running` replays the conversation `prompt` continues.

        The next turn of a chat often arrives while the previous reply is still being
        replayed into the cache; waiting those few steps beats recomputing the reply.
        """
        limit = len(prompt) - MIN_PIECE
        for run in running:
            if run.phase is Phase.REPLAY:
                common = common_prefix_length(run.feed, prompt, limit)
                if common > 0 and common >= min(limit, len(run.prompt) - MIN_PIECE):
                    return True
        return False

    def checkpoints_for(self, prompt: Prompt, cached: int) -> list[int]:
        """Positions of `prompt` after which its state is saved while it is computed.

        Hybrid and recurrent models: `checkpoint_policy`. Attention models keep the live KV
        of their own conversation, so only a shared system prompt is saved on its own, the
        moment it is computed: other sessions here and peers can use it before this
        request even starts decoding.
        """
        if not self.config.prefix_cache:
            return []
        if self.kind.needs_checkpoints:
            return prefill_checkpoints(
                prompt,
                cached=cached,
                interval=self.config.checkpoint_interval,
                max_interval=self.config.max_interval_checkpoints,
            )
        end = prompt.system_end
        if end is None or end < self.hasher.block_tokens or not cached < end < len(prompt):
            return []
        return [end]

    def should_wait(
        self, key: Hashable, prompt: tuple[int, ...], running: list[Running], slots: list[Slot]
    ) -> bool:
        """True while another slot computes what the queued request `key` would reuse: the
        reply of the conversation it continues (a replay), or a long prefix of its prompt.
        False releases it: `place` then finds whatever there is."""
        if not self.config.prefix_cache:
            return False
        if self.replay_pending_for(prompt, running):
            return True
        if (waits := self._waits.get(key)) is not None:
            run, position = waits
            if run.slot.running is run and len(run.slot.tokens) < position:
                return True
            del self._waits[key]
            return False
        share = self._in_flight_share(prompt, running, slots)
        if share is None:
            return False
        self._waits[key] = share
        self.stats.prefix_waits += 1
        return True

    def stop_waiting(self, key: Hashable) -> None:
        """The queued request `key` is gone (cancelled)."""
        self._waits.pop(key, None)

    def _in_flight_share(
        self, prompt: tuple[int, ...], running: list[Running], slots: list[Slot]
    ) -> tuple[Running, int] | None:
        """A prefill in progress that will compute a long prefix of `prompt` this engine
        does not hold yet: that run and the shared length, with a checkpoint added there.

        That run is computing the prefix already, so a request waiting for its
        checkpoint waits no longer than computing it would take, and it is computed once.
        """
        limit = len(prompt) - MIN_PIECE
        best: tuple[Running, int] | None = None
        for run in running:
            if run.phase is not Phase.PREFILL:
                continue
            shared = common_prefix_length(run.feed, prompt, limit)
            if shared >= self.hasher.block_tokens and (best is None or shared > best[1]):
                best = (run, shared)
        if best is None or self.local_reuse(prompt, slots)[0] >= best[1]:
            return None
        run, shared = best
        return best if run.checkpoint_at(shared, self.config.prefill_chunk) else None

    def place(self, prompt: tuple[int, ...], free: list[Slot]) -> tuple[Slot, int]:
        """Pick a slot for `prompt` and load the longest reusable prefix into it."""
        if not self.config.prefix_cache:
            slot = self._victim(free)
            self._evict(slot)
            return slot, 0
        limit = max(0, len(prompt) - MIN_PIECE)  # the rest is computed as one exact piece
        live_slot, live = max(
            ((s, self._live_reuse(s, prompt, limit)) for s in free), key=lambda p: p[1]
        )
        checkpoint, stored = self._stored_prefix(prompt, limit)
        if checkpoint is not None and stored > live:
            slot = self._victim(free)
            self._evict(slot)
            if self._restore(slot, checkpoint):
                self.stats.checkpoints_restored += 1
                metrics.CHECKPOINTS_RESTORED.inc()
                if self.listener is not None:
                    self.listener.checkpoint_used(checkpoint)
                if stored < len(slot.tokens) and not self._cut(slot, stored):
                    return slot, 0  # attention KV: keep only the shared prefix, if it can
                return slot, stored
            return slot, 0
        if live:
            if len(live_slot.tokens) > live and not self._cut(live_slot, live):
                return live_slot, 0
            return live_slot, live
        slot = self._victim(free)
        self._evict(slot)
        return slot, 0

    def _stored_prefix(
        self, prompt: tuple[int, ...], limit: int, *, touch: bool = True
    ) -> tuple[Stored | None, int]:
        """The stored checkpoint to restore for `prompt`, and how many tokens it gives.

        Hybrid and recurrent states only serve prompts they prefix exactly; an attention
        state also serves any prompt sharing its beginning (its KV is cut back after).
        """
        if self.kind.needs_checkpoints:
            checkpoint = self.store.longest_match(self.hasher, prompt, limit, touch=touch)
            return checkpoint, checkpoint.n_tokens if checkpoint is not None else 0
        return self.store.longest_shared_prefix(prompt, limit, touch=touch)

    def _live_reuse(self, slot: Slot, prompt: tuple[int, ...], limit: int) -> int:
        """Tokens of `prompt` this idle slot already holds and can keep."""
        common = common_prefix_length(slot.tokens, prompt, limit)
        if self.kind.needs_checkpoints and common < len(slot.tokens):
            return 0  # a recurrent state cannot be cut back
        return common

    def _cut(self, slot: Slot, n_tokens: int) -> bool:
        """Keep the first `n_tokens` of an attention slot. Where the memory cannot give
        them back (a sliding window has dropped some), empty the slot and return False."""
        if self.context.truncate(slot.seq_id, n_tokens):
            del slot.tokens[n_tokens:]
            return True
        self.context.clear(slot.seq_id)
        slot.tokens = []
        return False

    def keep_slots(self, slots: list[Slot]) -> None:
        """Save what idle slots hold to the store (attention models: a slot's KV is saved
        only when the slot is given away). Only once the engine loop has ended."""
        for slot in sorted(slots, key=lambda s: s.last_used):  # the most recent stored last
            if slot.running is None:
                self._keep(slot)

    def _victim(self, free: list[Slot]) -> Slot:
        """The free slot whose contents are least worth keeping: empty first, then LRU."""
        return min(free, key=lambda s: (bool(s.tokens), s.last_used))

    def _evict(self, slot: Slot) -> None:
        """Empty a slot; an attention model's KV is saved to the store first where worth it."""
        self._keep(slot)
        self.context.clear(slot.seq_id)
        slot.tokens = []

    def _keep(self, slot: Slot) -> None:
        """Save an attention slot's KV before it is given away, where that is worth it
        (hybrid states are checkpointed as they are computed)."""
        if not slot.tokens or not self.config.prefix_cache or self.kind.needs_checkpoints:
            return
        stored = self.store.longest_match(self.hasher, slot.tokens, len(slot.tokens), touch=False)
        if stored is None or worth_saving(
            len(slot.tokens) - stored.n_tokens,
            self.state_bytes(len(slot.tokens)),
            self.stats.prefill_speed,
            self.stats.save_bytes_per_s,
        ):
            self.save_checkpoint(slot)

    def _restore(self, slot: Slot, checkpoint: Checkpoint) -> bool:
        started = time.perf_counter()
        try:
            self.context.restore_state(slot.seq_id, checkpoint.state)
            self.stats.last_restore_done = time.perf_counter()
            self.stats.restore_seconds += self.stats.last_restore_done - started
        except StateRestoreError:
            logger.warning("dropping a checkpoint that llama.cpp refused to restore")
            self.store.remove(checkpoint.prefix_hash)
            slot.tokens = []
            return False
        slot.tokens = checkpoint.tokens.tolist()
        return True

    def save_checkpoint(self, slot: Slot) -> None:
        prefix_hash = self.hasher.prefix_hash(slot.tokens)
        if prefix_hash in self.store:
            return
        started = time.perf_counter()
        state = self.context.save_state(slot.seq_id)
        self.stats.save_seconds += time.perf_counter() - started
        self.stats.saved_bytes += len(state)
        checkpoint = Checkpoint(prefix_hash=prefix_hash, tokens=slot.tokens, state=state)
        if self.store.put(checkpoint):
            self.stats.checkpoints_saved += 1
            metrics.CHECKPOINTS_TAKEN.inc()
            self._added(checkpoint)
            self.codec.seal_later(checkpoint)

    def _added(self, checkpoint: Checkpoint) -> None:
        if self.listener is not None:
            self.listener.checkpoint_added(checkpoint)

    def _evicted(self, checkpoint: Stored) -> None:
        metrics.CHECKPOINTS_EVICTED.inc()
        if self.listener is not None:
            self.listener.checkpoint_removed(checkpoint)

    def rewind_to_prompt(self, run: Running) -> None:
        """Bring the slot back to an exact state within its prompt, dropping decode-time state."""
        slot, n_prompt = run.slot, len(run.prompt)
        if len(slot.tokens) <= n_prompt:
            return
        if not self.kind.needs_checkpoints:
            self._cut(slot, n_prompt)
            return
        checkpoint = self.store.longest_match(self.hasher, run.prompt, n_prompt)
        if checkpoint is None or not self._restore(slot, checkpoint):
            self.context.clear(slot.seq_id)
            slot.tokens = []
