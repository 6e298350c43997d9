"""The server's bounds on a request's lists (`max_messages`, `max_prompts`, `max_tools`,
`max_documents`, `max_stop_token_ids`) and on `logit_bias`'s entries (`max_logit_bias`),
applied while the body is validated: a chat's messages are counted before any of them is
validated, so a body of 20,001 messages costs its JSON parse and a count, not 20,001
messages' validation on the gateway's event loop. Lists each message may hold (content
parts, tool calls) add up to one total per request (`max_message_parts`), refused once over
it.

The bounds are the gateway's settings, the request models are classes shared by every
gateway in the process, so `BoundLists` (an ASGI middleware of each gateway app) names the
bounds for the requests it passes on, and the models' validators read them. A model
validated outside a gateway's request has no such bound.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from pydantic import AfterValidator, BeforeValidator
from pydantic_core import PydanticCustomError
from starlette.types import ASGIApp, Receive, Scope, Send

TOO_MANY_ITEMS = "array_above_max_length"  # the error's type, and the API error's code
# Defaults of the bounds added with issue #50 (BatonConfig's fields describe their reasons).
MAX_TOOLS = 128  # OpenAI's own limit on `tools`
MAX_DOCUMENTS = 2048  # as many as a chat's messages (`max_messages`)
MAX_LOGIT_BIAS = 1024  # OpenAI takes 300; llama-server and vLLM have no limit
MAX_STOP_TOKEN_IDS = 1024  # vLLM has no limit; a reply's end tokens are a handful
MAX_MESSAGE_PARTS = 8192  # 4 per message at the default max_messages


@dataclass(frozen=True)
class ListBounds:
    """The most items of each bounded list (or object, for `logit_bias`) in one request."""

    max_messages: int
    max_prompts: int
    max_tools: int = MAX_TOOLS
    max_documents: int = MAX_DOCUMENTS
    max_logit_bias: int = MAX_LOGIT_BIAS
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    max_message_parts: int = MAX_MESSAGE_PARTS  # content parts and tool calls, all messages


@dataclass
class _Counting:
    """The bounds the current request is validated under, and its totals so far."""

    bounds: ListBounds
    totals: dict[str, int] = field(default_factory=dict)


_SETTING = {  # field: its bound
    "messages": "max_messages",
    "prompt": "max_prompts",
    "tools": "max_tools",
    "documents": "max_documents",
    "logit_bias": "max_logit_bias",
    "stop_token_ids": "max_stop_token_ids",
}
_TOTAL = {"content": "max_message_parts", "tool_calls": "max_message_parts"}  # per request
_bounds: ContextVar[_Counting | None] = ContextVar("baton_list_bounds", default=None)


class BoundLists:
    """ASGI middleware: every body `app` validates is bounded by `bounds`."""

    def __init__(self, app: ASGIApp, *, bounds: ListBounds) -> None:
        self._app = app
        self._bounds = bounds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = _bounds.set(_Counting(self._bounds))
        try:
            await self._app(scope, receive, send)
        finally:
            _bounds.reset(token)


def counted(field: str, *, as_sent: bool = False) -> BeforeValidator | AfterValidator:
    """Annotates the list (or object) `field`, a key of `_SETTING`, with its bound: its
    items counted as the client sent them, before any is validated (`as_sent`), or once
    validated (a list of token ids as sent is one prompt)."""

    def check(value: Any) -> Any:
        if isinstance(value, list | dict):
            _check_count(field, len(value))
        return value

    return BeforeValidator(check) if as_sent else AfterValidator(check)


def counted_in_total(field: str) -> BeforeValidator:
    """Annotates a list each message may hold (`field`, a key of `_TOTAL`: "content" given
    as parts, "tool_calls"): its items, as sent, add to the request's total of its bound."""

    def check(value: Any) -> Any:
        counting = _bounds.get()
        if isinstance(value, list) and counting is not None:
            setting = _TOTAL[field]
            total = counting.totals.get(setting, 0) + len(value)
            counting.totals[setting] = total
            limit = getattr(counting.bounds, setting)
            if total > limit:
                raise PydanticCustomError(
                    TOO_MANY_ITEMS,
                    "the messages hold {total} content parts and tool calls in all; this "
                    "server takes at most {limit} (its {setting} setting).",
                    {"total": total, "limit": limit, "setting": setting},
                )
        return value

    return BeforeValidator(check)


def _check_count(field: str, count: int) -> None:
    """Refuse `count` items of `field` over the bound the current request is validated
    under (a pydantic error of type `TOO_MANY_ITEMS`)."""
    counting = _bounds.get()
    if counting is None:
        return
    setting = _SETTING[field]
    limit = getattr(counting.bounds, setting)
    if count > limit:
        raise PydanticCustomError(
            TOO_MANY_ITEMS,
            "{field} has {count} items; this server takes at most {limit} (its {setting} setting).",
            {"field": field, "count": count, "limit": limit, "setting": setting},
        )
