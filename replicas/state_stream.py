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

Nobody can hold the receiver: tickets are read by one thread for all connections, each
with one deadline for the whole prefix, at most `max_pending` at once (the oldest is
dropped for a new one); only a live ticket gets one of the `bounds.max_streams` worker threads.
Nor can a sender make it allocate more than a real blob needs: the lengths a live ticket
announces are checked against `StreamLimits`, the largest blob the pulling replica's model
can have, before a byte of buffer is taken; a larger announcement fails the pull (the
prefix is computed instead), with a log line.

Wire: ``ticket 16s | head_len I | state_len Q`` (little-endian), the head, the state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import ray

from baton_serve.replicas.spare_buffer import SPARE_IDLE_S, SpareBuffer
from baton_serve.replicas.stream_limits import ReceiverBounds, StreamLimits

logger = logging.getLogger("baton.state_stream")

TICKET_BYTES = 16
_PREFIX = struct.Struct("<16sIQ")  # ticket, head length, state length
CONNECT_TIMEOUT_S = 2.0
STREAM_SLACK_S = 10.0  # a whole blob's deadline: this, plus its bytes at the slowest rate
MIN_STREAM_BYTES_PER_S = 50e6
UNREACHABLE_TTL_S = 60.0  # a peer that could not be connected to is tried again after this
ACCEPT_BACKOFF_S = 0.1  # a pause after accept fails (out of file descriptors)
REFUSAL_LOG_EVERY_S = 10.0  # at most one warning this often about dropped connections
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


class PeerUnreachable(ConnectionError):
    """The pulling peer's address could not be connected to (a firewall, a dead peer)."""


def this_node() -> str:
    """The id of the Ray node this process runs on."""
    return ray.get_runtime_context().get_node_id()


def stream_deadline_s(nbytes: int) -> float:
    """The most a whole stream of `nbytes` may take, at either end."""
    return STREAM_SLACK_S + nbytes / MIN_STREAM_BYTES_PER_S


@dataclass
class _Pending:
    """A connection still reading its prefix."""

    deadline: float
    prefix: bytearray = field(default_factory=bytearray)


class StateReceiver:
    """A listening socket on this node's address; each pull takes a one-time ticket and a
    future that the blob sent under it completes (thread-safe). `limits`: the largest blob
    this replica's model can have; a stream announcing more is refused unread."""

    def __init__(
        self,
        limits: StreamLimits,
        host: str | None = None,
        node_id: str | None = None,
        *,
        bounds: ReceiverBounds = ReceiverBounds(),
        spare_idle_s: float = SPARE_IDLE_S,
    ) -> None:
        self.node_id = node_id or this_node()
        self.limits = limits
        self._host = host or ray.util.get_node_ip_address()
        self._listener = socket.create_server((self._host, 0), backlog=64)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self.refused = 0  # connections dropped because `max_pending` were reading a prefix
        self.spare = SpareBuffer(spare_idle_s)
        self._max_pending = bounds.max_pending
        self._ticket_deadline_s = bounds.ticket_deadline_s
        self._waiting: dict[bytes, concurrent.futures.Future] = {}
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first
        self._lock = threading.Lock()
        self._closed = False
        self._last_refusal_log = -REFUSAL_LOG_EVERY_S
        self._wake_in, self._wake_out = socket.socketpair()
        self._wake_in.setblocking(False)
        self._wake_out.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_in, selectors.EVENT_READ)
        self._workers = concurrent.futures.ThreadPoolExecutor(
            bounds.max_streams, thread_name_prefix="baton-state-stream"
        )
        threading.Thread(target=self._serve, name="baton-state-receiver", daemon=True).start()

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
        """Stop listening at once; the receiver's thread lets go of the rest."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # refuses new connections now
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_out.send(b"\0")

    # ---- the receiver's thread: accepting, reading prefixes, letting the spare go -------

    def _serve(self) -> None:
        try:
            while not self._closed:
                timeout = self._housekeep(time.monotonic())
                for key, _ in self._selector.select(timeout):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_in:
                        with contextlib.suppress(OSError):
                            self._wake_in.recv(4096)
                    else:
                        self._read_prefix(key.fileobj)  # type: ignore[arg-type]
        except Exception:  # senders find it closed and answer through the object store
            logger.exception("the state receiver on port %d stopped", self.port)
        finally:
            for conn in list(self._pending):
                self._drop(conn)
            self._selector.close()
            for sock in (self._listener, self._wake_in, self._wake_out):
                sock.close()
            self._workers.shutdown(wait=False)

    def _housekeep(self, now: float) -> float | None:
        """Drop the connections past their prefix deadline and an idle spare; the seconds
        until the next of those is due (None: nothing is)."""
        for conn, pending in list(self._pending.items()):
            if pending.deadline > now:
                break  # the rest came later
            self._drop(conn)
        oldest = next(iter(self._pending.values()), None)
        due = [] if oldest is None else [oldest.deadline]
        spare_release = self.spare.release_if_idle(now)
        due += [spare_release] if spare_release is not None else []
        return max(0.0, min(due) - now) if due else None

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # closed, or out of file descriptors
                if not self._closed:
                    logger.warning(
                        "the state receiver on port %d cannot accept: %s", self.port, exc
                    )
                    time.sleep(ACCEPT_BACKOFF_S)  # the listener stays readable: no busy loop
                return
            if len(self._pending) >= self._max_pending:
                # A sender sends its prefix with its first bytes, so the oldest is the
                # likeliest stranger: dropping it keeps the newest (a real sender) in.
                self._count_refusal()
                self._drop(next(iter(self._pending)))
            conn.setblocking(False)
            self._pending[conn] = _Pending(time.monotonic() + self._ticket_deadline_s)
            self._selector.register(conn, selectors.EVENT_READ)
            self._read_prefix(conn)  # often already here

    def _count_refusal(self) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._last_refusal_log >= REFUSAL_LOG_EVERY_S:
            self._last_refusal_log = now
            logger.warning(
                "the state receiver on port %d has %d connections reading a ticket (its"
                " bound); dropped the oldest (%d dropped so far)",
                self.port,
                self._max_pending,
                self.refused,
            )

    def _drop(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()

    def _read_prefix(self, conn: socket.socket) -> None:
        pending = self._pending.get(conn)
        if pending is None:
            return  # dropped since it was selected
        try:
            chunk = conn.recv(_PREFIX.size - len(pending.prefix))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        pending.prefix += chunk
        if len(pending.prefix) < _PREFIX.size:
            return
        ticket, head_len, state_len = _PREFIX.unpack(pending.prefix)
        with self._lock:
            received = self._waiting.pop(ticket, None)
        if received is None:
            self._drop(conn)  # no such pull (a stranger, or one already given up)
            return
        refusal = self.limits.refusal(head_len, state_len)
        if refusal is not None:  # before any buffer is taken for it: the pull computes instead
            logger.warning("the state receiver on port %d refused a stream: %s", self.port, refusal)
            _settle(received, exception=StreamRefused(refusal))
            self._drop(conn)
            return
        self._pending.pop(conn)
        self._selector.unregister(conn)
        self._workers.submit(self._receive, conn, received, head_len, state_len)

    # ---- a worker: one blob under a live ticket -------------------------------------------

    def _receive(
        self,
        conn: socket.socket,
        received: concurrent.futures.Future,
        head_len: int,
        state_len: int,
    ) -> None:
        with conn:
            try:
                deadline = time.monotonic() + stream_deadline_s(head_len + state_len)
                head = bytes(_read(conn, head_len, deadline))
                state = self.spare.take(state_len)
                _read_into(conn, memoryview(state), deadline)
                state.flags.writeable = False  # only this pull holds it: no copy to freeze it
            except (OSError, StreamRefused) as exc:
                _settle(received, exception=StreamRefused(f"the stream broke off: {exc}"))
                return
            _settle(received, result=(head, state))
        self.spare.refill(state_len)  # for the next pull, of about the same size
        self._wake()  # the receiver's thread lets it go when idle


class StreamSender:
    """Sends blobs over the streams that pulling peers offer. A peer it cannot connect to
    (a firewall between nodes) gets answers through Ray's object store instead for
    `unreachable_ttl_s`, then is tried again; any other failure costs only that blob."""

    def __init__(
        self, node_id: str | None = None, *, unreachable_ttl_s: float = UNREACHABLE_TTL_S
    ) -> None:
        self._node_id = node_id  # this node's (asked of Ray when first needed)
        self._ttl_s = unreachable_ttl_s
        self._unreachable: dict[tuple[str, int], float] = {}  # address -> when to retry

    async def send(self, offer: StreamOffer | None, head: bytes, state: memoryview) -> bool:
        """True when the blob went over `offer`'s stream; False where there is no offer,
        the puller is on this node (the object store is faster there), out of reach or the
        stream failed."""
        if offer is None:
            return False
        address = (offer.host, offer.port)
        if self._unreachable.get(address, 0.0) > time.monotonic():
            return False
        self._node_id = self._node_id or this_node()
        if offer.node_id == self._node_id:
            return False
        try:
            await asyncio.to_thread(push_blob, offer, head, state)
        except PeerUnreachable as exc:
            self._mark_unreachable(address)
            logger.warning(
                "%s; answering that peer through the object store for the next %.0f s",
                exc,
                self._ttl_s,
            )
            return False
        except OSError as exc:
            logger.warning(
                "streaming a state to %s:%d broke off (%s); this one goes through the object store",
                offer.host,
                offer.port,
                exc,
            )
            return False
        self._unreachable.pop(address, None)
        return True

    def _mark_unreachable(self, address: tuple[str, int]) -> None:
        now = time.monotonic()
        self._unreachable = {a: t for a, t in self._unreachable.items() if t > now}
        self._unreachable[address] = now + self._ttl_s


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
    """Send a blob to the pulling replica under its ticket (blocking). Raises
    `PeerUnreachable` when connecting fails, another `OSError` when the stream does."""
    try:
        conn = socket.create_connection((offer.host, offer.port), timeout=CONNECT_TIMEOUT_S)
    except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
        # The peer accepted and then dropped us (a busy host may report it while the
        # connect is still being checked): it is reachable, only this stream failed.
        raise
    except OSError as exc:
        raise PeerUnreachable(f"cannot connect to {offer.host}:{offer.port}: {exc}") from exc
    with conn:
        # sendall's timeout bounds the whole call, not each send
        conn.settimeout(stream_deadline_s(len(head) + len(state)))
        conn.sendall(_PREFIX.pack(offer.ticket, len(head), len(state)) + head)
        conn.sendall(state)


def _read(conn: socket.socket, n: int, deadline: float) -> bytearray:
    data = bytearray(n)
    _read_into(conn, memoryview(data), deadline)
    return data


def _read_into(conn: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill `view` from `conn` by the monotonic `deadline` (one for the whole read)."""
    got = 0
    while got < len(view):
        left = deadline - time.monotonic()
        if left <= 0:
            raise StreamRefused(f"the stream missed its deadline at {got} of {len(view)} bytes")
        conn.settimeout(left)
        n = conn.recv_into(view[got:])
        if n == 0:
            raise StreamRefused(f"the stream ended after {got} of {len(view)} bytes")
        got += n
