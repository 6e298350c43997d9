"""The mechanism of prefix reuse: what a slot's llama.cpp sequence holds, and the checkpoints
kept of such states (the store, its disk tier, their signed blobs).

It saves, restores, cuts, copies and empties slots' states, each together with the slot's
tokens, and finds, imports and exports checkpoints; which state serves a prompt, and when
one is worth saving, is `prefix_cache`'s policy. Everything here runs on the engine
thread, except the lookups made with `touch=False`, `export_*` and `import_checkpoint`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from baton_serve.cache_store.checkpoints.checkpoint_store import Checkpoint, CheckpointStore, Stored
from baton_serve.cache_store.checkpoints.disk_tier import DiskEntry, DiskTier
from baton_serve.cache_store.checkpoints.state_blob import BlobError, BlobParts, Buffer
from baton_serve.cache_store.prefix_hash import PrefixHasher, common_prefix_length
from baton_serve.cache_store.telemetry import metrics
from baton_serve.cache_store.wire.protocol import EngineError
from baton_serve.replicas.engine.checkpoint_codec import CheckpointCodec, frozen
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_context import LlamaContext, StateRestoreError
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.slots import Slot
from baton_serve.replicas.engine.stats import EngineStats

logger = logging.getLogger("baton.engine")


class CheckpointListener(Protocol):
    """Told about the local store's contents; called on the engine thread, must be quick."""

    def checkpoint_added(self, checkpoint: Checkpoint, chain: Sequence[bytes] = ()) -> None:
        """`chain`: block hashes of its tokens known already (they may cover only some)."""

    def checkpoint_used(self, checkpoint: Checkpoint) -> None: ...

    def checkpoint_removed(self, checkpoint: Checkpoint) -> None: ...


class PrefixStates:
    """One engine's slot states and checkpoint store, and the blobs that move checkpoints."""

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
        self.hasher = PrefixHasher(model.fingerprint, config.block_tokens)
        # A state's exact size, measured before any blob is read, so that a signed but
        # malformed blob never reaches llama.cpp. A sliding window's cache stops growing at
        # the window, so its size is not linear (only the blob's own checks apply there), but
        # the line measured below the window still bounds it: the largest state, the most a
        # stream from a peer may announce.
        line = context.state_size_line(0, model.any_token)
        self.state_size = None if model.sliding_window else line
        fixed, per_token = line
        self.largest_state_bytes = fixed + per_token * context.n_ctx_per_seq
        self.listeners: list[CheckpointListener] = []
        self.codec = CheckpointCodec(
            model.fingerprint, self.hasher, hmac_key, self.state_size, stats
        )
        self.store = CheckpointStore(
            config.store_budget_bytes, on_evict=self._evicted, disk=self._disk_tier()
        )

    # ---- checkpoints ---------------------------------------------------------------------

    def stored_prefix(
        self, tokens: Sequence[int], limit: int, *, touch: bool = True, chain: Sequence[bytes] = ()
    ) -> tuple[Stored | None, int]:
        """The stored checkpoint that gives the most of `tokens` (at most `limit`), and how
        many tokens it gives (`chain`: their block hashes known already).

        Hybrid and recurrent states only serve prompts they prefix exactly; an attention
        state also serves any prompt sharing its beginning (its KV is cut back after).
        """
        if self.kind.needs_checkpoints:
            found = self.prefixing(tokens, limit, touch=touch, chain=chain)
            return found, found.n_tokens if found is not None else 0
        return self.store.longest_shared_prefix(tokens, limit, touch=touch)

    def prefixing(
        self, tokens: Sequence[int], limit: int, *, touch: bool = True, chain: Sequence[bytes] = ()
    ) -> Stored | None:
        """The longest stored checkpoint (at most `limit` tokens) that prefixes `tokens`
        exactly; read from disk unless `touch=False` (which may return a `DiskEntry`)."""
        return self.store.longest_match(self.hasher, tokens, limit, touch=touch, known=chain)

    def export_checkpoint(self, prefix_hash: bytes) -> tuple[bytes, memoryview] | None:
        """A signed state blob of a stored checkpoint as its two parts, `(head, state)`,
        the state not copied; None if it is not here.

        A checkpoint's payload is hashed once: in the background after it was saved, or by
        its first export if that has not happened yet.
        """
        checkpoint = self.store.get(prefix_hash)
        return None if checkpoint is None else self.codec.parts(checkpoint)

    def export_best(
        self, tokens: Sequence[int], min_tokens: int = 0
    ) -> tuple[tuple[bytes, memoryview], object | None] | None:
        """The signed blob parts of the stored checkpoint that gives the longest prefix of
        `tokens`, if that is more than `min_tokens`, with its `shared` handle (or None)."""
        checkpoint, reused = self.stored_prefix(tokens, len(tokens), touch=False)
        if checkpoint is None or reused <= min_tokens:
            return None
        parts = self.export_checkpoint(checkpoint.prefix_hash)
        return None if parts is None else (parts, checkpoint.shared)

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
        self._tell(lambda listener: listener.checkpoint_added(checkpoint))
        return checkpoint

    def state_bytes(self, n_tokens: int) -> int:
        """The size of an `n_tokens`-token state (0 where it is not linear: sliding windows)."""
        if self.state_size is None:
            return 0
        fixed, per_token = self.state_size
        return fixed + per_token * n_tokens

    def restore_seconds(self, found: Stored | None) -> float:
        """About how long reading `found` from the disk tier first takes (0 if in RAM)."""
        on_disk = isinstance(found, DiskEntry) and self.store.disk is not None
        return self.store.disk.restore_seconds(found.file_bytes) if on_disk else 0.0

    def close(self) -> None:
        """Keep what RAM holds on disk for a restart (with a disk tier); after the engine loop."""
        self.store.close()

    # ---- slot states ---------------------------------------------------------------------

    def reusable(self, slot: Slot, tokens: Sequence[int], limit: int) -> int:
        """Tokens of `tokens` (at most `limit`) the slot already holds and can keep: a
        recurrent state cannot be cut back, so where the slot holds more, its longest anchor
        within them."""
        common = common_prefix_length(slot.tokens, tokens, limit)
        if not self.kind.needs_checkpoints or common == len(slot.tokens):
            return common
        anchors = tuple(slot.anchors)  # one C-level copy: `local_reuse` reads from any thread
        return max((n for n in anchors if n <= common), default=0)

    def cut(self, slot: Slot, n_tokens: int) -> bool:
        """Keep the first `n_tokens` of a slot: an attention slot's KV is cut, a hybrid or
        recurrent slot is rewound to its anchor there. Where the memory cannot give them
        back (no anchor there, or a sliding window has dropped some), empty the slot and
        return False."""
        if n_tokens >= len(slot.tokens):
            return True
        if self.kind.needs_checkpoints:
            return self.rewind(slot, n_tokens)
        if self.context.truncate(slot.seq_id, slot.position_at(n_tokens)):
            slot.cut(n_tokens)
            return True
        self.empty(slot)
        return False

    def anchor(self, slot: Slot) -> None:
        """Keep the partial state after what `slot` holds now in the slot (a hybrid or
        recurrent model's). Its bytes count for the engine and the request running there."""
        started = time.perf_counter()
        partial = self.context.save_partial(slot.seq_id)
        self.stats.anchor_seconds += time.perf_counter() - started
        self.stats.anchor_bytes += len(partial)
        self.stats.anchors_taken += 1
        if slot.running is not None:
            slot.running.anchor_bytes += len(partial)
        slot.anchored(partial, self.config.slot_anchors)

    def rewind(self, slot: Slot, n_tokens: int) -> bool:
        """Bring `slot` back to its anchor after `n_tokens`, copying no attention KV; False,
        the slot emptied, if it has no anchor there or llama.cpp refuses it."""
        partial = slot.anchors.get(n_tokens)
        if partial is None:
            self.empty(slot)
            return False
        started = time.perf_counter()
        try:
            self.context.rewind(slot.seq_id, slot.position_at(n_tokens), partial)
        except StateRestoreError:
            logger.warning("emptying a slot that llama.cpp could not rewind to its anchor")
            slot.empty()
            return False
        self.stats.rewind_seconds += time.perf_counter() - started
        self.stats.rewound_bytes += len(partial)
        self.stats.rewinds += 1
        if slot.running is not None:
            slot.running.rewound_bytes += len(partial)
        slot.cut(n_tokens)
        return True

    def empty(self, slot: Slot) -> None:
        self.context.clear(slot.seq_id)
        slot.empty()

    def copy(self, source: Slot, target: Slot) -> None:
        """`target` holds what `source` holds (a request's other choices, n > 1)."""
        self.context.copy_sequence(source.seq_id, target.seq_id)
        target.holds(source.tokens, source.chain, source.anchors)

    def restore(self, slot: Slot, checkpoint: Checkpoint, chain: Sequence[bytes] = ()) -> bool:
        """Load a checkpoint into `slot` (whose tokens `chain` hashes, if known); False,
        the slot emptied and the checkpoint dropped, if llama.cpp refuses it. Its bytes
        count for the engine and for the request running in the slot, if any."""
        started = time.perf_counter()
        try:
            self.context.restore_state(slot.seq_id, checkpoint.state)
            self.stats.last_restore_done = time.perf_counter()
            self.stats.restore_seconds += self.stats.last_restore_done - started
            self.stats.restored_bytes += len(checkpoint.state)
            if slot.running is not None:
                slot.running.restored_bytes += len(checkpoint.state)
        except StateRestoreError:
            logger.warning("dropping a checkpoint that llama.cpp refused to restore")
            self.store.remove(checkpoint.prefix_hash)
            slot.empty()
            return False
        slot.holds(checkpoint.tokens.tolist(), chain)
        return True

    def served(self, checkpoint: Checkpoint) -> None:
        """A restored checkpoint served a request (counted; the index hears it is in use)."""
        self.stats.checkpoints_restored += 1
        metrics.CHECKPOINTS_RESTORED.inc()
        self._tell(lambda listener: listener.checkpoint_used(checkpoint))

    def save(self, slot: Slot) -> None:
        """Store what `slot` holds, hashing only the tokens past its known chain (which then
        covers them, for the slot's next checkpoint). Its bytes count for the engine and
        for the request running in the slot, if any."""
        chain = self.hasher.chain(slot.tokens, slot.chain)
        if len(chain) > len(slot.chain):
            slot.follows(chain)
        prefix_hash = self.hasher.prefix_hash(slot.tokens, known=chain)
        slot.stored()
        if prefix_hash in self.store:
            return
        started = time.perf_counter()
        state = self.context.save_state(slot.seq_id)
        self.stats.save_seconds += time.perf_counter() - started
        self.stats.saved_bytes += len(state)
        if slot.running is not None:
            slot.running.saved_bytes += len(state)
        checkpoint = Checkpoint(prefix_hash=prefix_hash, tokens=slot.tokens, state=state)
        if self.store.put(checkpoint):
            self.stats.checkpoints_saved += 1
            metrics.CHECKPOINTS_TAKEN.inc()
            self._tell(lambda listener: listener.checkpoint_added(checkpoint, chain))
            self.codec.seal_later(checkpoint)

    # ---- internals -----------------------------------------------------------------------

    def _tell(self, news: Callable[[CheckpointListener], None]) -> None:
        for listener in self.listeners:
            news(listener)

    def _evicted(self, checkpoint: Stored) -> None:
        metrics.CHECKPOINTS_EVICTED.inc()
        self._tell(lambda listener: listener.checkpoint_removed(checkpoint))

    def _disk_tier(self) -> DiskTier | None:
        """The disk tier of `checkpoint_dir`: the same signed blobs, checked the same way."""
        if self.config.checkpoint_dir is None:
            return None
        disk = DiskTier(
            self.config.checkpoint_dir,
            self.model.fingerprint,
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
