"""Mapped buffers for states arriving over a stream, and the one spare kept for the next.

Mapping a buffer's pages costs time (~20 ms for 47 MB here), so after each stream the
receiver maps one of the same size off any pull's path. That spare may be up to
`MAX_SPARE_BYTES`: it is let go once no stream has come for a while, so an idle replica
does not hold it.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

MAX_SPARE_BYTES = 512 << 20  # states up to this get a buffer mapped ahead of time
SPARE_IDLE_S = 60.0  # a spare no stream has used for this long is let go


class SpareBuffer:
    """The buffer mapped ahead of time for the next state (thread-safe)."""

    def __init__(self, idle_s: float = SPARE_IDLE_S) -> None:
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._buffer: np.ndarray | None = None
        self._made_at = 0.0

    @property
    def nbytes(self) -> int:
        """Bytes held by the spare now (0 when there is none)."""
        with self._lock:
            return 0 if self._buffer is None else self._buffer.nbytes

    def take(self, nbytes: int) -> np.ndarray:
        """A mapped buffer for a state of `nbytes`: the spare where it fits (no more than
        twice as large), a new one otherwise."""
        with self._lock:
            spare, self._buffer = self._buffer, None
        if spare is not None and nbytes <= len(spare) <= 2 * nbytes:
            return spare[:nbytes]
        return populated(nbytes)

    def refill(self, nbytes: int) -> None:
        """Map a spare for a next state of about `nbytes` (none above `MAX_SPARE_BYTES`)."""
        if nbytes <= MAX_SPARE_BYTES:
            spare = populated(nbytes)
            with self._lock:
                self._buffer, self._made_at = spare, time.monotonic()

    def release_if_idle(self, now: float) -> float | None:
        """Let the spare go if it has been idle `idle_s` by `now`; otherwise the monotonic
        time at which it will be (None when there is no spare left)."""
        with self._lock:
            if self._buffer is None:
                return None
            expires = self._made_at + self._idle_s
            if now < expires:
                return expires
            idle, self._buffer = self._buffer, None
        del idle  # unmapped here, outside the lock
        return None


def populated(nbytes: int) -> np.ndarray:
    """A new buffer with every page already mapped (`MADV_POPULATE_WRITE`, the GIL released
    meanwhile): the kernel maps them in one call, three times faster here than faulting them
    in one by one as a stream fills the buffer. Unpopulated where the kernel cannot."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    buffer = np.frombuffer(
        mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8
    )
    if _madvise is not None:
        # Best effort, in pieces: the call holds the process's memory-map lock, which an
        # mmap of any other thread (Ray's, the allocator's) waits for.
        address = buffer.ctypes.data
        for start in range(0, nbytes, POPULATE_PIECE_BYTES):
            size = min(POPULATE_PIECE_BYTES, nbytes - start)
            if _madvise(address + start, size, MADV_POPULATE_WRITE) != 0:
                break
    return buffer


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels refuse it (EINVAL): pages fault then
POPULATE_PIECE_BYTES = 2 << 20
_madvise = _libc_madvise() if sys.platform == "linux" else None
