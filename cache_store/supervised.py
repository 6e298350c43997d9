"""Background loops that never die silently: an exception is logged and the loop starts
again after a pause that doubles with each failure in a row, up to a cap.

The index followers, the replica's index publisher and its gauges, and the router's copy of
the index all run under `supervised`. It lives in the lowest room, so every room may use it.
A loop ends only when cancelled; a coroutine that returns ends its supervision (its work is
done).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

logger = logging.getLogger("baton.background")


@dataclass(frozen=True)
class Backoff:
    """Pauses before a restart: `first_s`, doubled per failure in a row, at most `max_s`."""

    first_s: float = 0.1
    max_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ValueError(f"backoff needs 0 < first_s <= max_s, got {self}")

    def pause_s(self, failures: int) -> float:
        """The pause after the `failures`-th failure in a row (1, 2, …)."""
        return min(self.first_s * 2.0 ** (failures - 1), self.max_s)


async def run_supervised(
    name: str, factory: Callable[[], Awaitable[None]], backoff: Backoff = Backoff()
) -> None:
    """Run `factory()` until it returns or this is cancelled; restart it after any exception.

    A run that lasted at least `backoff.max_s` counts as healthy: the next failure pauses
    `backoff.first_s` again."""
    failures = 0
    while True:
        started = time.monotonic()
        try:
            await factory()
            return
        except Exception:
            if time.monotonic() - started >= backoff.max_s:
                failures = 0
            failures += 1
            pause = backoff.pause_s(failures)
            logger.exception(
                "background task %r failed (%d in a row); restarting in %g s",
                name,
                failures,
                pause,
                extra={"task": name, "failures": failures},
            )
            await asyncio.sleep(pause)


def supervised(
    name: str, factory: Callable[[], Awaitable[None]], backoff: Backoff = Backoff()
) -> asyncio.Task[None]:
    """`run_supervised` as a task on the running loop, named `name` (cancel it to stop)."""
    return asyncio.get_running_loop().create_task(run_supervised(name, factory, backoff), name=name)
