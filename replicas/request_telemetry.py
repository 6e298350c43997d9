"""What a replica records about each request it serves: its spans, metrics and log line.

The engine thread only takes timestamps (`Completion.timings`); the spans of its phases —
queue, restore, prefill, decode — are made here afterwards, with their measured start and
end times, so tracing costs the engine loop nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import TracebackType

from opentelemetry.trace import SpanKind

from baton_serve.cache_store.telemetry import metrics, tracing
from baton_serve.cache_store.telemetry.logs import request_fields, span_fields
from baton_serve.cache_store.wire.protocol import Completion, ReplicaRequest

logger = logging.getLogger("baton.replica")


class RequestTelemetry:
    """Opened when a request reaches the replica, `finished` with its completion; leaving
    the block without one (an error, a client gone) ends its span as such."""

    def __init__(self, request: ReplicaRequest, replica_id: str) -> None:
        self.request_id = request.generation.request_id
        self.replica_id = replica_id
        self._arrived = time.perf_counter()
        self._submitted = self._arrived
        self._submitted_ns = time.time_ns()
        self.span = tracing.start_span(
            "replica",
            parent=tracing.extract(request.trace_context),
            kind=SpanKind.SERVER,
            attributes={
                "baton.request_id": self.request_id,
                "baton.replica": replica_id,
                "baton.prompt_tokens": len(request.generation.prompt),
            },
        )
        self.context = tracing.context_of(self.span)  # the parent of this request's spans
        self._ended = False

    def __enter__(self) -> RequestTelemetry:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._ended:
            return
        if isinstance(exc, GeneratorExit | asyncio.CancelledError):
            self.span.set_attribute("baton.cancelled", True)  # the caller went away
        elif exc is not None:
            tracing.fail(self.span, exc)
            logger.info("failed: %s", type(exc).__name__, extra=request_fields(self.request_id))
        self._end()

    def submitting(self) -> None:
        """Call just before the request is handed to the engine (its timings start there)."""
        self._submitted = time.perf_counter()
        self._submitted_ns = time.time_ns()

    def finished(self, done: Completion) -> None:
        usage, timings = done.usage, done.timings
        metrics.PROMPT_TOKENS.inc(usage.prompt_tokens)
        metrics.CACHED_TOKENS.inc(usage.cached_tokens)
        metrics.COMPUTED_TOKENS.inc(usage.computed_tokens)
        metrics.GENERATED_TOKENS.inc(usage.completion_tokens)
        ttft_s = None
        if done.ttft_s is not None:
            engine_s = timings.queued_s + timings.restore_s + timings.prefill_s
            ttft_s = self._submitted - self._arrived + engine_s
            metrics.TTFT.observe(ttft_s)
        if self.span.is_recording():
            self._engine_spans(done)
            self.span.set_attributes(
                {
                    "baton.finish_reason": done.finish_reason,
                    "baton.cached_tokens": usage.cached_tokens,
                    "baton.completion_tokens": usage.completion_tokens,
                }
            )
        duration_ms = round(1000 * (time.perf_counter() - self._arrived), 1)
        ttft_ms = None if ttft_s is None else round(1000 * ttft_s, 1)
        logger.info(
            "%s: %d prompt tokens (%d cached), %d generated, first token after %s ms",
            done.finish_reason,
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.completion_tokens,
            ttft_ms,
            extra={
                **request_fields(self.request_id),
                **span_fields(self.span),
                "replica": self.replica_id,
                "finish_reason": done.finish_reason,
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.cached_tokens,
                "computed_tokens": usage.computed_tokens,
                "completion_tokens": usage.completion_tokens,
                "ttft_ms": ttft_ms,
                "duration_ms": duration_ms,
            },
        )
        self._end()

    def _engine_spans(self, done: Completion) -> None:
        timings, usage = done.timings, done.usage
        generated = usage.completion_tokens
        decode_rate = (generated - 1) / timings.decode_s if timings.decode_s > 0 else 0.0
        phases = [
            ("queue", timings.queued_s, {}),
            ("restore", timings.restore_s, {"baton.tokens_restored": usage.cached_tokens}),
            ("prefill", timings.prefill_s, {"baton.tokens_computed": usage.computed_tokens}),
        ]
        if done.ttft_s is not None:
            decode = {"baton.tokens_generated": generated, "baton.tokens_per_s": decode_rate}
            phases.append(("decode", timings.decode_s, decode))
        start = self._submitted_ns
        for name, seconds, attributes in phases:
            end = start + int(seconds * 1e9)
            tracing.record_span(
                name, parent=self.context, start_ns=start, end_ns=end, attributes=attributes
            )
            start = end

    def _end(self) -> None:
        self._ended = True
        self.span.end()
