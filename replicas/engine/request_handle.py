"""The caller's side of a submitted request: a token stream and a completion.

Every wait on a handle ends by the request's deadline (`liveness.request_deadline_s`, set
by the engine): past it, the request is cancelled and the waiter gets `EngineTimeout`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton_serve.replicas.engine.prompt_media import PromptMedia
from baton_serve.cache_store.wire.protocol import (
    Completion,
    EngineTimeout,
    GenerationRequest,
    Timings,
    TokenEvent,
    Usage,
)

_DONE = object()


class RequestHandle:
    """Iterate it for `TokenEvent`s as they are generated, or wait for the `Completion`.

    Thread-safe: the engine loop feeds it, any thread may read it or cancel it.
    """

    def __init__(
        self,
        request: GenerationRequest,
        deadline_s: float | None = None,
        prefix_hashes: tuple[bytes, ...] = (),
    ) -> None:
        self.request = request
        self.prefix_hashes = prefix_hashes  # its prompt's block hash chain, if known
        self.submitted_at = time.perf_counter()
        self.deadline_s = deadline_s  # from submission; None: no deadline
        self._deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self._done = threading.Event()
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._history: list[object] = []  # replayed to readers that join late
        self._readers: list[Callable[[object], None]] = []
        self._choices: dict[int, Completion] = {}
        self.cancelled = False
        # its prompt's images and clips, prepared at submission
        self.media: PromptMedia | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop generating; the engine frees the slot at its next step."""
        self.cancelled = True

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the completion; raises the engine's error if the request failed,
        `EngineTimeout` past the request's deadline, `TimeoutError` after `timeout`."""
        left = self._left_s()
        by_deadline = left is not None and (timeout is None or left <= timeout)
        if not self._done.wait(left if by_deadline else timeout):
            if by_deadline:
                raise self._timed_out()
            raise TimeoutError(f"request {self.request.request_id} is still running")
        if self._error is not None:
            raise self._error
        assert self._completion is not None
        return self._completion

    def __iter__(self) -> Iterator[TokenEvent]:
        events: queue.Queue[object] = queue.Queue()
        self._add_reader(events.put)
        while True:
            try:
                item = events.get(timeout=self._left_s())
            except queue.Empty:
                raise self._timed_out() from None
            if item is _DONE:
                break
            yield item  # type: ignore[misc]
        if self._error is not None:
            raise self._error

    async def aiter(self) -> AsyncIterator[TokenEvent]:
        """The token stream for asyncio code; call from the event loop that will consume it.

        Events are handed over with `call_soon_threadsafe`, so no thread blocks on the stream.
        """
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[object] = asyncio.Queue()
        self._add_reader(lambda item: loop.call_soon_threadsafe(events.put_nowait, item))
        while True:
            try:
                async with asyncio.timeout(self._left_s()):  # per wait, never across a yield
                    item = await events.get()
            except TimeoutError:
                raise self._timed_out() from None
            if item is _DONE:
                break
            yield item  # type: ignore[misc]
        if self._error is not None:
            raise self._error

    async def aresult(self) -> Completion:
        """Await the completion from asyncio code."""
        async for _ in self.aiter():
            pass
        return self.result()

    def empty_completion(self, reason: str) -> Completion:
        """The completion of a request that ends before it got a slot (e.g. cancelled)."""
        n = len(self.request.prompt)
        return Completion(
            request_id=self.request.request_id,
            tokens=[],
            text="",
            finish_reason=reason,
            usage=Usage(prompt_tokens=n, cached_tokens=0, computed_tokens=0, completion_tokens=0),
            ttft_s=None,
            total_s=0.0,
            timings=Timings(queued_s=time.perf_counter() - self.submitted_at),
        )

    # Called by the engine loop only.

    def emit(self, event: TokenEvent) -> None:
        self._publish(event)

    def finish_choice(self, completion: Completion) -> None:
        """One choice is done; the request finishes with its last choice (all, in order)."""
        if self.done:
            return
        self._choices[completion.index] = completion
        if len(self._choices) == self.request.n:
            first, *rest = (self._choices[i] for i in range(self.request.n))
            self.finish(first.model_copy(update={"extra_choices": rest}))

    def finish(self, completion: Completion | None, error: BaseException | None = None) -> None:
        """End the request (only the first call counts)."""
        with self._lock:
            if self._done.is_set():
                return
            self._completion, self._error = completion, error
            self._done.set()
        self._publish(_DONE)

    def _left_s(self) -> float | None:
        """Seconds left before the deadline (never below 0); None without one."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _timed_out(self) -> EngineTimeout:
        """Cancel the request (the engine frees its slot at its next step); the error."""
        self.cancel()
        return EngineTimeout(
            f"request {self.request.request_id} did not finish within its deadline of "
            f"{self.deadline_s:.1f} s and was cancelled (the engine is stuck or far too slow)"
        )

    def _add_reader(self, deliver: Callable[[object], None]) -> None:
        """Deliver everything emitted so far, then each new item, to `deliver`."""
        with self._lock:  # under the lock: no new item can overtake the backlog
            for item in self._history:
                deliver(item)
            self._readers.append(deliver)

    def _publish(self, item: object) -> None:
        with self._lock:
            self._history.append(item)
            readers = list(self._readers)
        for deliver in readers:
            deliver(item)
