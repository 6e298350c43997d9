"""The caller's side of a submitted request: a token stream and a completion."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

from baton_serve.replicas.engine.protocol import (
    Completion,
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

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.submitted_at = time.perf_counter()
        self._done = threading.Event()
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._history: list[object] = []  # replayed to readers that join late
        self._readers: list[Callable[[object], None]] = []
        self._choices: dict[int, Completion] = {}
        self.cancelled = False

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop generating; the engine frees the slot at its next step."""
        self.cancelled = True

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the completion; raises the engine's error if the request failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request.request_id} is still running")
        if self._error is not None:
            raise self._error
        assert self._completion is not None
        return self._completion

    def __iter__(self) -> Iterator[TokenEvent]:
        events: queue.Queue[object] = queue.Queue()
        self._add_reader(events.put)
        while (item := events.get()) is not _DONE:
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
        while (item := await events.get()) is not _DONE:
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
        self._completion, self._error = completion, error
        self._done.set()
        self._publish(_DONE)

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
