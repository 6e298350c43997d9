"""Local checkpoint store with a byte budget and least-recently-used eviction.

With a `DiskTier`, what RAM evicts goes to disk, and lookups see both tiers: a checkpoint
found on disk is read, validated and brought back into RAM.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from baton_serve.cache_store.checkpoints.checkpoint import Checkpoint
from baton_serve.cache_store.checkpoints.disk_tier import DiskEntry, DiskTier
from baton_serve.cache_store.prefix_hash import PrefixHasher, common_prefix_length, token_array

Stored = Checkpoint | DiskEntry  # what a lookup that does not load may return


class CheckpointStore:
    """Thread-safe LRU of checkpoints that never holds more than `budget_bytes` in RAM.

    `on_evict` is called for each checkpoint evicted to make room (not for `remove`
    or for a replacement under the same hash) once it has left every tier. Evicted from
    RAM, it runs outside the lock, in the thread that called `put`, after that checkpoint
    has been stored; evicted from disk, in the disk tier's writer thread.
    """

    def __init__(
        self,
        budget_bytes: int,
        on_evict: Callable[[Stored], None] | None = None,
        *,
        disk: DiskTier | None = None,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._on_evict = on_evict
        self.disk = disk
        if disk is not None:
            disk.on_drop = self._left_disk
        self._entries: OrderedDict[bytes, Checkpoint] = OrderedDict()
        self._lengths: Counter[int] = Counter()  # stored checkpoints per n_tokens
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, prefix_hash: object) -> bool:
        with self._lock:
            if prefix_hash in self._entries:
                return True
        return self.disk is not None and prefix_hash in self.disk

    def put(self, checkpoint: Checkpoint) -> bool:
        """Store `checkpoint`, evicting the least recently used; False if it can never fit
        (one larger than the RAM budget goes straight to disk, where there is one)."""
        size = checkpoint.nbytes
        if size > self.budget_bytes:
            return self.disk is not None and self.disk.spill(checkpoint)
        evicted: list[Checkpoint] = []
        with self._lock:
            self._pop(checkpoint.prefix_hash)
            while self._used + size > self.budget_bytes:
                _, oldest = self._entries.popitem(last=False)
                self._forget(oldest)
                if self.disk is None or not self.disk.spill(oldest):
                    evicted.append(oldest)
            self._entries[checkpoint.prefix_hash] = checkpoint
            self._lengths[checkpoint.n_tokens] += 1
            self._used += size
        if self._on_evict is not None:
            for old in evicted:
                self._on_evict(old)
        return True

    def get(self, prefix_hash: bytes) -> Checkpoint | None:
        """Return the checkpoint stored under `prefix_hash` and mark it used."""
        with self._lock:
            checkpoint = self._entries.get(prefix_hash)
            if checkpoint is not None:
                self._entries.move_to_end(prefix_hash)
                return checkpoint
        return self._promote(prefix_hash)

    def remove(self, prefix_hash: bytes) -> Checkpoint | None:
        """Drop and return the checkpoint stored under `prefix_hash` (from every tier)."""
        with self._lock:
            checkpoint = self._pop(prefix_hash)
        if self.disk is not None:
            self.disk.discard(prefix_hash)
        return checkpoint

    def longest_match(
        self,
        hasher: PrefixHasher,
        tokens: Sequence[int] | np.ndarray,
        max_tokens: int,
        *,
        touch: bool = True,
        known: Sequence[bytes] = (),
    ) -> Stored | None:
        """Return the longest checkpoint (at most `max_tokens`) that is a prefix of `tokens`.

        A checkpoint found on disk is read, validated and brought into RAM. `touch=False`
        looks without counting it as a use and without reading it (for estimates): it may
        return a `DiskEntry`. `known`: block hashes of `tokens` already computed
        (`PrefixHasher.hashes_at`).
        """
        arr = token_array(tokens)
        limit = min(max_tokens, len(arr))
        with self._lock:
            held = set(self._lengths)
        if self.disk is not None:
            held |= self.disk.lengths()
        lengths = sorted((n for n in held if n <= limit), reverse=True)
        if not lengths:
            return None
        hashes = hasher.hashes_at(arr, lengths, known)  # outside the lock: O(len(tokens))
        for n in lengths:
            with self._lock:
                checkpoint = self._entries.get(hashes[n])
                if checkpoint is not None and _holds(checkpoint, arr, n):
                    if touch:
                        self._entries.move_to_end(checkpoint.prefix_hash)
                    return checkpoint
            on_disk = self.disk.find(hashes[n]) if self.disk is not None else None
            if on_disk is not None and _holds(on_disk, arr, n):
                if not touch:
                    return on_disk
                if (loaded := self._promote(on_disk.prefix_hash)) is not None:
                    return loaded
        return None

    def longest_shared_prefix(
        self, tokens: Sequence[int] | np.ndarray, max_tokens: int, *, touch: bool = True
    ) -> tuple[Stored | None, int]:
        """The checkpoint sharing the longest common prefix with `tokens` (at most
        `max_tokens` of it), and that length; marks it used (reading it from disk) unless
        `touch=False`.

        For states that can be cut back to any prefix (attention KV): a conversation's
        saved state also serves another that shares only its beginning.
        """
        arr = token_array(tokens)
        limit = min(max_tokens, len(arr))
        best: Stored | None = None
        best_n = 0
        candidates: list[Stored] = list(self.checkpoints())  # RAM first: wins a tie
        if self.disk is not None:
            candidates += self.disk.entries()
        for checkpoint in candidates:
            if min(limit, checkpoint.n_tokens) <= best_n:
                continue
            if isinstance(checkpoint, DiskEntry) and not self.disk_worth(checkpoint):
                continue
            shared = common_prefix_length(checkpoint.tokens, arr, limit)
            if shared > best_n:
                best, best_n = checkpoint, shared
        if best is not None and touch:
            with self._lock:
                if best.prefix_hash in self._entries:
                    self._entries.move_to_end(best.prefix_hash)
                    return best, best_n
            loaded = self._promote(best.prefix_hash)
            return (loaded, best_n) if loaded is not None else (None, 0)
        return best, best_n

    def entries(self) -> list[Stored]:
        """Every checkpoint held, in RAM or on disk (each once)."""
        in_ram = self.checkpoints()
        if self.disk is None:
            return list(in_ram)
        keys = {c.prefix_hash for c in in_ram}
        return [*in_ram, *(e for e in self.disk.entries() if e.prefix_hash not in keys)]

    def disk_worth(self, entry: DiskEntry) -> bool:
        """Whether restoring `entry` from disk is estimated to beat recomputing it."""
        return self.disk is not None and self.disk.should_load(entry)

    def close(self) -> None:
        """Write what RAM holds to disk (as far as its budget allows) and release the disk
        directory: a restart with the same directory adopts them."""
        if self.disk is not None:
            self.disk.close(reversed(self.checkpoints()))

    def checkpoints(self) -> list[Checkpoint]:
        """Return a snapshot of the stored checkpoints, most recently used last."""
        with self._lock:
            return list(self._entries.values())

    def _promote(self, prefix_hash: bytes) -> Checkpoint | None:
        """Read a checkpoint back from disk into RAM; None if it is not there or invalid."""
        if self.disk is None or (checkpoint := self.disk.load(prefix_hash)) is None:
            return None
        self.put(checkpoint)  # its file stays: evicting it again costs no write
        return checkpoint

    def _left_disk(self, entry: Stored) -> None:
        """The disk tier dropped `entry`: evicted, unless RAM still holds it."""
        with self._lock:
            if entry.prefix_hash in self._entries:
                return
        if self._on_evict is not None:
            self._on_evict(entry)

    def _pop(self, prefix_hash: bytes) -> Checkpoint | None:
        checkpoint = self._entries.pop(prefix_hash, None)
        if checkpoint is not None:
            self._forget(checkpoint)
        return checkpoint

    def _forget(self, checkpoint: Checkpoint) -> None:
        self._used -= checkpoint.nbytes
        self._lengths[checkpoint.n_tokens] -= 1
        if not self._lengths[checkpoint.n_tokens]:
            del self._lengths[checkpoint.n_tokens]


def _holds(checkpoint: Stored, tokens: np.ndarray, n: int) -> bool:
    return checkpoint.n_tokens == n and np.array_equal(checkpoint.tokens, tokens[:n])
