"""Liveness: no request waits on the engine forever, and a stuck engine loop is noticed.

A request's deadline is generous on purpose: its queue allowance (`max_queue_s`) plus its
own tokens — the prompt and every choice's reply — at `floor_tokens_per_s`, a pace any
working engine beats. It fires only when the engine is stuck or pathologically slow; the
waiter then cancels the request and raises `EngineTimeout`.

The heartbeat is when the engine loop last completed a step or, idle, last looked for work
(at least every `IDLE_BEAT_S`). Work waiting on a loop silent for longer than
`stall_timeout_s` makes the engine unhealthy (`EngineStalled`), so Serve replaces it.
"""

from __future__ import annotations

import time

from baton_serve.cache_store.wire.protocol import EngineStalled, GenerationRequest
from baton_serve.replicas.engine.engine_config import EngineConfig

IDLE_BEAT_S = 1.0  # an idle engine loop wakes this often to beat


def request_deadline_s(request: GenerationRequest, n_ctx: int, config: EngineConfig) -> float:
    """Seconds `request` may take from submission to completion before it is cancelled."""
    n_prompt = len(request.prompt)
    reply = max(0, min(request.sampling.max_tokens, n_ctx - n_prompt))
    return config.max_queue_s + (n_prompt + request.n * reply) / config.floor_tokens_per_s


class Heartbeat:
    """When the engine loop last showed it is alive (written by the loop, read anywhere)."""

    def __init__(self, stall_timeout_s: float) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.last = time.monotonic()

    def beat(self) -> None:
        self.last = time.monotonic()

    def check(self, pending: int) -> None:
        """Raise `EngineStalled` if `pending` (> 0) requests wait on a loop that has been
        silent for more than `stall_timeout_s`."""
        silent = time.monotonic() - self.last
        if pending and silent > self.stall_timeout_s:
            raise EngineStalled(
                f"the engine loop has not completed a step for {silent:.1f} s "
                f"(stall_timeout_s is {self.stall_timeout_s:g}) while {pending} request(s) "
                "are queued or running"
            )
