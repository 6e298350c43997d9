"""State blobs streamed straight from one replica to another on a different node.

Through Ray's object store a state crossing nodes is copied by the object managers in
chunks (0.66 GB/s between two nodes on this machine, where one TCP stream moves 4.5 GB/s).
So a replica that pulls listens on a socket of its own (`StateReceiver`), and with each
pull hands the peer — over Ray's call, which already carries the request — a `StreamOffer`:
its node, its address and a one-time random ticket. A peer on another node connects and
sends the blob under that ticket (`push_blob`); one on the same node answers through the
object store as before (no copy at all there). The ticket is the only way in: a connection
that does not present a live one is closed before a byte is read into memory, and what
arrives is a signed blob, checked in full like any other before llama.cpp sees it. The
stream is not encrypted, as Ray's own transfers are not.

Wire: ``ticket 16s | head_len I | state_len Q`` (little-endian), the head, the state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import mmap
import secrets
import socket
import struct
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import ray

logger = logging.getLogger("baton.state_stream")

TICKET_BYTES = 16
_PREFIX = struct.Struct("<16sIQ")  # ticket, head length, state length
MAX_HEAD_BYTES = 64 << 20  # header + token ids of the longest prompt, with room to spare
MAX_STATE_BYTES = 8 << 30  # `decode_blob`'s limit
MAX_SPARE_BYTES = 512 << 20  # states up to this get a buffer mapped ahead of time
CONNECT_TIMEOUT_S = 2.0
IDLE_TIMEOUT_S = 10.0  # the longest pause between two reads or writes of one stream
STREAMED = "streamed"  # an export's answer when it sent the blob over the offered stream


@dataclass(frozen=True)
class StreamOffer:
    """Where a pulling replica takes a blob: its node, its address, the pull's ticket."""

    node_id: str
    host: str
    port: int
    ticket: bytes


class StreamRefused(ConnectionError):
    """A stream that did not deliver a whole blob under a live ticket."""


def this_node() -> str:
    """The id of the Ray node this process runs on."""
    return ray.get_runtime_context().get_node_id()


class StateReceiver:
    """A listening socket on this node's address; each pull takes a one-time ticket and a
    future that the blob sent under it completes (thread-safe)."""

    def __init__(self, host: str | None = None, node_id: str | None = None) -> None:
        self.node_id = node_id or this_node()
        self._host = host or ray.util.get_node_ip_address()
        self._listener = socket.create_server((self._host, 0), backlog=64)
        self.port = self._listener.getsockname()[1]
        self._waiting: dict[bytes, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._spare: np.ndarray | None = None  # a mapped buffer for the next state
        threading.Thread(target=self._accept, name="baton-state-receiver", daemon=True).start()

    def offer(self) -> tuple[StreamOffer, concurrent.futures.Future]:
        """A new ticket, and the future of the `(head, state)` sent under it."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        received: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._waiting[ticket] = received
        return StreamOffer(self.node_id, self._host, self.port, ticket), received

    def forget(self, ticket: bytes) -> None:
        """The pull is over: its ticket no longer opens anything."""
        with self._lock:
            self._waiting.pop(ticket, None)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept
        with contextlib.suppress(OSError):
            self._listener.close()

    def _buffer(self, nbytes: int) -> np.ndarray:
        """A buffer for a state of `nbytes` whose pages are mapped: the spare one made after
        the last stream where it fits (mapping 47 MB costs ~20 ms here, so that is done off
        any pull's path), a new one otherwise."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and nbytes <= len(spare) <= 2 * nbytes:
            return spare[:nbytes]
        return _populated(nbytes)

    def _make_spare(self, nbytes: int) -> None:
        if nbytes <= MAX_SPARE_BYTES:
            spare = _populated(nbytes)
            with self._lock:
                self._spare = spare

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._receive, args=(conn,), daemon=True).start()

    def _receive(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(CONNECT_TIMEOUT_S)  # a stranger holds this thread no longer
            try:
                ticket, head_len, state_len = _PREFIX.unpack(_read(conn, _PREFIX.size))
            except (OSError, StreamRefused):
                return
            with self._lock:
                received = self._waiting.pop(ticket, None)
            if received is None:
                return  # no such pull (a stranger, or one already given up)
            conn.settimeout(IDLE_TIMEOUT_S)
            try:
                if head_len > MAX_HEAD_BYTES or state_len > MAX_STATE_BYTES:
                    raise StreamRefused(f"a stream announced {head_len} + {state_len} bytes")
                head = bytes(_read(conn, head_len))
                state = self._buffer(state_len)
                _read_into(conn, memoryview(state))
                state.flags.writeable = False  # only this pull holds it: no copy to freeze it
            except (OSError, StreamRefused) as exc:
                _settle(received, exception=StreamRefused(f"the stream broke off: {exc}"))
                return
            _settle(received, result=(head, state))
        self._make_spare(state_len)  # for the next pull, of about the same size


class StreamSender:
    """Sends blobs over the streams that pulling peers offer, and remembers the addresses
    it could not reach (a firewall between nodes): those peers get answers through Ray's
    object store instead."""

    def __init__(self, node_id: str | None = None) -> None:
        self._node_id = node_id  # this node's (asked of Ray when first needed)
        self._unreachable: set[tuple[str, int]] = set()

    async def send(self, offer: StreamOffer | None, head: bytes, state: memoryview) -> bool:
        """True when the blob went over `offer`'s stream; False where there is no offer,
        the puller is on this node (the object store is faster there) or out of reach."""
        if offer is None or (offer.host, offer.port) in self._unreachable:
            return False
        self._node_id = self._node_id or this_node()
        if offer.node_id == self._node_id:
            return False
        try:
            await asyncio.to_thread(push_blob, offer, head, state)
        except OSError as exc:
            self._unreachable.add((offer.host, offer.port))
            logger.warning(
                "streaming a state to %s:%d failed (%s); answering that peer through the"
                " object store from now on",
                offer.host,
                offer.port,
                exc,
            )
            return False
        return True


def _settle(
    future: concurrent.futures.Future,
    *,
    result: object = None,
    exception: BaseException | None = None,
) -> None:
    """Complete a pull's future unless the pull gave up on it meanwhile."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)


def push_blob(offer: StreamOffer, head: bytes, state: memoryview) -> None:
    """Send a blob to the pulling replica under its ticket (blocking; raises `OSError`)."""
    with socket.create_connection((offer.host, offer.port), timeout=CONNECT_TIMEOUT_S) as conn:
        conn.settimeout(IDLE_TIMEOUT_S)
        conn.sendall(_PREFIX.pack(offer.ticket, len(head), len(state)) + head)
        conn.sendall(state)


def _populated(nbytes: int) -> np.ndarray:
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


def _read(conn: socket.socket, n: int) -> bytearray:
    data = bytearray(n)
    _read_into(conn, memoryview(data))
    return data


def _read_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise StreamRefused(f"the stream ended after {got} of {len(view)} bytes")
        got += n
