"""A checkpoint store's second tier: signed state blobs in a local directory (a node's NVMe).

Checkpoints evicted from RAM are queued here and written by a background thread (to a
temporary name, fsync'd, renamed, the directory fsync'd), so a reader never sees half a file,
the engine never waits for the disk, and an entry is listed — found by lookups, republished
after a restart — only once its file would survive a crash. Files are the signed blobs peers
exchange, so a replica that restarts with the same model and HMAC key adopts them: a start
reads and authenticates each file's head only (a few KB: start-up time does not grow with
the disk budget); the state is validated in full every time it is read, and a file that
fails then — truncated or corrupted since — is deleted with a log line and the read is a
miss. llama.cpp only ever sees a state that passed.

Several replicas may share one directory: each claims a subdirectory `<model>/<n>` with a
file lock, held while it runs, and a restarted replica adopts whichever one is free.
Every directory must be this user's own and writable by nobody else, and no symbolic link
is followed (`disk_dir`); an entry of the directory that is not a regular file is skipped
with a log line.
"""

from __future__ import annotations

import logging
import os
import queue
import stat
import sys
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from baton_serve.cache_store.checkpoints.checkpoint import Checkpoint
from baton_serve.cache_store.checkpoints.disk_dir import (
    check_checkpoint_dir,
    claim_subdir,
    open_regular,
    probe_read_speed,
    read_regular,
    write_durably,
)
from baton_serve.cache_store.checkpoints.state_blob import HEADER_SIZE, BlobHead, head_length

logger = logging.getLogger("baton.disk")

SUFFIX = ".ckpt"
DEFAULT_MAX_PENDING_BYTES = 256 << 20
SMOOTHING = 0.3  # weight of a new read-speed measurement


@dataclass(eq=False)
class DiskEntry:
    """A checkpoint held only as a file: what lookups need without reading it."""

    prefix_hash: bytes
    tokens: np.ndarray
    nbytes: int  # as Checkpoint.nbytes (state + tokens): what the index is told
    path: Path
    file_bytes: int

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


class DiskTier:
    """Checkpoint files under a byte budget, least recently used deleted first.

    `encode` signs a checkpoint into a blob; `decode` validates a blob completely and
    raises `ValueError` (e.g. `BlobError`) for anything else; `decode_head` validates a
    blob's head alone (`state_blob.decode_head`), which is all a start reads. `on_drop` is
    told, from any thread, about each entry that left this tier other than by `discard`.
    """

    def __init__(
        self,
        root: str | Path,
        fingerprint: bytes,
        budget_bytes: int,
        *,
        encode: Callable[[Checkpoint], bytes],
        decode: Callable[[bytes], Checkpoint],
        decode_head: Callable[[bytes], BlobHead],
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the disk budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.max_pending_bytes = max_pending_bytes
        self.on_drop: Callable[[DiskEntry | Checkpoint], None] = lambda _: None
        # Whether reading an entry back beats recomputing it (the engine knows its speed).
        self.should_load: Callable[[DiskEntry], bool] = lambda entry: True
        self._encode = encode
        self._decode = decode
        self._decode_head = decode_head
        self._files: OrderedDict[bytes, DiskEntry] = OrderedDict()
        self._pending: dict[bytes, Checkpoint] = {}  # evicted from RAM, not written yet
        self._pending_bytes = 0
        self._lengths: Counter[int] = Counter()  # files and pending entries per n_tokens
        self._used = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._read_bytes_per_s = 0.0
        self.dir, self._lock_fd = claim_subdir(check_checkpoint_dir(root) / fingerprint.hex()[:16])
        self._adopt()
        self._writer = threading.Thread(target=self._write_loop, name="baton-disk", daemon=True)
        self._writer.start()

    # ---- what is here --------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def read_bytes_per_s(self) -> float:
        """Measured speed of reading and validating a file (the probe, then real reads)."""
        return self._read_bytes_per_s

    def restore_seconds(self, file_bytes: int) -> float:
        """Estimated time to read and validate a file of `file_bytes`."""
        return file_bytes / self._read_bytes_per_s

    def __len__(self) -> int:
        return len(self._files) + len(self._pending)

    def __contains__(self, prefix_hash: object) -> bool:
        with self._lock:
            return prefix_hash in self._files or prefix_hash in self._pending

    def lengths(self) -> set[int]:
        with self._lock:
            return set(self._lengths)

    def find(self, prefix_hash: bytes) -> DiskEntry | Checkpoint | None:
        """The entry stored under `prefix_hash` if it is worth loading (see `should_load`)."""
        with self._lock:
            entry = self._pending.get(prefix_hash) or self._files.get(prefix_hash)
        if isinstance(entry, DiskEntry) and not self.should_load(entry):
            return None
        return entry

    def entries(self) -> list[DiskEntry | Checkpoint]:
        """Every entry, written or pending, least recently used first."""
        with self._lock:
            return [*self._files.values(), *self._pending.values()]

    # ---- moving checkpoints --------------------------------------------------------------

    def spill(self, checkpoint: Checkpoint) -> bool:
        """Queue `checkpoint` (evicted from RAM) to be written; False if it cannot be kept.

        Never blocks and never calls `on_drop`: it may be called under the store's lock.
        """
        key = checkpoint.prefix_hash
        with self._lock:
            if key in self._files:
                self._files.move_to_end(key)
                return True
            if key in self._pending:
                return True
            if (
                self._writer is None
                or checkpoint.nbytes > self.budget_bytes
                or self._pending_bytes + checkpoint.nbytes > self.max_pending_bytes
            ):
                return False
            self._pending[key] = checkpoint
            self._pending_bytes += checkpoint.nbytes
            self._lengths[checkpoint.n_tokens] += 1
        self._queue.put(key)
        return True

    def load(self, prefix_hash: bytes) -> Checkpoint | None:
        """The checkpoint stored under `prefix_hash`, read and validated; a file that fails
        is deleted (and reported to `on_drop`)."""
        with self._lock:
            pending = self._pending.get(prefix_hash)
            entry = self._files.get(prefix_hash)
            if entry is not None:
                self._files.move_to_end(prefix_hash)
        if pending is not None:
            return pending
        if entry is None:
            return None
        started = time.perf_counter()
        try:
            checkpoint = self._decode(read_regular(entry.path))
            if checkpoint.prefix_hash != prefix_hash:
                raise ValueError("the file holds another prefix than its entry")
        except (OSError, ValueError) as exc:
            logger.warning("deleting checkpoint file %s: %s", entry.path.name, exc)
            if self._delete(prefix_hash):
                self.on_drop(entry)
            return None
        self._measured(entry.file_bytes, time.perf_counter() - started)
        return checkpoint

    def discard(self, prefix_hash: bytes) -> None:
        """Delete the entry stored under `prefix_hash`, if any (not reported to `on_drop`)."""
        self._delete(prefix_hash)

    def close(self, flush: Iterable[Checkpoint] = ()) -> None:
        """Write `flush` (most valuable first) as far as the budget allows, wait for every
        pending write, and release the directory."""
        if self._writer is None:
            return
        chosen, room = [], self.budget_bytes
        for checkpoint in flush:
            if checkpoint.nbytes <= room:
                chosen.append(checkpoint)
                room -= checkpoint.nbytes
        self.max_pending_bytes = sys.maxsize  # they are in memory anyway
        for checkpoint in reversed(chosen):  # the most valuable written last: kept longest
            self.spill(checkpoint)
        self._queue.put(None)
        self._writer.join()
        with self._lock:
            self._writer = None
        os.close(self._lock_fd)

    # ---- the writer thread ---------------------------------------------------------------

    def _write_loop(self) -> None:
        while (key := self._queue.get()) is not None:
            with self._lock:
                checkpoint = self._pending.get(key)
            if checkpoint is not None:
                self._write(checkpoint)

    def _write(self, checkpoint: Checkpoint) -> None:
        key = checkpoint.prefix_hash
        path = self.dir / f"{key.hex()}{SUFFIX}"
        try:
            blob = self._encode(checkpoint)
            write_durably(path, blob)  # before the entry is listed: see the module's doc
        except (OSError, ValueError) as exc:
            logger.warning("could not write checkpoint file %s: %s", path.name, exc)
            path.unlink(missing_ok=True)
            with self._lock:
                dropped = self._unpend(key)
            if dropped is not None:
                self.on_drop(dropped)
            return
        entry = DiskEntry(key, checkpoint.tokens, checkpoint.nbytes, path, len(blob))
        with self._lock:
            if self._unpend(key) is None:  # discarded while it was being written
                path.unlink(missing_ok=True)
                return
            self._add(entry)
            dropped_entries = self._over_budget()
        for dropped in dropped_entries:
            dropped.path.unlink(missing_ok=True)
            self.on_drop(dropped)

    # ---- bookkeeping (under the lock unless said otherwise) ------------------------------

    def _add(self, entry: DiskEntry) -> None:
        self._files[entry.prefix_hash] = entry
        self._lengths[entry.n_tokens] += 1
        self._used += entry.file_bytes

    def _over_budget(self) -> list[DiskEntry]:
        dropped = []
        while self._used > self.budget_bytes:
            _, oldest = self._files.popitem(last=False)
            self._forget(oldest.n_tokens, oldest.file_bytes)
            dropped.append(oldest)
        return dropped

    def _unpend(self, key: bytes) -> Checkpoint | None:
        checkpoint = self._pending.pop(key, None)
        if checkpoint is not None:
            self._pending_bytes -= checkpoint.nbytes
            self._forget(checkpoint.n_tokens, 0)
        return checkpoint

    def _forget(self, n_tokens: int, file_bytes: int) -> None:
        self._used -= file_bytes
        self._lengths[n_tokens] -= 1
        if not self._lengths[n_tokens]:
            del self._lengths[n_tokens]

    def _delete(self, key: bytes) -> bool:
        """Remove `key`'s file and entry (takes the lock); True if there was a file."""
        with self._lock:
            self._unpend(key)
            entry = self._files.pop(key, None)
            if entry is not None:
                self._forget(entry.n_tokens, entry.file_bytes)
        if entry is None:
            return False
        entry.path.unlink(missing_ok=True)
        return True

    def _measured(self, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            rate = nbytes / seconds
            self._read_bytes_per_s += SMOOTHING * (rate - self._read_bytes_per_s)

    # ---- start-up (no other thread yet) --------------------------------------------------

    def _adopt(self) -> None:
        """Take over the files a previous run left whose heads are valid (reading nothing
        else); delete everything else."""
        for leftover in self._regular_files("*.tmp"):
            leftover.unlink(missing_ok=True)
        # least recently written first
        files = sorted(self._regular_files(f"*{SUFFIX}"), key=_mtime)
        for path in files:
            try:
                self._add(self._read_entry(path))
            except (OSError, ValueError) as exc:
                logger.warning("deleting checkpoint file %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
        for dropped in self._over_budget():
            dropped.path.unlink(missing_ok=True)
        if self._files:
            logger.info("adopted %d checkpoint files from %s", len(self._files), self.dir)
        self._read_bytes_per_s = probe_read_speed(self.dir)

    def _regular_files(self, pattern: str) -> list[Path]:
        """The regular files of this tier's directory matching `pattern`; anything else there
        (a symbolic link, a directory, a FIFO) is left alone, with a log line."""
        regular = []
        for path in self.dir.glob(pattern):
            try:
                mode = path.lstat().st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISREG(mode):
                regular.append(path)
            else:
                logger.warning(
                    "skipping %s in checkpoint directory %s: not a regular file (%s)",
                    path.name,
                    self.dir,
                    "a symbolic link" if stat.S_ISLNK(mode) else f"mode {mode:o}",
                )
        return regular

    def _read_entry(self, path: Path) -> DiskEntry:
        """The entry of the file at `path`, from its authenticated head alone."""
        with os.fdopen(open_regular(path), "rb") as file:
            file_bytes = os.fstat(file.fileno()).st_size
            header = file.read(HEADER_SIZE)
            head = header + file.read(head_length(header) - len(header))
        found = self._decode_head(head)
        if file_bytes != len(head) + found.state_len:
            raise ValueError(
                f"the file is {file_bytes} bytes, its header implies {len(head) + found.state_len}"
            )
        if path.name != f"{found.prefix_hash.hex()}{SUFFIX}":
            raise ValueError("misnamed: it holds another prefix than its name says")
        nbytes = found.state_len + found.tokens.nbytes  # as Checkpoint.nbytes
        return DiskEntry(found.prefix_hash, found.tokens, nbytes, path, file_bytes)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
