"""How the gateway runs work that could otherwise stall it: CPU-heavy prompt building on a
bounded set of threads, fan-outs that stop together, and a readiness check that never
holds `/health` up."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio.to_thread
from anyio import CapacityLimiter

T = TypeVar("T")
INLINE_TOKEN_IDS = 4096  # completion prompts of token ids only, up to this many in all


class PromptThreads:
    """Runs prompt building (template rendering, tokenising) off the event loop, at most
    `threads` at once, so one heavy body neither blocks the loop nor takes every thread."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"prompt_threads must be at least 1, not {threads}")
        self._threads = threads
        self._limiter: CapacityLimiter | None = None

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await anyio.to_thread.run_sync(functools.partial(fn, *args), limiter=self._capacity)

    async def run_within(self, timeout_s: float, fn: Callable[..., T], *args: object) -> T:
        """`run`, but once `fn` has a thread, waits for it at most `timeout_s`
        (`TimeoutError`). The thread runs on to its end (a Python thread cannot be
        stopped) without holding a place: `fn`'s inputs must be bounded so it ends soon."""
        async with self._capacity:
            with anyio.fail_after(timeout_s):
                return await anyio.to_thread.run_sync(
                    functools.partial(fn, *args), abandon_on_cancel=True
                )

    @property
    def _capacity(self) -> CapacityLimiter:
        if self._limiter is None:  # made on the loop that uses it
            self._limiter = CapacityLimiter(self._threads)
        return self._limiter

    async def run_prompts(
        self, fn: Callable[[Sequence[str | list[int]]], T], prompts: Sequence[str | list[int]]
    ) -> T:
        """`fn(prompts)` as `run` does, except for a few token ids only (at most
        `INLINE_TOKEN_IDS`): nothing to tokenise, so they are checked on the event loop;
        the thread hop cost more than the check (`baton bench gateway`'s breakdown)."""
        if any(isinstance(p, str) for p in prompts) or sum(map(len, prompts)) > INLINE_TOKEN_IDS:
            return await self.run(fn, prompts)
        return fn(prompts)


async def all_or_none(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Every call's result, in order. The first call to fail cancels the others (they would
    run on for a client that already has its error), and its error is raised; so does
    cancelling this."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()  # a no-op for those done
        await asyncio.wait(tasks)  # let the cancelled ones free what they hold
    failed = next((t for t in tasks if not t.cancelled() and t.exception() is not None), None)
    if failed is not None:
        raise failed.exception()  # type: ignore[misc]
    return [task.result() for task in tasks]


class Readiness:
    """`/health`'s view of a readiness check that may be slow (a Ray round trip to a busy
    replica): at most one check runs at a time, and an answer waits for it at most
    `wait_s`, else it is the last one known (not ready before any)."""

    def __init__(self, check: Callable[[], Awaitable[bool]], wait_s: float = 0.25) -> None:
        self._check = check
        self._wait_s = wait_s
        self._running: asyncio.Task[bool] | None = None
        self._last = False

    async def check(self) -> bool:
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._safe_check())
        running = self._running
        done, _ = await asyncio.wait({running}, timeout=self._wait_s)
        if done:
            self._last = running.result()
        return self._last

    async def _safe_check(self) -> bool:
        try:
            return bool(await self._check())
        except Exception:  # a failing check means not ready, never a failed probe
            return False
