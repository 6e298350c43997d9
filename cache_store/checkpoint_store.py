"""Local checkpoint store with a byte budget and least-recently-used eviction."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from baton_serve.cache_store.prefix_hash import PrefixHasher, common_prefix_length, token_array


@dataclass(eq=False)
class Checkpoint:
    """A llama.cpp sequence state saved after `tokens`; compares by identity.

    `state` is kept as given, as a read-only byte view: the checkpoint takes the buffer
    over (no copy; whoever made it must not write to it again). `digest` is the payload
    digest of its signed blob once known (`state_blob`), so exporting it again does not
    hash it again.
    """

    prefix_hash: bytes
    tokens: np.ndarray
    state: memoryview
    digest: bytes | None = None

    def __post_init__(self) -> None:
        tokens = np.array(token_array(self.tokens))  # always a private copy
        if len(tokens) == 0:
            raise ValueError("a checkpoint needs at least one token")
        tokens.flags.writeable = False
        self.tokens = tokens
        state = self.state.data if isinstance(self.state, np.ndarray) else memoryview(self.state)
        self.state = state.cast("B").toreadonly()

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return len(self.state) + self.tokens.nbytes


class CheckpointStore:
    """Thread-safe LRU of checkpoints that never holds more than `budget_bytes`.

    `on_evict` is called for each checkpoint evicted to make room (not for `remove`
    or for a replacement under the same hash). It runs outside the lock, in the
    thread that called `put`, after that checkpoint has been stored.
    """

    def __init__(
        self, budget_bytes: int, on_evict: Callable[[Checkpoint], None] | None = None
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._on_evict = on_evict
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
            return prefix_hash in self._entries

    def put(self, checkpoint: Checkpoint) -> bool:
        """Store `checkpoint`, evicting the least recently used; False if it can never fit."""
        size = checkpoint.nbytes
        if size > self.budget_bytes:
            return False
        evicted: list[Checkpoint] = []
        with self._lock:
            self._pop(checkpoint.prefix_hash)
            while self._used + size > self.budget_bytes:
                _, oldest = self._entries.popitem(last=False)
                self._forget(oldest)
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

    def remove(self, prefix_hash: bytes) -> Checkpoint | None:
        """Drop and return the checkpoint stored under `prefix_hash`."""
        with self._lock:
            return self._pop(prefix_hash)

    def longest_match(
        self,
        hasher: PrefixHasher,
        tokens: Sequence[int] | np.ndarray,
        max_tokens: int,
        *,
        touch: bool = True,
    ) -> Checkpoint | None:
        """Return the longest checkpoint (at most `max_tokens`) that is a prefix of `tokens`.

        `touch=False` looks without counting it as a use (for estimates).
        """
        arr = token_array(tokens)
        limit = min(max_tokens, len(arr))
        with self._lock:
            lengths = sorted((n for n in self._lengths if n <= limit), reverse=True)
        if not lengths:
            return None
        hashes = hasher.hashes_at(arr, lengths)  # outside the lock: O(len(tokens))
        with self._lock:
            for n in lengths:
                checkpoint = self._entries.get(hashes[n])
                if (
                    checkpoint is not None
                    and checkpoint.n_tokens == n
                    and np.array_equal(checkpoint.tokens, arr[:n])
                ):
                    if touch:
                        self._entries.move_to_end(checkpoint.prefix_hash)
                    return checkpoint
        return None

    def longest_shared_prefix(
        self, tokens: Sequence[int] | np.ndarray, max_tokens: int, *, touch: bool = True
    ) -> tuple[Checkpoint | None, int]:
        """The checkpoint sharing the longest common prefix with `tokens` (at most
        `max_tokens` of it), and that length; marks it used unless `touch=False`.

        For states that can be cut back to any prefix (attention KV): a conversation's
        saved state also serves another that shares only its beginning.
        """
        arr = token_array(tokens)
        limit = min(max_tokens, len(arr))
        best: Checkpoint | None = None
        best_n = 0
        for checkpoint in self.checkpoints():
            if min(limit, checkpoint.n_tokens) <= best_n:
                continue
            shared = common_prefix_length(checkpoint.tokens, arr, limit)
            if shared > best_n:
                best, best_n = checkpoint, shared
        if best is not None and touch:
            with self._lock:
                if best.prefix_hash in self._entries:
                    self._entries.move_to_end(best.prefix_hash)
        return best, best_n

    def checkpoints(self) -> list[Checkpoint]:
        """Return a snapshot of the stored checkpoints, most recently used last."""
        with self._lock:
            return list(self._entries.values())

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
