"""How late a replica's event loop runs.

A task sleeps a short period again and again and records how much later than asked it
woke: that lateness is time the loop spent on something else (a blocking call, a long
computation) while every request, stream and index write on it waited.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

PERIOD_S = 0.01
WINDOW = 6000  # samples kept: about the last minute at PERIOD_S


@dataclass(frozen=True)
class LoopLag:
    """The loop's stalls over the recent samples, in milliseconds."""

    max_ms: float
    p99_ms: float
    samples: int


class LoopLagMonitor:
    """Measures the event loop it is started on; `snapshot()` reads it from that loop."""

    def __init__(self, period_s: float = PERIOD_S, window: int = WINDOW) -> None:
        self.period_s = period_s
        self._late_s = np.zeros(window)
        self._count = 0

    def start(self) -> asyncio.Task[None]:
        """Start measuring on the running loop; the task to cancel at close."""
        return asyncio.create_task(self._run(), name="baton-loop-lag")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(self.period_s)
            self.record(loop.time() - asked - self.period_s)

    def record(self, late_s: float) -> None:
        """One wake-up `late_s` seconds after it was due."""
        self._late_s[self._count % self._late_s.size] = max(0.0, late_s)
        self._count += 1

    def snapshot(self) -> LoopLag:
        """The longest stall and the 99th percentile of the recent samples."""
        recent = self._late_s[: min(self._count, self._late_s.size)]
        if not recent.size:
            return LoopLag(0.0, 0.0, 0)
        return LoopLag(
            max_ms=float(recent.max()) * 1e3,
            p99_ms=float(np.percentile(recent, 99)) * 1e3,
            samples=int(recent.size),
        )
