"""Direct state streams between replicas on different nodes, over real sockets: a blob sent
under a pull's ticket arrives whole; nothing else gets in, and nobody can hold the receiver;
a broken stream fails the pull; a peer on the same node or out of reach is answered through
the object store instead, out of reach only while connecting fails and only for a while."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import secrets
import select
import socket
import struct
import threading
import time

import numpy as np
import pytest

from baton_serve.replicas.state_stream import (
    _PREFIX,
    StateReceiver,
    StreamOffer,
    StreamRefused,
    StreamSender,
    push_blob,
)
from baton_serve.replicas.stream_limits import ReceiverBounds, StreamLimits

TICKET_DEADLINE_S = ReceiverBounds().ticket_deadline_s

HEAD = b"signed head and token ids " * 40
STATE = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)  # 3 MiB
LIMITS = StreamLimits(max_head_bytes=64 << 10, max_state_bytes=64 << 20)  # a model's largest


@pytest.fixture
def receiver():
    receiver = StateReceiver(LIMITS, host="127.0.0.1", node_id="puller-node")
    yield receiver
    receiver.close()


def _raw(offer: StreamOffer, data: bytes) -> None:
    """Connect to the receiver and send `data`, as nobody that speaks the protocol would."""
    with socket.create_connection((offer.host, offer.port), timeout=5) as conn:
        conn.sendall(data)


def test_a_blob_sent_under_its_ticket_arrives_whole(receiver: StateReceiver) -> None:
    offer, received = receiver.offer()
    push_blob(offer, HEAD, memoryview(STATE))
    head, state = received.result(timeout=10)
    assert head == HEAD and np.array_equal(state, STATE)
    assert not state.flags.writeable  # checked as it is, never copied to freeze it


def test_nothing_gets_in_without_a_live_ticket(receiver: StateReceiver) -> None:
    """A stranger's ticket, a pull that gave up, a ticket used once: the receiver hangs up
    after the 28-byte prefix (the sender may or may not see it, as the kernel buffers)."""
    offer, received = receiver.offer()
    stranger = StreamOffer(offer.node_id, offer.host, offer.port, secrets.token_bytes(16))
    with contextlib.suppress(OSError):
        push_blob(stranger, HEAD, memoryview(STATE))
    receiver.forget(offer.ticket)
    with contextlib.suppress(OSError):
        push_blob(offer, HEAD, memoryview(STATE))
    with pytest.raises(concurrent.futures.TimeoutError):
        received.result(timeout=0.5)

    once, delivered = receiver.offer()
    push_blob(once, HEAD, memoryview(STATE))
    delivered.result(timeout=10)
    _, waiting = receiver.offer()  # another pull is waiting meanwhile
    with contextlib.suppress(OSError):
        push_blob(once, b"other head", memoryview(STATE))  # the used ticket again
    with pytest.raises(concurrent.futures.TimeoutError):
        waiting.result(timeout=0.5)


def test_a_stream_that_breaks_off_fails_the_pull(receiver: StateReceiver) -> None:
    offer, received = receiver.offer()
    prefix = _PREFIX.pack(offer.ticket, len(HEAD), STATE.nbytes)
    _raw(offer, prefix + HEAD + STATE[: STATE.nbytes // 2].tobytes())
    with pytest.raises(StreamRefused, match="ended after"):
        received.result(timeout=10)


def test_absurd_lengths_are_refused_before_anything_is_allocated(
    receiver: StateReceiver,
) -> None:
    offer, received = receiver.offer()
    _raw(offer, _PREFIX.pack(offer.ticket, len(HEAD), 1 << 40))
    with pytest.raises(StreamRefused, match="announced"):
        received.result(timeout=10)


def test_the_sender_streams_only_to_a_reachable_peer_on_another_node(
    receiver: StateReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    sender = StreamSender(node_id="holder-node")
    offer, received = receiver.offer()
    assert asyncio.run(sender.send(offer, HEAD, memoryview(STATE)))
    assert received.result(timeout=10)[0] == HEAD

    same_node = StreamSender(node_id="puller-node")  # the object store is faster there
    assert not asyncio.run(same_node.send(receiver.offer()[0], HEAD, memoryview(STATE)))
    assert not asyncio.run(sender.send(None, HEAD, memoryview(STATE)))

    closed = StateReceiver(LIMITS, host="127.0.0.1", node_id="gone-node")
    gone, _ = closed.offer()
    closed.close()
    with caplog.at_level(logging.WARNING, logger="baton.state_stream"):
        assert not asyncio.run(sender.send(gone, HEAD, memoryview(STATE)))
        assert not asyncio.run(sender.send(gone, HEAD, memoryview(STATE)))
    warnings = [r for r in caplog.records if "cannot connect" in r.getMessage()]
    assert len(warnings) == 1  # out of reach once: not tried again


def test_states_streamed_one_after_another_each_keep_their_own_bytes(
    receiver: StateReceiver,
) -> None:
    """After a stream the receiver maps a buffer for the next one ahead of time; each state
    keeps its own memory, whatever came after it."""
    states = [np.full(STATE.nbytes, fill, dtype=np.uint8) for fill in (1, 2, 3)]
    received = []
    for state in states:
        offer, future = receiver.offer()
        push_blob(offer, HEAD, memoryview(state))
        received.append(future.result(timeout=10)[1])
    for state, got in zip(states, received, strict=True):
        assert np.array_equal(got, state)


def _closed_by_peer(conn: socket.socket, within: float) -> bool:
    """True once the other end hangs up on `conn`, waiting up to `within` seconds."""
    if not select.select([conn], [], [], within)[0]:
        return False
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def test_slow_strangers_over_the_bound_do_not_keep_a_blob_out() -> None:
    """Five strangers that each send one byte of a prefix and wait, against a bound of four:
    the receiver never reads more than four prefixes at once, and a real pull still gets
    its blob at once, long before the strangers' deadline."""
    receiver = StateReceiver(
        LIMITS, host="127.0.0.1", node_id="puller-node", bounds=ReceiverBounds(max_pending=4)
    )
    offer, received = receiver.offer()
    strangers = [socket.create_connection((offer.host, offer.port), timeout=5) for _ in range(5)]
    try:
        for stranger in strangers:
            stranger.sendall(b"x")
        assert _closed_by_peer(strangers[0], within=1.0)  # the oldest, dropped for the fifth
        assert receiver.refused == 1
        started = time.monotonic()
        push_blob(offer, HEAD, memoryview(STATE))
        head, state = received.result(timeout=10)
        elapsed = time.monotonic() - started
        assert head == HEAD and np.array_equal(state, STATE)
        assert elapsed < TICKET_DEADLINE_S / 2  # it did not wait for a stranger to expire
        assert receiver.refused == 2  # the next oldest made room for it
        assert not _closed_by_peer(strangers[-1], within=0.0)
    finally:
        for stranger in strangers:
            stranger.close()
        receiver.close()


def test_a_trickling_stranger_is_cut_off_at_the_whole_read_deadline(
    receiver: StateReceiver,
) -> None:
    """One byte every half second never lets a per-read timeout fire; the prefix's one
    deadline does."""
    offer, _ = receiver.offer()
    with socket.create_connection((offer.host, offer.port), timeout=5) as conn:
        started = time.monotonic()
        cut_off = False
        while not cut_off and time.monotonic() - started < TICKET_DEADLINE_S + 2:
            with contextlib.suppress(OSError):
                conn.sendall(b"x")
            cut_off = _closed_by_peer(conn, within=0.5)
        elapsed = time.monotonic() - started
    assert cut_off, f"still connected after {elapsed:.1f} s"
    assert TICKET_DEADLINE_S - 0.1 <= elapsed < TICKET_DEADLINE_S + 1.0


class _Peer:
    """A listening socket standing in for a pulling replica, to make its first `resets`
    streams fail after connecting (reset at once): a fault a real receiver does not produce
    on demand. Every later stream is read whole; `received` holds each one's byte count."""

    def __init__(self, port: int = 0, resets: int = 0) -> None:
        self._listener = socket.create_server(("127.0.0.1", port))
        self.port = self._listener.getsockname()[1]
        self._resets = resets
        self.received: list[int] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self._listener.accept()
                with conn:
                    if self._resets > 0:
                        self._resets -= 1
                        conn.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                        continue  # closed with a reset
                    total = 0
                    while chunk := conn.recv(1 << 20):
                        total += len(chunk)
                    self.received.append(total)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept
        self._listener.close()


BIG_STATE = np.zeros(32 << 20, dtype=np.uint8)  # more than loopback buffers hold unread


def test_a_stream_that_fails_after_connecting_does_not_mark_the_peer_unreachable() -> None:
    peer = _Peer(resets=1)
    sender = StreamSender(node_id="holder-node")
    offer = StreamOffer("puller-node", "127.0.0.1", peer.port, secrets.token_bytes(16))
    try:
        assert not asyncio.run(sender.send(offer, HEAD, memoryview(BIG_STATE)))
        assert asyncio.run(sender.send(offer, HEAD, memoryview(BIG_STATE)))  # tried again
        deadline = time.monotonic() + 5
        while not peer.received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert peer.received == [_PREFIX.size + len(HEAD) + BIG_STATE.nbytes]
    finally:
        peer.close()


def test_an_unreachable_peer_is_tried_again_after_the_ttl() -> None:
    ttl_s = 0.5
    sender = StreamSender(node_id="holder-node", unreachable_ttl_s=ttl_s)
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # free once closed: connecting there is refused
    offer = StreamOffer("puller-node", "127.0.0.1", port, secrets.token_bytes(16))
    assert not asyncio.run(sender.send(offer, HEAD, memoryview(STATE)))
    marked = time.monotonic()
    peer = _Peer(port=port)  # the peer is back
    try:
        assert not asyncio.run(sender.send(offer, HEAD, memoryview(STATE)))  # within the TTL
        time.sleep(max(0.0, marked + ttl_s - time.monotonic()))
        assert asyncio.run(sender.send(offer, HEAD, memoryview(STATE)))
        deadline = time.monotonic() + 5
        while not peer.received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert peer.received == [_PREFIX.size + len(HEAD) + STATE.nbytes]  # once: after
    finally:
        peer.close()


def _mapped(start: int, nbytes: int) -> bool:
    """Whether [start, start + nbytes) is a mapping of this process (`/proc/self/maps`)."""
    with open("/proc/self/maps") as maps:
        spans = (line.split(maxsplit=1)[0].split("-") for line in maps)
        return any(int(low, 16) == start and int(high, 16) == start + nbytes for low, high in spans)


def test_the_spare_buffer_is_let_go_after_an_idle_period() -> None:
    """After a stream the receiver maps a spare buffer of the same size for the next one;
    with no stream for `spare_idle_s` it is unmapped (its memory leaves the process)."""
    idle_s = 0.5
    receiver = StateReceiver(LIMITS, host="127.0.0.1", node_id="puller-node", spare_idle_s=idle_s)
    state = np.full(64 << 20, 7, dtype=np.uint8)
    try:
        offer, received = receiver.offer()
        started = time.monotonic()  # the idle period starts after this stream
        push_blob(offer, HEAD, memoryview(state))
        assert np.array_equal(received.result(timeout=10)[1], state)
        del received  # and the state it holds
        deadline = time.monotonic() + 5
        while receiver.spare.nbytes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.spare.nbytes == state.nbytes
        # Its mapping itself is watched: the process's RSS moves with Ray's threads too.
        spare = receiver.spare._buffer.ctypes.data
        assert _mapped(spare, state.nbytes)
        while receiver.spare.nbytes and time.monotonic() - started < idle_s + 2:
            time.sleep(0.05)
        assert receiver.spare.nbytes == 0
        assert time.monotonic() - started >= idle_s
        assert not _mapped(spare, state.nbytes)  # unmapped, not just forgotten
    finally:
        receiver.close()
