"""A body must arrive whole within `body_read_timeout_s`: clients that trickle their bodies
get a 408 naming the setting after about the deadline, and the connection (with its gateway
slot) is let go, while a normal request beside them is answered. The gateway over real HTTP
(uvicorn, a real replica of a generated model); the tricklers are raw sockets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from gateway_harness import Served, post_slowly, serving

from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.router.gateway.gateway import GatewaySettings

MODEL = "baton-tiny"
DEADLINE_S = 1.0
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def served(tiny_model: Callable[[str], Path]) -> Iterator[Served]:
    settings = GatewaySettings(
        MODEL, str(tiny_model("qwen35")), n_ctx=1024, body_read_timeout_s=DEADLINE_S
    )
    with serving(settings, EngineConfig(n_ctx=1024, n_slots=2, n_threads=1)) as served:
        yield served


def test_a_trickled_body_gets_408_at_the_deadline_beside_a_normal_request(
    served: Served,
) -> None:
    """Before, a body was read with no deadline: a client sending a byte a second held its
    gateway slot for as long as it liked."""

    async def run() -> tuple[tuple[float, bytes, bool], httpx.Response]:
        body = json.dumps(CHAT).encode()
        trickled = asyncio.create_task(post_slowly(served.url, body, 0.3))
        await asyncio.sleep(0.2)
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
            normal = await client.post("/v1/chat/completions", json=CHAT)
        return await trickled, normal

    (answered_s, reply, closed), normal = asyncio.run(run())
    assert normal.status_code == 200, normal.text
    assert DEADLINE_S <= answered_s < DEADLINE_S + 1.0, answered_s
    assert closed  # the connection is let go, its unread bytes with it
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), head
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "body_read_timeout_s" in error["message"]
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200


def test_many_tricklers_are_all_let_go_and_the_gateway_serves_on(served: Served) -> None:
    """100 clients at once, each sending a byte every 3 s, each get their 408 within the
    deadline's second, and a normal request after them is answered. (Their next byte comes
    after the 408: one arriving as the server closes would make it reset the connection, and
    the client might lose the reply it had not read yet.)"""

    async def run() -> list[tuple[float, bytes, bool]]:
        body = json.dumps(CHAT).encode()
        return list(await asyncio.gather(*(post_slowly(served.url, body, 3.0) for _ in range(100))))

    replies = asyncio.run(run())
    assert all(reply.startswith(b"HTTP/1.1 408 ") and closed for _, reply, closed in replies)
    assert max(answered_s for answered_s, _, _ in replies) < DEADLINE_S + 2.0
    response = httpx.post(f"{served.url}/v1/chat/completions", json=CHAT, timeout=30)
    assert response.status_code == 200, response.text


def test_a_slow_body_within_the_deadline_is_served(served: Served) -> None:
    """The deadline is for the whole body, not a speed: a body arriving in pieces over half
    the deadline is served."""
    body = json.dumps(CHAT).encode()

    async def run() -> tuple[float, bytes, bool]:
        return await post_slowly(served.url, body, DEADLINE_S / 2 / len(body), keep_alive=False)

    _, reply, _ = asyncio.run(run())
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]


def test_a_body_over_the_size_bound_is_still_refused_as_it_arrives(served: Served) -> None:
    """The deadline wraps the size bound: a chunked body (no Content-Length) past
    max_body_bytes gets its 413 once the bytes over it arrive, well before the deadline."""

    def chunks() -> Iterator[bytes]:
        for _ in range(5):
            yield b" " * (1 << 20)

    response = httpx.post(f"{served.url}/v1/chat/completions", content=chunks(), timeout=30)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
