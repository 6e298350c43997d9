"""One abusive body harms nothing but itself: the gateway over real HTTP (uvicorn, a real
replica of a generated model) refuses oversized bodies by their bounds, quickly, while a
normal request beside them is served; a failing element of a prompt list stops its
siblings; API keys are deny-by-default; /health never waits on a stalled check."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from gateway_harness import BOUNDED_MODEL, Served, bounded_gateway, serving

from baton_serve.cache_store.wire.protocol import Completion, ReplicaRequest
from baton_serve.loadtests.abuse_bench import abuse_benchmark, abusive_bodies, format_report
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.router.gateway.gateway import GatewaySettings, create_app
from baton_serve.router.gateway.openai_types import ChatCompletionRequest

MODEL = BOUNDED_MODEL
KEY = "sk-abuse"
# Seconds, far below the minutes the 20,001-message chat once held a normal request for: the
# bench's own target. Such a body costs the gateway's event loop its JSON parse and a count
# (`list_bounds`); while its 20,001 messages were validated before the count (~100 ms a body
# on this 2-core VM), a normal request beside two abusers once took 1.08 s.
NORMAL_P50_LIMIT_S = 1.0


@pytest.fixture(scope="module")
def served(tiny_model: Callable[[str], Path]) -> Iterator[Served]:
    with bounded_gateway(str(tiny_model("qwen35"))) as served:
        yield served


def test_each_abusive_body_gets_its_4xx_quickly_beside_a_normal_request(served: Served) -> None:
    """The benchmark's own run: each abusive body sent over and over by 2 clients for 1 s
    while a normal chat request is sent again and again. Before the bounds and linear
    rendering, the 20,001-message chat rendered for minutes and held the normal one up."""
    result = abuse_benchmark(served.url, MODEL, seconds=1.0, abusers=2)
    runs = result["runs"]
    assert set(runs) == {"baseline (no abuse)", *abusive_bodies(MODEL)}
    for name, run in runs.items():
        assert run["normal"]["failed"] == 0, name
        assert run["normal"]["p50_s"] < NORMAL_P50_LIMIT_S, (name, run)
        if name != "baseline (no abuse)":
            assert set(run["abusive"]["statuses"]) <= {"400", "413"}, (name, run)
            assert run["abusive"]["max_s"] < 2.0, (name, run)
    assert "chat of 20,001 messages" in format_report(result)


@pytest.mark.parametrize(
    ("name", "status", "param", "code", "setting"),
    [
        ("chat of 20,001 messages", 400, "messages", "array_above_max_length", "max_messages"),
        ("completion of 2,000 prompts", 400, "prompt", "array_above_max_length", "max_prompts"),
        ("chat of one 1 MiB message", 413, "messages", "prompt_too_large", "max_prompt_bytes"),
    ],
)
def test_abusive_body_names_the_bound(
    served: Served, name: str, status: int, param: str, code: str, setting: str
) -> None:
    path, body = abusive_bodies(MODEL)[name]
    response = httpx.post(served.url + path, json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert setting in error["message"]


def test_messages_are_counted_before_any_is_validated(served: Served) -> None:
    """2,049 messages, each invalid (no role): the count is refused, by the setting, before
    a message is looked at; one such message alone gets its own validation error."""
    body = {"model": MODEL, "messages": [{"content": "hi"}] * 2049}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("messages", "array_above_max_length")
    assert "2049 items" in error["message"] and "max_messages" in error["message"]
    body["messages"] = body["messages"][:1]
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[0].role"


def test_the_request_models_outside_a_gateway_have_no_list_bound() -> None:
    """The bounds are each gateway's settings: a body validated outside one is not bounded."""
    messages = [{"role": "user", "content": "hi"}] * 3000
    assert len(ChatCompletionRequest(model=MODEL, messages=messages).messages) == 3000


def test_a_text_too_long_for_the_context_is_refused_before_tokenising(served: Served) -> None:
    """200 KiB of text cannot fit 1,024 tokens: refused by its size over the longest token."""
    body = {"model": MODEL, "prompt": "x" * (200 << 10), "max_tokens": 1}
    response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "at least" in error["message"]


def test_a_failing_prompt_cancels_its_siblings(tiny_model: Callable[[str], Path]) -> None:
    """The gateway takes 8,192 tokens, the engine 4,096 (a real mismatch of limits, so the
    engine refuses the long prompt). The short prompt beside it, about 6 s of generation,
    must stop when the request fails — before, it ran on after the client had its 400."""
    settings = GatewaySettings(MODEL, str(tiny_model("qwen35")), n_ctx=8192)
    config = EngineConfig(n_ctx=4096, n_slots=2, n_threads=1)
    with serving(settings, config) as served:
        body = {
            "model": MODEL,
            "prompt": ["Tell me everything.", "word " * 5000],
            "max_tokens": 3000,
            "ignore_eos": True,
        }
        response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert served.engine.wait_idle(timeout=2)


class NoReplica:
    """The replicas are not reached in these tests (a stand-in: auth and /health only)."""

    async def generate(self, request: ReplicaRequest) -> Completion:
        raise AssertionError("not reached")

    def stream(self, request: ReplicaRequest) -> None:
        raise AssertionError("not reached")


def _get_all(app: FastAPI, paths: list[str], headers: dict[str, str]) -> list[httpx.Response]:
    async def get() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return list(await asyncio.gather(*(client.get(p, headers=headers) for p in paths)))

    return asyncio.run(get())


def test_api_keys_are_deny_by_default(tiny_model: Callable[[str], Path]) -> None:
    """Every path but /health needs the key: the docs, the schema and unknown routes too
    (before, only paths under /v1/, /tokenize and /detokenize did)."""
    settings = GatewaySettings(MODEL, str(tiny_model("qwen35")), n_ctx=1024, api_keys=(KEY,))
    app = create_app(settings, NoReplica())  # type: ignore[arg-type]
    closed = ["/v1/models", "/openapi.json", "/docs", "/metrics", "/v2/anything", "/health/x"]
    assert [r.status_code for r in _get_all(app, closed, {})] == [401] * len(closed)
    keyed = _get_all(app, closed, {"Authorization": f"Bearer {KEY}"})
    assert [r.status_code for r in keyed] == [200, 200, 200, 404, 404, 404]
    (health,) = _get_all(app, ["/health"], {})
    assert health.status_code == 200


def test_health_does_not_wait_on_a_stalled_check(tiny_model: Callable[[str], Path]) -> None:
    """A readiness check that never returns (a replica or Ray that does not answer): every
    probe is answered 503 within a fraction of a second, and only one check is in flight."""
    calls = 0

    async def stalled() -> bool:
        nonlocal calls
        calls += 1
        await asyncio.Event().wait()
        return True

    settings = GatewaySettings(MODEL, str(tiny_model("qwen35")), n_ctx=1024)
    app = create_app(settings, NoReplica(), ready=stalled)  # type: ignore[arg-type]
    started = time.monotonic()
    responses = _get_all(app, ["/health"] * 5, {})
    assert [r.status_code for r in responses] == [503] * 5
    assert time.monotonic() - started < 2
    assert calls == 1
