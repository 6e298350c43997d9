"""Where a Baton request's time goes, from its own trace spans.

Baton traces a request when its processes are started with OTLP tracing on (the standard
`OTEL_*` variables, `cache_store.telemetry.tracing`). `SpanReceiver` is a minimal OTLP/HTTP
collector in the benchmark's process; the client sends each request with its own W3C
`traceparent`, so every span of a request is found by the trace id the client chose.
`breakdown` then cuts the client's TTFT into the spans that cover it:

proxy (client → HAProxy → the gateway's root span), gateway (auth, tokenise, hash:
to the `route` span), router (`route`: the index lookup and the choice), to replica (the
routed call over Ray until the replica's span opens), replica (pull and the engine's hand-
over: to the `queue` span), queue, restore, prefill (the engine's own timings) and first
token out (the prefill's end → the client reads the first token); then the engine's decode
step (`decode` / generated tokens) against the inter-token latency the client sees.
"""

from __future__ import annotations

import contextlib
import gzip
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from baton_serve.deploy.ports import free_port

GATEWAY_ROOT = "POST /v1/chat/completions"
TTFT_PARTS = (
    "proxy",
    "gateway",
    "router",
    "to_replica",
    "replica",
    "queue",
    "restore",
    "prefill",
    "first_token_out",
)
NEEDED = (GATEWAY_ROOT, "route", "replica", "queue", "restore", "prefill", "decode")
Spans = dict[str, tuple[int, int]]  # span name → (start ns, end ns), the first of each name


class SpanReceiver:
    """An OTLP/HTTP trace collector on 127.0.0.1; `env` points Baton's processes at it."""

    def __init__(self) -> None:
        self.port = free_port()
        self._lock = threading.Lock()
        self._traces: dict[str, Spans] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver._add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *_: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)

    @property
    def env(self) -> dict[str, str]:
        return {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{self.port}/v1/traces",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_BSP_SCHEDULE_DELAY": "200",  # ms: spans arrive soon after a request ends
        }

    @contextlib.contextmanager
    def running(self) -> Iterator[SpanReceiver]:
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()

    def _add(self, request: ExportTraceServiceRequest) -> None:
        with self._lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        spans = self._traces.setdefault(span.trace_id.hex(), {})
                        times = (span.start_time_unix_nano, span.end_time_unix_nano)
                        spans.setdefault(span.name, times)

    def spans(self, trace_id: str) -> Spans:
        with self._lock:
            return dict(self._traces.get(trace_id, {}))

    def wait_for(self, trace_ids: list[str], timeout_s: float = 15.0) -> None:
        """Until every trace has each span the breakdown needs (or the time is up): each
        process exports its spans in its own batches."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(set(NEEDED) <= set(self.spans(t)) for t in trace_ids):
                return
            time.sleep(0.1)


def request_parts(
    spans: Spans, sent_ns: int, first_token_ns: int, completion_tokens: int
) -> dict[str, float] | None:
    """One request's TTFT cut into `TTFT_PARTS`, and its engine decode step, in seconds;
    None when a span is missing (tracing off, or the spans did not all arrive)."""
    if any(name not in spans for name in NEEDED[:-1]):  # a reply of one token has no decode
        return None
    marks = [
        sent_ns,
        spans[GATEWAY_ROOT][0],
        spans["route"][0],
        spans["route"][1],
        spans["replica"][0],
        spans["queue"][0],
        spans["restore"][0],
        spans["prefill"][0],
        spans["prefill"][1],
        first_token_ns,
    ]
    parts = {
        name: (b - a) / 1e9 for name, a, b in zip(TTFT_PARTS, marks[:-1], marks[1:], strict=True)
    }
    decode = spans.get("decode")
    if decode and completion_tokens > 1:
        parts["decode_step"] = (decode[1] - decode[0]) / 1e9 / (completion_tokens - 1)
    return parts


def breakdown(rows: list[dict[str, float]]) -> dict[str, float]:
    """p50 of each part over the requests that have it, in seconds."""
    names = [*TTFT_PARTS, "decode_step"]
    medians = {}
    for name in names:
        values = [row[name] for row in rows if name in row]
        if values:
            medians[name] = float(np.percentile(values, 50))
    return medians
