"""Fault isolation in the engine loop: one request's failing work ends that request only.

Starting a request (placing it: evicting, saving and restoring states), sampling its
tokens, copying its prompt's state to its other choices and saving its checkpoints are that
request's own work. An exception there fails that request with an `EngineError` naming what
failed (the cause goes to the log), empties the slots whose state it may have left
half-changed, and the loop goes on serving everyone else. Only a failed decode of a shared
batch fails the requests in that batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from baton_serve.cache_store.telemetry.logs import request_fields
from baton_serve.cache_store.wire.protocol import EngineError
from baton_serve.replicas.engine.llama_context import BatchEntry, DecodeError, LlamaContext
from baton_serve.replicas.engine.request_handle import RequestHandle
from baton_serve.replicas.engine.slots import Running, Slot
from baton_serve.replicas.engine.stats import EngineStats

logger = logging.getLogger("baton.engine")


class StepGuard:
    """Runs requests' shares of an engine step so that a fault ends only its request."""

    def __init__(self, context: LlamaContext, stats: EngineStats) -> None:
        self._context = context
        self._stats = stats

    def run(self, what: str, run: Running, work: Callable[..., Any], *args: Any) -> bool:
        """`work(*args)`, done for `run` alone; if it raises, fail `run`'s request. True if
        it succeeded."""
        try:
            work(*args)
        except Exception as exc:
            self.fail(run, self._fault(what, run.handle, exc))
            return False
        return True

    def start(
        self, handle: RequestHandle, free: Sequence[Slot], work: Callable[..., Any], *args: Any
    ) -> bool:
        """`work(*args)` starts `handle`'s request in some of the `free` slots; if it raises,
        end the request with an error and empty those slots. True if it started."""
        try:
            work(*args)
        except Exception as exc:
            for slot in free:  # which of them the fault left half-changed is unknown
                if slot.running is not None:
                    slot.running.sampler.close()
                self._empty(slot)
            self.refuse(handle, "starting", exc)
            return False
        return True

    def refuse(self, handle: RequestHandle, what: str, exc: Exception) -> None:
        """End a request that holds no slot (it leaves the queue at the next step)."""
        handle.cancelled = True
        handle.finish(None, self._fault(what, handle, exc))

    def decode(
        self, entries: list[BatchEntry], runs: Sequence[Running]
    ) -> dict[int, np.ndarray] | None:
        """Decode one shared batch; return logits by batch index. If that fails, fail every
        request of `runs` (their states are all unknown now) and return None."""
        try:
            return self._context.decode_rows(entries)
        except Exception as exc:
            ids = ",".join(run.handle.request.request_id for run in runs)
            logger.error(
                "decoding a batch failed (%s); failing %d request(s)",
                exc,
                len(runs),
                exc_info=not isinstance(exc, DecodeError),
                extra=request_fields(ids),
            )
            message = str(exc) if isinstance(exc, DecodeError) else f"decoding failed: {exc!r}"
            self.fail_all(runs, EngineError(message))
            return None

    def fail(self, run: Running, error: EngineError) -> None:
        """Fail one request; its slot's state is unknown, so it is emptied."""
        run.sampler.close()
        run.handle.cancelled = True  # its other choices (n > 1) stop at the next step
        run.handle.finish(None, error)
        self._empty(run.slot)

    def fail_all(self, runs: Sequence[Running], error: EngineError) -> None:
        for run in runs:
            self.fail(run, error)

    def _empty(self, slot: Slot) -> None:
        self._context.clear(slot.seq_id)
        slot.empty()
        slot.release()

    def _fault(self, what: str, handle: RequestHandle, exc: Exception) -> EngineError:
        request_id = handle.request.request_id
        self._stats.request_faults += 1
        logger.error(
            "request %s failed while %s; only it is ended",
            request_id,
            what,
            exc_info=exc,
            extra=request_fields(request_id),
        )
        return EngineError(f"request {request_id} failed while {what}: {exc!r}")
