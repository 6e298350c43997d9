"""A replica's stream to the gateway as batches: one Ray message for all that is ready.

Each item a Serve streaming call yields is one message over gRPC, and on a busy machine each
costs the replica and the gateway more CPU than the work it carries: a one-token reply was three
messages (`Admitted`, the token, the `Completion`). `batches` reads the stream in a task of
its own and hands the caller a list of every item that arrived while the caller was busy (the
last token and the `Completion` usually come together; tokens that waited while Ray sent the
previous message go in one), never waiting for an item that has not come. The gateway reads
each list item by item. An exception from the stream is raised to the caller after the
items before it; a caller that stops early stops the stream, whose own clean-up (cancelling the
generation) then runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import TypeVar, cast

T = TypeVar("T")

_END = object()


async def batches(stream: AsyncGenerator[T, None]) -> AsyncGenerator[list[T], None]:
    """`stream`'s items, each list holding those that were ready at once (at least one)."""
    ready: asyncio.Queue[object] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in stream:
                ready.put_nowait(item)
        except (Exception, asyncio.CancelledError) as exc:  # raised to the caller, in order
            ready.put_nowait(_Failed(exc))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            ready.put_nowait(_END)

    reader = asyncio.create_task(pump())
    try:
        while True:
            batch, end = [await ready.get()], None
            while not ready.empty():
                batch.append(ready.get_nowait())
            items = []
            for item in batch:
                if item is _END or isinstance(item, _Failed):
                    end = item  # the stream's last: nothing the caller needs comes after it
                    break
                items.append(item)
            if items:
                yield cast(list[T], items)
            if isinstance(end, _Failed):
                raise end.error
            if end is _END:
                return
    finally:
        if not reader.done():
            reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error
