"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

Client mistakes get a 4xx that says what to fix; anything unexpected gets a generic 500
whose detail goes only to the log.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException

from baton_serve.cache_store.wire.protocol import (
    EngineClosed,
    EngineError,
    EngineTimeout,
    InvalidGeneration,
    PromptTooLong,
)
from baton_serve.replicas.engine.prompt import PromptError
from baton_serve.router.gateway import refused_fields
from baton_serve.router.gateway.list_bounds import TOO_MANY_ITEMS

logger = logging.getLogger("baton.gateway")

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
RATE_LIMIT = "rate_limit_error"


class APIError(Exception):
    """A failure answered with an HTTP status and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def context_length_exceeded(
    prompt_tokens: int, n_ctx: int, *, at_least: bool = False, param: str | None = None
) -> APIError:
    """400; `at_least`: `prompt_tokens` is a lower bound (the text was too long to count)."""
    has = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
    return invalid_request(
        f"This model's maximum context length is {n_ctx} tokens, but the prompt has "
        f"{has} tokens (at most {n_ctx - 1} leave room for one generated token).",
        param=param,
        code="context_length_exceeded",
    )


def model_not_found(model: str, served: str) -> APIError:
    return APIError(
        404,
        f"The model '{model}' does not exist; this server serves '{served}'.",
        INVALID_REQUEST,
        param="model",
        code="model_not_found",
    )


def invalid_api_key() -> APIError:
    return APIError(
        401,
        "A valid API key is required: send it as 'Authorization: Bearer <key>'.",
        INVALID_REQUEST,
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def body_too_large(limit: int) -> APIError:
    return APIError(
        413, f"The request body exceeds {limit} bytes.", INVALID_REQUEST, code="request_too_large"
    )


def body_read_timeout(timeout_s: float) -> APIError:
    """408: the body did not arrive whole within the server's deadline (a trickling client);
    the connection is closed, its unread bytes with it."""
    return APIError(
        408,
        f"The request body did not arrive within {timeout_s:g} s (this server's "
        "body_read_timeout_s setting).",
        INVALID_REQUEST,
        code="request_timeout",
        headers={"Connection": "close"},
    )


def prompt_too_large(size: int, limit: int, param: str, setting: str) -> APIError:
    """413: the prompt's text (a chat as rendered) is larger than the server's bound."""
    return APIError(
        413,
        f"The prompt is {size} bytes of text; this server takes at most {limit} "
        f"(its {setting} setting).",
        INVALID_REQUEST,
        param=param,
        code="prompt_too_large",
    )


def no_capacity(
    message: str = "No replica can take the request now; retry shortly.", *, retry_after_s: int = 1
) -> APIError:
    """503 with `Retry-After`: raise it when no replica has room (or all are stopping)."""
    headers = {"Retry-After": str(retry_after_s)}
    return APIError(503, message, SERVER_ERROR, code="no_capacity", headers=headers)


def replica_died(request_id: str, quarantine_s: float) -> APIError:
    """500: the replica running the request died before finishing it. Not a 503 with
    Retry-After, which invites a resend (proxies' retry policies name 503, rarely 500): the
    request may be what killed the replica. An SDK that resends any 5xx meets the quarantine."""
    refused = (
        f"; identical requests are refused for {quarantine_s:g} s (the poison_quarantine_s setting)"
        if quarantine_s > 0
        else ""
    )
    message = (
        f"The replica running request {request_id} died before finishing it. The request was "
        f"not sent to another replica, in case it is what killed this one{refused}."
    )
    return APIError(500, message, SERVER_ERROR, code="replica_died")


def request_quarantined(quarantine_s: float, left_s: int) -> APIError:
    """400: an identical request was running on a replica that died less than `quarantine_s`
    ago. A client error, not a 5xx that SDKs retry: the same body gets the same answer until
    the quarantine ends; a changed one is served."""
    return invalid_request(
        "An identical request was running on a replica that died; it may be what killed it, "
        f"so identical requests are refused for {quarantine_s:g} s (the poison_quarantine_s "
        f"setting; {left_s} s left). Send a different request, or this one later.",
        code="request_quarantined",
    )


def replica_timeout(exc: EngineTimeout) -> APIError:
    """504: the replica cancelled the request at its deadline (a stuck or far too slow engine)."""
    message = f"Timed out on the replica: {exc}; retry shortly."
    return APIError(504, message, SERVER_ERROR, code="timeout")


def too_busy(exc: BackPressureError) -> APIError:
    """Every replica and the gateway's queue are full (Ray Serve's `max_queued_requests`)."""
    retry_after_s = max(1, math.ceil(exc.retry_after_s or 1))
    message = "Every replica is busy and the queue is full; retry shortly."
    if exc.status_code == 429:
        return APIError(
            429,
            message,
            RATE_LIMIT,
            code="too_many_requests",
            headers={"Retry-After": str(retry_after_s)},
        )
    return no_capacity(message, retry_after_s=retry_after_s)


def from_exception(exc: Exception) -> APIError:
    """The API error for an exception raised while serving; unexpected ones are logged."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLong):
        return context_length_exceeded(exc.prompt_tokens, exc.n_ctx)
    if isinstance(exc, InvalidGeneration):
        return invalid_request(str(exc), param=exc.param)
    if isinstance(exc, PromptError):
        return invalid_request(str(exc))
    if isinstance(exc, EngineClosed):
        return no_capacity("The replica is shutting down; retry shortly.")
    if isinstance(exc, EngineTimeout):
        return replica_timeout(exc)
    if isinstance(exc, BackPressureError):
        return too_busy(exc)
    logger.error("request failed", exc_info=exc)
    return APIError(500, "The server failed to handle the request; see its log.", SERVER_ERROR)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every failure of `app` with an OpenAI error body."""
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(HTTPException, _http_error)
    for kind in (APIError, PromptError, EngineError, Exception):
        app.add_exception_handler(kind, _failed)


async def _failed(_: Request, exc: Exception) -> JSONResponse:
    return from_exception(exc).response()


async def _invalid_body(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", "invalid JSON")
        return invalid_request(f"The request body is not valid JSON: {reason}.").response()
    param = _path(first["loc"])
    if first["type"] == TOO_MANY_ITEMS:  # a server bound (list_bounds), not a schema's
        return invalid_request(first["msg"], param=param, code=TOO_MANY_ITEMS).response()
    if param is None:
        message = "The request body must be a JSON object (Content-Type: application/json)."
        return invalid_request(message).response()
    unknown = [_path(e["loc"]) or "body" for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        chat = request.url.path.endswith("/chat/completions")
        refused = refused_fields.CHAT if chat else refused_fields.COMPLETIONS
        why = "".join(f"; {name}: {refused[name]}" for name in unknown if name in refused)
        message = (
            f"Unsupported field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: Baton "
            f"does not serve it (refused rather than ignored){why}. docs/api-fields.md and "
            "/openapi.json list every field."
        )
        return invalid_request(message, param=unknown[0], code="unsupported_parameter").response()
    problems = "; ".join(f"{_path(e['loc']) or 'body'}: {e['msg']}" for e in errors[:5])
    return invalid_request(f"Invalid request: {problems}", param=param).response()


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    message = f"{exc.detail} ({request.method} {request.url.path})"
    return APIError(exc.status_code, message, INVALID_REQUEST, headers=exc.headers).response()


def _path(loc: Sequence[int | str]) -> str | None:
    """A pydantic error location as a field path, e.g. `messages[0].content`."""
    parts = list(loc)
    path = ""
    for part in parts[1:] if parts[:1] == ["body"] else parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path or None
