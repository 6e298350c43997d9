"""The server's bounds on a request's lists (`max_messages`, `max_prompts`), applied while
the body is validated: a chat's messages are counted before any of them is validated, so a
body of 20,001 messages costs its JSON parse and a count, not 20,001 messages' validation on
the gateway's event loop.

The bounds are the gateway's settings, the request models are classes shared by every
gateway in the process, so `BoundLists` (an ASGI middleware of each gateway app) names the
bounds for the requests it passes on, and the models' validators read them. A model
validated outside a gateway's request has no such bound.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from pydantic import AfterValidator, BeforeValidator
from pydantic_core import PydanticCustomError
from starlette.types import ASGIApp, Receive, Scope, Send

TOO_MANY_ITEMS = "array_above_max_length"  # the error's type, and the API error's code


@dataclass(frozen=True)
class ListBounds:
    """The most items of each bounded list in one request."""

    max_messages: int
    max_prompts: int


_SETTING = {"messages": "max_messages", "prompt": "max_prompts"}  # field: its bound
_bounds: ContextVar[ListBounds | None] = ContextVar("baton_list_bounds", default=None)


class BoundLists:
    """ASGI middleware: every body `app` validates is bounded by `bounds`."""

    def __init__(self, app: ASGIApp, *, bounds: ListBounds) -> None:
        self._app = app
        self._bounds = bounds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = _bounds.set(self._bounds)
        try:
            await self._app(scope, receive, send)
        finally:
            _bounds.reset(token)


def counted(field: str, *, as_sent: bool = False) -> BeforeValidator | AfterValidator:
    """Annotates the list `field` ("messages", "prompt") with its bound: its items counted as
    the client sent them, before any is validated (`as_sent`), or once validated (a list of
    token ids as sent is one prompt)."""

    def check(value: Any) -> Any:
        if isinstance(value, list):
            _check_count(field, len(value))
        return value

    return BeforeValidator(check) if as_sent else AfterValidator(check)


def _check_count(field: str, count: int) -> None:
    """Refuse `count` items of `field` over the bound the current request is validated
    under (a pydantic error of type `TOO_MANY_ITEMS`)."""
    bounds = _bounds.get()
    if bounds is None:
        return
    setting = _SETTING[field]
    limit = getattr(bounds, setting)
    if count > limit:
        raise PydanticCustomError(
            TOO_MANY_ITEMS,
            "{field} has {count} items; this server takes at most {limit} (its {setting} setting).",
            {"field": field, "count": count, "limit": limit, "setting": setting},
        )
