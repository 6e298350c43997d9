"""What a state stream may announce, against the pulling replica's own model: a real engine's
largest state bounds every state it saves (a sliding window's too); a live ticket announcing
more — 8 GiB, or one byte over — is refused before any buffer is taken (the process's peak
memory does not move) and the pull computes its prefix instead; a real blob still streams."""

from __future__ import annotations

import asyncio
import logging
import resource
import select
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from baton_serve.cache_store.pull_cost import ShipCost
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import Completion, GenerationRequest, ReplicaRequest
from baton_serve.cache_store.wire.route_plan import RoutePlan
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.models.tiny_model import ModelVariant, write_tiny_model
from baton_serve.replicas.replica import Replica
from baton_serve.replicas.shipping import ShipPolicy, fetch_offering_stream
from baton_serve.replicas.state_stream import (
    _PREFIX,
    STREAMED,
    StateReceiver,
    StreamOffer,
    StreamRefused,
    StreamSender,
)
from baton_serve.replicas.stream_limits import StreamLimits

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
# The tiny model prefills thousands of tokens a second: any gain is worth a pull.
EAGER = ShipPolicy(ShipCost(min_gain_tokens=16, safety=1.0), prefill_tokens_per_s=50.0)
EIGHT_GIB = 8 << 30


def _prompt(engine: Engine, n_tokens: int, seed: int = 0) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(t) for t in rng.integers(1, engine.model.n_vocab, n_tokens))


def _limits(engine: Engine) -> StreamLimits:
    return StreamLimits.for_model(engine.n_ctx, engine.largest_state_bytes)


@pytest.mark.parametrize("arch", ["llama", "lfm2-swa", "qwen35", "mamba2"])
def test_the_largest_state_bounds_every_state_the_engine_saves(
    arch: str, tiny_model, make_engine, tmp_path: Path
) -> None:
    """A prompt filling the context, its state exported: never larger than the bound (exact
    for attention; a sliding window of 32 stops growing long before 256 tokens)."""
    if arch == "lfm2-swa":
        path = write_tiny_model(
            "lfm2", tmp_path / "swa.gguf", variant=ModelVariant(sliding_window=32)
        )
    else:
        path = tiny_model(arch)
    engine = make_engine(path, n_ctx=256)
    tokens = _prompt(engine, engine.n_ctx - 8)
    done = engine.generate(Prompt(tokens=tokens), GREEDY)
    assert engine.wait_idle(10)  # the conversation stored once the engine is idle
    (_, state), _ = engine.export_best(tokens + tuple(done.tokens))
    assert 0 < len(state) <= engine.largest_state_bytes
    if engine.state_size is not None:  # linear: the bound is a full context's exact size
        assert engine.largest_state_bytes == engine.state_bytes(engine.n_ctx)


def _peak_rss() -> int:
    """The most memory this process has held at once, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10


def _announce(offer: StreamOffer, head_len: int, state_len: int) -> bool:
    """Send a pull's ticket with these lengths, as a lying peer would; True if the receiver
    hung up (within 5 s) without reading on."""
    with socket.create_connection((offer.host, offer.port), timeout=5) as conn:
        conn.sendall(_PREFIX.pack(offer.ticket, head_len, state_len))
        if not select.select([conn], [], [], 5.0)[0]:
            return False
        try:
            return conn.recv(1) == b""
        except ConnectionResetError:
            return True


def test_a_forged_announcement_is_refused_before_any_buffer_is_taken(
    tiny_model, make_engine, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(tiny_model("llama"))
    limits = _limits(engine)
    receiver = StateReceiver(limits, host="127.0.0.1", node_id="puller-node")
    try:
        for head_len, state_len in (
            (1 << 10, EIGHT_GIB),
            (1 << 10, limits.max_state_bytes + 1),
            (limits.max_head_bytes + 1, 1 << 10),
        ):
            peak = _peak_rss()
            offer, received = receiver.offer()
            with caplog.at_level(logging.WARNING, logger="baton.state_stream"):
                assert _announce(offer, head_len, state_len)
                with pytest.raises(StreamRefused, match="largest blob") as refused:
                    received.result(timeout=10)
            assert f"{limits.max_state_bytes}-byte state" in str(refused.value)
            assert f"a {state_len}-byte state" in caplog.records[-1].getMessage()
            assert _peak_rss() - peak < 64 << 20
        # The receiver is still there for a real blob at the bound.
        offer, received = receiver.offer()
        state = np.zeros(limits.max_state_bytes, dtype=np.uint8)
        asyncio.run(StreamSender(node_id="holder-node").send(offer, b"head", memoryview(state)))
        assert received.result(timeout=10)[1].nbytes == limits.max_state_bytes
    finally:
        receiver.close()


class _StreamingPeers:
    """Peers reached in this process, each answering a pull as a replica does: over the
    puller's real stream (`fetch_offering_stream` and its real receiver). "donor" is a real
    replica; "liar" announces an 8 GiB state under the pull's ticket and says it streamed —
    a fault no real replica produces (one sends the blob its engine signed), standing in for
    a broken or compromised peer."""

    def __init__(self, donor: Replica, limits: StreamLimits) -> None:
        self.donor = donor
        self.receiver = StateReceiver(limits, host="127.0.0.1", node_id="taker-node")

    async def fetch(self, replica_id, tokens, min_tokens, wait_s=0.0):
        async def ask(offer: StreamOffer):
            if replica_id == "liar":
                await asyncio.to_thread(_announce, offer, 1 << 10, EIGHT_GIB)
                return STREAMED
            return await self.donor.export_when_ready(tuple(tokens), min_tokens, wait_s, offer)

        return await fetch_offering_stream(self.receiver, ask)

    async def offer(self, replica_id, blob) -> bool:
        return False


def _pulling(tokens: tuple[int, ...], donor: str, donor_tokens: int) -> ReplicaRequest:
    plan = RoutePlan(
        replica_id="taker", kind="pull", donor_id=donor, donor_tokens=donor_tokens, ready_at=0.0
    )
    generation = GenerationRequest(prompt=Prompt(tokens=tokens), sampling=GREEDY)
    return ReplicaRequest(generation=generation, plan=plan)


def test_a_refused_stream_costs_the_pull_not_the_request(tiny_model, make_engine) -> None:
    """The same prompt pulled from a real donor over a real stream (imported, served from
    it), and from a liar: refused unread, computed here instead, the same answer."""
    path = tiny_model("llama")
    donor_engine, taker_engine, liar_taker_engine, scratch = (make_engine(path) for _ in range(4))
    donor = Replica("donor", donor_engine)
    donor.streams = StreamSender(node_id="donor-node")  # another node: it streams
    system = _prompt(donor_engine, 300)
    donor_engine.generate(Prompt(tokens=system), GREEDY)
    assert donor_engine.wait_idle(10)
    tokens = system + _prompt(donor_engine, 20, seed=1)
    reference = scratch.generate(Prompt(tokens=tokens), GREEDY)

    async def pull(engine: Engine, donor_id: str) -> tuple[Completion, Replica, float]:
        peers = _StreamingPeers(donor, _limits(engine))
        taker = Replica("taker", engine, peers=peers, policy=EAGER)
        try:
            started = time.monotonic()
            done = await taker.generate(_pulling(tokens, donor_id, len(system)))
            return done, taker, time.monotonic() - started
        finally:
            peers.receiver.close()

    pulled, taker, _ = asyncio.run(pull(taker_engine, "donor"))
    assert taker.stats.pulls == 1 and donor.stats.streamed_exports == 1
    assert pulled.tokens == reference.tokens and pulled.usage.cached_tokens >= len(system)

    computed, liar_taker, seconds = asyncio.run(pull(liar_taker_engine, "liar"))
    assert liar_taker.stats.pull_failures == 1 and liar_taker.stats.pulls == 0
    assert computed.tokens == reference.tokens and computed.usage.cached_tokens == 0
    assert seconds < 5
