"""One call sets up the logs, traces and metrics of a Serve deployment's process."""

from __future__ import annotations

from baton_serve.cache_store.telemetry import metrics
from baton_serve.cache_store.telemetry.logs import configure_logging
from baton_serve.cache_store.telemetry.tracing import configure_tracing


def configure_process(component: str) -> None:
    """Logs as $BATON_LOG_FORMAT says, traces as the OTEL_* variables say, and metrics on;
    `component` (gateway, replica) names this process in its spans."""
    configure_logging()
    configure_tracing(component)
    metrics.enable()
