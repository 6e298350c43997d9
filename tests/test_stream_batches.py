"""A replica's stream to the gateway in batches (`cache_store/wire/stream_batches.py`): items
ready at once travel as one Ray message, nothing waits for an item not yet made, an error
comes after the items before it, and a caller that stops early stops the stream (its clean-up,
which cancels the generation, runs). Driven by plain async generators: what the batching
sees of `Replica.stream` is only its items and their timing, which these set exactly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from baton_serve.cache_store.wire.stream_batches import batches

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_items_ready_together_travel_together_and_none_is_waited_for() -> None:
    next_token = asyncio.Event()

    async def stream() -> AsyncGenerator[str, None]:
        yield "admitted"
        await next_token.wait()  # the generation: the caller must not wait for it
        yield "token"
        yield "completion"  # ready at the same moment as the last token

    got = []
    async for batch in batches(stream()):
        got.append(batch)
        next_token.set()
    assert got == [["admitted"], ["token", "completion"]]


async def test_an_error_comes_after_the_items_made_before_it() -> None:
    async def stream() -> AsyncGenerator[str, None]:
        yield "admitted"
        yield "token"
        raise ValueError("the engine failed")

    got = []
    with pytest.raises(ValueError, match="the engine failed"):
        async for batch in batches(stream()):
            got.extend(batch)
    assert got == ["admitted", "token"]


async def test_a_caller_that_stops_early_stops_the_stream() -> None:
    cleaned_up = asyncio.Event()

    async def stream() -> AsyncGenerator[str, None]:
        try:
            yield "admitted"
            await asyncio.sleep(3600)  # a generation the client no longer wants
            yield "never"
        finally:
            cleaned_up.set()  # Replica.stream cancels the generation here

    batched = batches(stream())
    assert await anext(batched) == ["admitted"]
    await batched.aclose()
    await asyncio.wait_for(cleaned_up.wait(), 5)


async def test_a_caller_cancelled_while_waiting_stops_the_stream() -> None:
    cleaned_up = asyncio.Event()

    async def stream() -> AsyncGenerator[str, None]:
        try:
            yield "admitted"
            await asyncio.sleep(3600)
        finally:
            cleaned_up.set()

    async def consume() -> None:
        async for _ in batches(stream()):
            pass

    consumer = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    await asyncio.wait_for(cleaned_up.wait(), 5)
