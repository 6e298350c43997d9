"""The gateway's ASGI middleware: API keys (deny by default), and a body size limit and
read deadline enforced before parsing."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Collection, Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baton_serve.cache_store.telemetry import tracing
from baton_serve.router.gateway.asgi_path import app_path
from baton_serve.router.gateway.errors import (
    APIError,
    body_read_timeout,
    body_too_large,
    invalid_api_key,
)


class APIKeyAuth:
    """Requires `Authorization: Bearer <key>`, with one of `keys`, on every path except the
    exact paths in `public` — so a route added later, or one that does not exist, is closed
    until it is listed."""

    def __init__(self, app: ASGIApp, *, keys: Sequence[str], public: Collection[str]) -> None:
        self._app = app
        self._keys = [key.encode() for key in keys]
        self._public = frozenset(public)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and app_path(scope) not in self._public:
            with tracing.span("auth") as span:
                authorized = self._authorized(Headers(scope=scope))
                span.set_attribute("baton.authorized", authorized)
            if not authorized:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                else:
                    await invalid_api_key().response()(scope, receive, send)
                return
        await self._app(scope, receive, send)

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        presented = token.strip().encode()
        matches = [
            hmac.compare_digest(presented, key) for key in self._keys
        ]  # all, in constant time
        return scheme.lower() == "bearer" and any(matches)


class BodySizeLimit:
    """Answers 413 to a body over `max_bytes` before anything parses it, going by its
    Content-Length and by the bytes that actually arrive; and 408 to a body not received
    whole within `read_timeout_s`, so a client trickling its body holds a gateway slot (one
    of the deployment's ongoing requests) no longer than that."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, read_timeout_s: float) -> None:
        self._app = app
        self._max_bytes = max_bytes
        self._read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_bytes:
            await body_too_large(self._max_bytes).response()(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self._read_timeout_s)
        except asyncio.TimeoutError:
            body = body_read_timeout(self._read_timeout_s)
        if isinstance(body, APIError):
            await body.response()(scope, receive, send)
        elif body is not None:
            await self._app(scope, _replaying(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | APIError | None:
        """The whole body; the error to answer; or None when the client went away."""
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            body += message.get("body", b"")
            if len(body) > self._max_bytes:
                return body_too_large(self._max_bytes)
            more = message.get("more_body", False)
        return bytes(body)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` that hands over the body already read, then the connection's own events
    (so a streaming response still hears of a disconnect)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay
