"""Baton's log lines: text, or JSON (one object a line), each naming its request.

`BATON_LOG_FORMAT` (`text` or `json`) and `BATON_LOG_LEVEL` (default `INFO`) choose, in
each process that calls `configure_logging` (the CLI and the Serve deployments). A line
gets its request id from `bind_request` (the gateway binds it to the request's task) or
from `extra=request_fields(id)` where a thread or task serves many requests (the engine,
the router, the replica's stream). Lines carry ids and counts, never prompt text or keys.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import TextIO

from opentelemetry import trace
from opentelemetry.trace import Span

LOGGER = "baton"
FORMATS = ("text", "json")

_REQUEST_ID: ContextVar[str | None] = ContextVar("baton_request_id", default=None)
# What every LogRecord has; anything else on a record came from `extra=` and is logged.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def bind_request(request_id: str) -> None:
    """Name `request_id` on the lines logged from here on in this task or thread."""
    _REQUEST_ID.set(request_id)


def bound_request() -> str | None:
    return _REQUEST_ID.get()


def request_fields(request_id: str) -> dict[str, str]:
    """`extra=` for a line about one request, logged where no request is bound."""
    return {"request_id": request_id}


def span_fields(span: Span) -> dict[str, str]:
    """`extra=` naming a span (and its trace) that is not the current one; empty if none."""
    context = span.get_span_context()
    if not context.is_valid:
        return {}
    return {
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
    }


def configure_logging(
    fmt: str | None = None, level: str | None = None, *, stream: TextIO | None = None
) -> None:
    """Send the `baton` loggers' lines to `stream` (default: the process's real stderr, past
    any redirection such as Serve's) as `fmt` (default: $BATON_LOG_FORMAT, else text).
    Calling it again replaces the previous set-up."""
    fmt = (fmt or os.environ.get("BATON_LOG_FORMAT") or "text").lower()
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(stream or sys.__stderr__)
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_with_request_id)
    logger = logging.getLogger(LOGGER)
    for old in list(logger.handlers):
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel((level or os.environ.get("BATON_LOG_LEVEL") or "INFO").upper())
    logger.propagate = False  # else Ray's or the root logger's handlers print it again


def _with_request_id(record: logging.LogRecord) -> bool:
    if getattr(record, "request_id", None) is None:
        record.request_id = _REQUEST_ID.get()
    return True


class TextFormatter(logging.Formatter):
    """`time LEVEL logger [request]: message`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(request)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None)
        record.request = f" [{request_id}]" if request_id else ""
        return super().format(record)


class JSONFormatter(logging.Formatter):
    """One JSON object a line: ts, level, logger, msg, request_id, trace_id and span_id when
    known (given, or the current span's), the fields given with `extra=`, and exc (the
    traceback) if any. Private record attributes (`_...`, e.g. Ray's) are left out."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update(span_fields(trace.get_current_span()))
        line.update(
            (key, value)
            for key, value in record.__dict__.items()
            if key not in _STANDARD and not key.startswith("_") and value is not None
        )
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)
