"""The HTTP client every asynchronous benchmark drives a server with."""

from __future__ import annotations

import httpx

# llama-server (cpp-httplib) and Serve's proxy (uvicorn) close a connection idle for 5 s; a
# request sent on it in that instant fails with "Server disconnected without sending a
# response" (seen on `bench peer`). Dropping idle connections first avoids the race.
IDLE_CONNECTION_S = 2.0


def bench_client(timeout_s: float, *, keepalive: int = 20) -> httpx.AsyncClient:
    """An async client with `timeout_s` per request, any number of connections at once,
    `keepalive` of them kept for reuse, none kept idle long enough for the server to close it."""
    limits = httpx.Limits(
        max_connections=None,
        max_keepalive_connections=keepalive,
        keepalive_expiry=IDLE_CONNECTION_S,
    )
    return httpx.AsyncClient(timeout=timeout_s, limits=limits)
