"""Each API request on the gateway: its id, its root span, its count by status, its log line.

An ASGI middleware, outermost, so the span covers authentication and the whole response
(a stream included). A client's own `traceparent` header is continued. Only paths under
`/v1/` are observed: health probes would drown everything else.
"""

from __future__ import annotations

import logging
import time
import uuid

from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baton_serve.cache_store.telemetry import metrics, tracing
from baton_serve.cache_store.telemetry.logs import bind_request
from baton_serve.router.gateway.asgi_path import app_path

logger = logging.getLogger("baton.gateway")

OBSERVED_PREFIX = "/v1/"
ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models"})

REQUESTS = metrics.Counter(
    "baton_requests",
    "API requests answered by the gateway, by endpoint and HTTP status",
    ("endpoint", "status"),
)


class HTTPTelemetry:
    """Gives each API request an id (bound for its log lines), a root span, a count in
    `baton_requests` and one log line when it has been answered."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not app_path(scope).startswith(OBSERVED_PREFIX):
            await self._app(scope, receive, send)
            return
        # Bound for the rest of this request's task: Starlette's handler of unexpected
        # errors logs outside this middleware, and that line must name the request too.
        request_id = uuid.uuid4().hex
        bind_request(request_id)
        method, path = scope["method"], app_path(scope)
        endpoint = path if path in ENDPOINTS else "other"
        span = tracing.start_span(
            f"{method} {endpoint}",
            parent=tracing.extract(Headers(scope=scope)),
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": method,
                "url.path": path,
                "baton.request_id": request_id,
            },
        )
        status = 500  # unless the app answers
        started = time.perf_counter()

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        with tracing.current(span):  # the log line below names it too
            try:
                await self._app(scope, receive, sending)
            except BaseException as exc:
                tracing.fail(span, exc)
                raise
            finally:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                span.end()
                REQUESTS.inc(endpoint=endpoint, status=str(status))
                _log_answered(method, path, status, time.perf_counter() - started)


def _log_answered(method: str, path: str, status: int, seconds: float) -> None:
    duration_ms = round(1000 * seconds, 1)
    fields = {"method": method, "path": path, "status": status, "duration_ms": duration_ms}
    logger.info("%s %s %d in %.1f ms", method, path, status, duration_ms, extra=fields)
