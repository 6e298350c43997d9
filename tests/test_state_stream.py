"""Direct state streams between replicas on different nodes, over real sockets: a blob sent
under a pull's ticket arrives whole; nothing else gets in; a broken stream fails the pull;
a peer on the same node or out of reach is answered through the object store instead."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import secrets
import socket

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

HEAD = b"signed head and token ids " * 40
STATE = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)  # 3 MiB


@pytest.fixture
def receiver():
    receiver = StateReceiver(host="127.0.0.1", node_id="puller-node")
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

    closed = StateReceiver(host="127.0.0.1", node_id="gone-node")
    gone, _ = closed.offer()
    closed.close()
    with caplog.at_level(logging.WARNING, logger="baton.state_stream"):
        assert not asyncio.run(sender.send(gone, HEAD, memoryview(STATE)))
        assert not asyncio.run(sender.send(gone, HEAD, memoryview(STATE)))
    warnings = [r for r in caplog.records if "object store from now on" in r.getMessage()]
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
