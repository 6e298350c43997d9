"""Per-request CPU work a replica hands to a few threads of its own, off its event loop.

Checking a request scans its token ids and parses its grammar; announcing it and looking
up peers hash its prompt when it came without the gateway's hashes;
estimating local reuse compares it with every stored checkpoint.
Each grows with the request, and on the event loop it would hold up every other request,
stream and index write of the replica. The pool is bounded (and separate from the loop's
default executor, which long waits such as `Engine.wait_idle` occupy).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from baton_serve.cache_store.wire.protocol import ReplicaRequest
from baton_serve.replicas.engine.checkpoint_policy import MIN_PIECE
from baton_serve.replicas.engine.engine_face import EngineFace
from baton_serve.replicas.engine.request_handle import RequestHandle
from baton_serve.replicas.index_publisher import IndexPublisher

T = TypeVar("T")
THREADS = 2


class OffLoop:
    """A bounded thread pool for blocking calls made on behalf of requests."""

    def __init__(self, threads: int = THREADS, name: str = "baton-off-loop") -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)

    async def run(
        self,
        fn: Callable[..., T],
        *args: object,
        on_abandoned: Callable[[T], None] | None = None,
    ) -> T:
        """`fn(*args)` in the pool (in the caller's context). A caller cancelled meanwhile
        does not stop the call: once it returns, its result goes to `on_abandoned`, so what
        it started (a queued request) is undone rather than leaked."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        future = self._pool.submit(call)
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            if on_abandoned is not None:
                future.add_done_callback(functools.partial(_undo, on_abandoned))
            raise

    def close(self) -> None:
        """Stop taking work; calls not started yet are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _undo(on_abandoned: Callable[[T], None], future: Future[T]) -> None:
    if not future.cancelled() and future.exception() is None:
        on_abandoned(future.result())


async def submit(
    off_loop: OffLoop, engine: EngineFace, publisher: IndexPublisher, request: ReplicaRequest
) -> RequestHandle:
    """Queue `request` on `engine` and announce it to the index, in `off_loop`'s threads
    (checking it scans its token ids and parses its grammar; announcing it may hash it).
    A caller gone meanwhile leaves nothing behind: the queued request is cancelled and its
    announcement withdrawn."""

    def queue() -> RequestHandle:
        handle = engine.submit(request.generation, request.prefix_hashes)
        try:
            publisher.announce(request)
        except BaseException:
            handle.cancel()
            raise
        return handle

    def abandoned(handle: RequestHandle) -> None:
        handle.cancel()
        publisher.announced_done(request)

    return await off_loop.run(queue, on_abandoned=abandoned)


def lookup_chain(
    engine: EngineFace, tokens: tuple[int, ...], carried: tuple[bytes, ...]
) -> list[bytes]:
    """The block hashes to ask the index about for `tokens` (all but the piece the engine
    always computes itself): the gateway's chain (`carried`, computed once per request) cut
    to them, or — for a request that came without it — hashed here (blocking then)."""
    usable = max(len(tokens) - MIN_PIECE, 0)
    return engine.hash_chain(tokens[:usable], engine.carried_chain(tokens, carried))
