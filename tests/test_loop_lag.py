"""A replica's event loop: its stalls are measured (`replicas/loop_lag.py`), and per-request
work (token scans, grammar parsing, prompt hashing, comparing a prompt with every stored
checkpoint) runs off it (`replicas/off_loop.py`), so a burst of requests does not stall it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from baton_serve.cache_store.index.index_connect import connect_index
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import GenerationRequest, ReplicaRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.loop_lag import LoopLagMonitor
from baton_serve.replicas.off_loop import OffLoop
from baton_serve.replicas.replica import Replica
from baton_serve.router.gateway.structured_output import schema_grammar

INJECTED_S = 0.25
BURST = 16
PROMPT_TOKENS = 600
LOOSE_BOUND_MS = 200.0  # a 2-core machine shared with other tests: generous on purpose
SCHEMA = {
    "type": "object",
    "properties": {
        f"field_{i}": {"type": "array", "items": {"type": "string", "maxLength": 8}}
        for i in range(12)
    },
    "required": [f"field_{i}" for i in range(12)],
}


def test_the_monitor_reports_a_stall_injected_on_the_loop() -> None:
    async def scenario() -> tuple:
        monitor = LoopLagMonitor()
        task = monitor.start()
        await asyncio.sleep(0.2)
        quiet = monitor.snapshot()
        time.sleep(INJECTED_S)  # the injected stall: a blocking call on the loop
        await asyncio.sleep(0.05)
        task.cancel()
        return quiet, monitor.snapshot()

    quiet, stalled = asyncio.run(scenario())
    assert quiet.samples >= 5 and quiet.max_ms < 1e3 * INJECTED_S / 2
    assert stalled.max_ms >= 1e3 * INJECTED_S * 0.9
    assert stalled.samples > quiet.samples and 0 <= stalled.p99_ms <= stalled.max_ms


def test_work_moved_off_the_loop_is_undone_when_its_caller_goes_away() -> None:
    """A request cancelled while its blocking part (queuing it on the engine) still runs in
    a thread: once that returns, what it started is handed to `on_abandoned`, not leaked."""
    undone: list[str] = []

    def queue() -> str:
        time.sleep(0.2)
        return "queued request"

    async def scenario() -> None:
        pool = OffLoop()
        caller = asyncio.create_task(pool.run(queue, on_abandoned=undone.append))
        await asyncio.sleep(0.05)
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        assert undone == []  # still running in its thread
        await asyncio.sleep(0.3)
        pool.close()

    asyncio.run(scenario())
    assert undone == ["queued request"]


class _NoPeers:
    """No other replica exists in this test: the index only ever names this one, so this
    directory is never reached (a replica needs one to consult the index at all)."""

    async def fetch(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("no peer exists in this test")

    async def offer(self, *args: object) -> bool:
        raise AssertionError("no peer exists in this test")


def test_a_burst_of_requests_does_not_stall_the_replica_loop(
    tiny_model: Callable[[str], Path], make_engine: Callable[..., Engine], redis_server
) -> None:
    """Each request is checked (token ids, its grammar parsed), looked up in a real index
    (its prompt hashed, compared with every stored checkpoint) and run on a real engine."""
    engine = make_engine(tiny_model("llama"), n_slots=4)
    grammar = schema_grammar(SCHEMA)
    rng = np.random.default_rng(3)
    sampling = SamplingParams(max_tokens=4, grammar=grammar)
    requests = [
        ReplicaRequest(
            generation=GenerationRequest(
                prompt=Prompt(tokens=tuple(int(t) for t in rng.integers(10, 200, PROMPT_TOKENS))),
                sampling=sampling,
            )
        )
        for _ in range(BURST)
    ]

    async def burst() -> tuple:
        index = await connect_index(redis_server.url, engine.fingerprint)
        replica = Replica("burst", engine, index=index, peers=_NoPeers(), heartbeat_s=0.2)
        await replica.start()
        try:
            done = await asyncio.gather(*(replica.generate(r) for r in requests))
            return done, replica.loop_lag.snapshot()
        finally:
            await replica.close()
            await index.close()

    done, lag = asyncio.run(burst())
    assert all(d.usage.prompt_tokens == PROMPT_TOKENS for d in done)
    assert lag.samples > 0
    assert lag.max_ms < LOOSE_BOUND_MS, lag
