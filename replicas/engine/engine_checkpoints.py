"""`Engine`'s checkpoint methods: its checkpoints, their blobs, the hash chain and the store's
figures, for its replica, the index publisher, peers and tests (`EngineFace` names them with
the rest of what outside code may call).

Nothing outside `replicas/engine/` touches the prefix cache, its store, codec or hasher
(`tests/test_engine_face.py` checks that); they call these methods instead.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from baton_serve.cache_store.checkpoints.checkpoint_store import Checkpoint, Stored
from baton_serve.cache_store.checkpoints.state_blob import BlobParts, Buffer
from baton_serve.cache_store.prefix_hash import common_prefix_length
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.replicas.engine.checkpoint_policy import MIN_PIECE
from baton_serve.replicas.engine.prefix_cache import PeerAsk, PrefixCache
from baton_serve.replicas.engine.prefix_states import CheckpointListener
from baton_serve.replicas.engine.slots import Phase, Slot


@dataclass(frozen=True)
class StoreFigures:
    """What the checkpoint store holds now (for gauges, reports and benchmarks)."""

    used_bytes: int  # in RAM
    budget_bytes: int  # RAM
    checkpoints: int  # in RAM
    disk_used_bytes: int | None  # None without a disk tier
    disk_read_bytes_per_s: float | None  # measured on the disk tier's reads, if any


class EngineCheckpoints:
    """`Engine`'s checkpoint methods (a mixin: `Engine` sets `_cache` and `_slots`)."""

    _cache: PrefixCache
    _slots: list[Slot]
    _peer_asks: deque[PeerAsk]  # read by the engine loop

    # ---- what the store holds ------------------------------------------------------------

    def checkpoints(self, *, on_disk: bool = False) -> list[Stored]:
        """The checkpoints in RAM, most recently used last; with `on_disk`, every one held
        in RAM or in the disk tier (each once)."""
        store = self._cache.states.store
        return store.entries() if on_disk else list(store.checkpoints())

    def checkpoint_prefixing(self, tokens: Sequence[int]) -> Checkpoint | None:
        """The longest stored checkpoint that prefixes `tokens` exactly (read from disk if
        it is there)."""
        found = self._cache.states.prefixing(tokens, len(tokens))
        return found if isinstance(found, Checkpoint) else None

    def store_figures(self) -> StoreFigures:
        store = self._cache.states.store
        disk = store.disk
        return StoreFigures(
            used_bytes=store.used_bytes,
            budget_bytes=store.budget_bytes,
            checkpoints=len(store),
            disk_used_bytes=None if disk is None else disk.used_bytes,
            disk_read_bytes_per_s=None if disk is None else disk.read_bytes_per_s,
        )

    def local_reuse(
        self, tokens: Sequence[int], prefix_hashes: Sequence[bytes] = ()
    ) -> tuple[int, float]:
        """About how many tokens of `tokens` (whose chain a request may carry) this engine
        could reuse right now, and the estimated seconds to read that state from its disk
        tier first (0 if in RAM)."""
        chain = self.carried_chain(tokens, prefix_hashes)
        return self._cache.local_reuse(tokens, self._slots, chain)

    def replay_share(self, tokens: Sequence[int]) -> int:
        """Tokens of `tokens` a reply being replayed here gives once its replay ends and its
        conversation is stored (an attention slot's conversation is stored only then): what
        a peer asking now may wait for; 0 if none. Any thread (a racy read: at worst a peer
        waits, within its deadline, for a state that does not come)."""
        if not self._cache.config.prefix_cache:
            return 0
        whole_only = self._cache.states.kind.needs_checkpoints  # a recurrent state is not cut
        best = 0
        for slot in self._slots:
            run = slot.running
            if run is None or run.index:  # only a request's first choice is replayed
                continue
            if run.phase is Phase.REPLAY:
                coming = run.feed
            elif run.phase is Phase.DECODE and run.handle.done:  # answered, replay next
                coming = run.prompt + tuple(run.generated)
            else:
                continue
            shared = common_prefix_length(coming, tokens)
            if not (whole_only and shared < len(coming)):
                best = max(best, shared)
        return best

    def prefill_progress(self, tokens: Sequence[int], min_tokens: int) -> tuple[int, int] | None:
        """For a prompt being computed here that will store a checkpoint giving more than
        `min_tokens` of `tokens`: the tokens computed so far and that checkpoint's position
        (the nearest such); None if no slot is computing one. Any thread (a racy read: at
        worst a peer waits, within its budget, for a state that comes later)."""
        whole_only = self._cache.states.kind.needs_checkpoints  # a recurrent state is not cut
        best: tuple[int, int] | None = None
        for slot in self._slots:
            run = slot.running
            if run is None or run.phase is not Phase.PREFILL:
                continue
            shared = common_prefix_length(run.feed, tokens)
            if shared <= min_tokens:
                continue
            ahead = [
                p
                for p in tuple(run.checkpoints)  # one C-level copy: the engine may add one
                if p > min_tokens and (p <= shared or not whole_only)
            ]
            if ahead:
                progress = len(slot.tokens), min(ahead)
                if best is None or progress[1] - progress[0] < best[1] - best[0]:
                    best = progress
        return best

    def keep_for_peer(self, tokens: Sequence[int], min_tokens: int, wait_s: float) -> None:
        """A peer waits `wait_s` for more than `min_tokens` of `tokens`: a prompt computed
        here meanwhile that shares more of them also saves its state where the two part, so
        the peer need not wait for the whole prompt's reply and replay (an attention prompt
        with no known system-prompt end is otherwise stored only then). Any thread."""
        self._peer_asks.append(PeerAsk(tuple(tokens), min_tokens, time.monotonic() + wait_s))

    def checkpoint_positions(self, prompt: Prompt) -> list[int]:
        """Where computing `prompt` from scratch gives states peers can pull: the full states
        stored as it is computed, and the end of the prompt less its last piece, anchored in
        the slot and stored when a peer asks for it (`keep_for_peer`)."""
        full, anchors = self._cache.checkpoints_for(prompt, 0)
        return sorted(set(full) | ({len(prompt) - MIN_PIECE} & set(anchors)))

    def state_bytes(self, n_tokens: int) -> int:
        """The size of an `n_tokens`-token state (0 where it is not linear: sliding windows)."""
        return self._cache.states.state_bytes(n_tokens)

    @property
    def state_size(self) -> tuple[int, int] | None:
        """A state's exact size as (fixed, per token) bytes; None where it is not linear."""
        return self._cache.states.state_size

    @property
    def largest_state_bytes(self) -> int:
        """The largest state a sequence can have here: a whole context's (KV and recurrent)."""
        return self._cache.states.largest_state_bytes

    # ---- hashes --------------------------------------------------------------------------

    def hash_chain(self, tokens: Sequence[int], known: Sequence[bytes] = ()) -> list[bytes]:
        """The block hash chain of `tokens` (what the index is looked up by); `known`: the
        chain of a sequence they begin, or that begins them, not hashed again."""
        return self._cache.states.hasher.chain(tokens, known)

    def carried_chain(
        self, tokens: Sequence[int], prefix_hashes: Sequence[bytes]
    ) -> tuple[bytes, ...]:
        """The block hash chain a request carried for `tokens` (the gateway's, computed once
        per request) if it is one of this engine's block size; empty otherwise."""
        fits = len(prefix_hashes) == len(tokens) // self._cache.config.block_tokens
        return tuple(prefix_hashes) if fits else ()

    def prefix_hash(self, tokens: Sequence[int]) -> bytes:
        """The hash a checkpoint of exactly `tokens` is stored under."""
        return self._cache.states.hasher.prefix_hash(tokens)

    # ---- moving checkpoints --------------------------------------------------------------

    def export_checkpoint(self, prefix_hash: bytes) -> tuple[bytes, memoryview] | None:
        """A stored checkpoint's signed blob as `(head, state)`, the state not copied; None
        if it is not here. Any thread."""
        return self._cache.states.export_checkpoint(prefix_hash)

    def export_best(
        self, tokens: Sequence[int], min_tokens: int = 0
    ) -> tuple[tuple[bytes, memoryview], object | None] | None:
        """The signed blob parts of the stored checkpoint giving the longest prefix of
        `tokens`, if more than `min_tokens` (what a peer asks for before pulling): one that
        prefixes them, or for attention models any that shares their beginning (the peer
        cuts it back); with its `shared` handle (None if it has none). Any thread."""
        return self._cache.states.export_best(tuple(tokens), min_tokens)

    def import_checkpoint(self, blob: Buffer | BlobParts) -> Checkpoint:
        """Check a state blob (contiguous, or its two parts) in full and keep it: `BlobError`
        if it is not an authentic, intact blob of this model, `EngineError` if it can never
        fit the store. Any thread."""
        return self._cache.states.import_checkpoint(blob)

    def share_states(self, share: Callable[[Checkpoint], None]) -> None:
        """Where new checkpoints' states are also put for peers to read without a copy per
        export (Ray's object store); `share` sets a checkpoint's `shared`, in the background."""
        self._cache.states.codec.share = share

    def add_checkpoint_listener(self, listener: CheckpointListener) -> None:
        """Tell `listener` about checkpoints added, used and removed (on the engine thread)."""
        self._cache.states.listeners.append(listener)
