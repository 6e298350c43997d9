"""OpenTelemetry tracing for Baton's processes: set up from the standard `OTEL_*` variables.

Off unless asked for: `OTEL_TRACES_EXPORTER` (`otlp`, `console`, or both, comma-separated;
`none` turns it off), or else an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT` /
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) turns OTLP over HTTP on. While off, every helper
here returns at once and no span object is made.

Trace context crosses processes as a W3C carrier (`traceparent`, `tracestate`): the
gateway injects it into `ReplicaRequest.trace_context`; the router and the replica
extract it. Spans are never made current across an `await` that may change task (the
replica streams from an async generator), so parents are passed explicitly.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

logger = logging.getLogger("baton.tracing")

SERVICE = "baton"
OTLP_ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
OTLP_PROTOCOLS = ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")

Attributes = Mapping[str, AttributeValue]

_tracer: trace.Tracer | None = None


def configure_tracing(component: str) -> bool:
    """Trace this process as `component` (gateway, replica) if its environment asks for it;
    True when tracing is on. Safe to call again: the first call decides."""
    if _tracer is not None:
        return True
    processors = span_processors(os.environ)
    if not processors:
        return False
    resource = Resource.create({"baton.component": component, "process.pid": os.getpid()})
    if resource.attributes.get(SERVICE_NAME, "").startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: SERVICE}))
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    for processor in processors:
        provider.add_span_processor(processor)
    use_provider(provider)
    return True


def span_processors(env: Mapping[str, str]) -> list[SpanProcessor]:
    """The span processors `env` asks for (empty: tracing stays off)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")]
    names = [n for n in names if n]
    if not names and any(env.get(name) for name in OTLP_ENDPOINTS):
        names = ["otlp"]
    processors: list[SpanProcessor] = []
    for name in names:
        if name == "otlp":
            processors.append(BatchSpanProcessor(_otlp_exporter(env)))
        elif name == "console":
            processors.append(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stdout)))
        elif name != "none":
            logger.warning("unknown trace exporter %r in OTEL_TRACES_EXPORTER; ignored", name)
    return processors


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    for name in OTLP_PROTOCOLS:
        protocol = env.get(name, "http/protobuf")
        if protocol != "http/protobuf":
            logger.warning("%s=%s: Baton exports OTLP over http/protobuf only", name, protocol)
    return OTLPSpanExporter()  # endpoint, headers, timeout, ... from the OTEL_* variables


def use_provider(provider: TracerProvider | None) -> None:
    """Send this process's spans to `provider` (None: tracing off)."""
    global _tracer
    _tracer = None if provider is None else provider.get_tracer(SERVICE)


def inject() -> dict[str, str]:
    """The W3C carrier of the current trace context; empty while off."""
    carrier: dict[str, str] = {}
    if _tracer is not None:
        propagate.inject(carrier)
    return carrier


def extract(carrier: Mapping[str, str]) -> Context | None:
    """The context a carrier (or HTTP headers) holds; None while off or when it holds none."""
    if _tracer is None or not carrier:
        return None
    return propagate.extract(carrier)


def start_span(
    name: str,
    *,
    parent: Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes | None = None,
    start_ns: int | None = None,
) -> Span:
    """A started span (end it yourself); `parent` None means the current context."""
    if _tracer is None:
        return INVALID_SPAN
    return _tracer.start_span(
        name, context=parent, kind=kind, attributes=attributes, start_time=start_ns
    )


@contextmanager
def span(
    name: str,
    *,
    parent: Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes | None = None,
) -> Iterator[Span]:
    """A span for the block, not made current; an exception marks it failed."""
    opened = start_span(name, parent=parent, kind=kind, attributes=attributes)
    try:
        yield opened
    except BaseException as exc:
        fail(opened, exc)
        raise
    finally:
        opened.end()


def record_span(
    name: str, *, parent: Context | None, start_ns: int, end_ns: int, attributes: Attributes
) -> None:
    """A span measured elsewhere (e.g. on the engine thread), from its start and end times."""
    if _tracer is not None:
        start_span(name, parent=parent, attributes=attributes, start_ns=start_ns).end(end_ns)


@contextmanager
def current(active: Span) -> Iterator[None]:
    """Make `active` the current span for the block (which must not change task)."""
    if _tracer is None:
        yield
        return
    with trace.use_span(
        active, end_on_exit=False, record_exception=False, set_status_on_exception=False
    ):
        yield


def context_of(parent: Span) -> Context | None:
    """A context whose span is `parent`, for its children; None while off."""
    return None if _tracer is None else trace.set_span_in_context(parent)


def fail(failed: Span, exc: BaseException) -> None:
    """Mark `failed` as ended by `exc`."""
    if failed.is_recording():
        failed.record_exception(exc)
        failed.set_status(Status(StatusCode.ERROR, type(exc).__name__))
