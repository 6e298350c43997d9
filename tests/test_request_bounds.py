"""Numeric and list-size bounds of generation requests (issue #50), over real HTTP to the
gateway over a real llama.cpp replica of a generated model: `max_tokens` within the context
its prompt leaves and the cap, one work budget per request, `logit_bias` ids unique and
counted, list fields counted. Each refusal is a 400 naming the field and the limit, and a
normal request beside it is answered; the replica's own penalty windows are bounded by its
context, whatever `max_tokens` it is handed."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from gateway_harness import Served, serving
from ray.serve._private.build_app import build_app as serve_build_app

from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.deploy.app import GATEWAY_DEPLOYMENT, build_app
from baton_serve.deploy.config import load_config
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.router.gateway.gateway import GatewaySettings

MODEL = "baton-tiny"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello! Who are you?"}]
N_CTX = 512
BIG = 2**31 - 1  # issue #50: with a penalty, once an 8 GiB ring buffer per choice
# Far above a few hundred MiB of noise, far below the 8 GiB one such request once took.
RSS_GROWTH_LIMIT = 256 << 20
LIMITS = {
    "max_logit_bias": 8,
    "max_stop_token_ids": 4,
    "max_tools": 2,
    "max_documents": 2,
    "max_message_parts": 4,
}


@pytest.fixture(scope="module")
def served(tiny_model: Callable[[str], Path]) -> Iterator[Served]:
    """A 512-token context, default cap and work budget (16 × 512), small list bounds."""
    settings = GatewaySettings(MODEL, str(tiny_model("qwen35")), n_ctx=N_CTX, **LIMITS)
    with serving(settings, EngineConfig(n_ctx=N_CTX, n_slots=2, n_threads=1)) as served:
        yield served


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=60) as client:
        yield client


def _chat(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 4, **fields}


def _text(prompt: object, **fields: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, **fields}


def _refused(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The 400's error, after which a normal chat beside it is still answered."""
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert client.post(CHAT, json=_chat()).status_code == 200
    return response.json()["error"]


def _tool(name: str) -> dict[str, object]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


# ---- max_tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_huge_max_tokens_is_refused_at_once_and_costs_no_memory(
    served: Served, client: httpx.Client, field: str
) -> None:
    """The issue's body: 2**31 - 1 tokens with a presence penalty once made the replica
    zero-fill an 8 GiB window (RSS 0.8 → 9.2 GB, 30 s). Now it never reaches the engine,
    which is in this process: its RSS does not grow, and it sees no request."""
    process = psutil.Process()
    rss, requests = process.memory_info().rss, served.engine.stats.requests
    body = {"model": MODEL, "messages": HELLO, field: BIG, "presence_penalty": 0.1, "n": 2}
    started = time.monotonic()
    response = client.post(CHAT, json=body)
    assert time.monotonic() - started < 2.0
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (field, "context_length_exceeded")
    assert f"{field} is {BIG}" in error["message"] and f"{N_CTX} tokens" in error["message"]
    assert served.engine.stats.requests == requests
    assert process.memory_info().rss - rss < RSS_GROWTH_LIMIT
    assert client.post(CHAT, json=_chat(presence_penalty=0.1)).status_code == 200


def test_max_tokens_beyond_the_room_a_prompt_leaves_is_refused(client: httpx.Client) -> None:
    """500 prompt tokens leave 12 of 512: 13 is refused naming both; the prompt that
    leaves the room is named among several; 12 is served."""
    long = [5] * 500
    error = _refused(client, COMPLETIONS, _text(long, max_tokens=13))
    assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
    assert "512 tokens" in error["message"] and "the prompt has 500" in error["message"]
    assert "at most 12" in error["message"]
    error = _refused(client, COMPLETIONS, _text([[1, 2, 3], long], max_tokens=13))
    assert "prompt 1 has 500" in error["message"]
    reply = client.post(COMPLETIONS, json=_text(long, max_tokens=12, ignore_eos=True)).json()
    assert reply["usage"]["completion_tokens"] == 12


def test_a_completion_default_max_tokens_fits_the_room(client: httpx.Client) -> None:
    """A completion's default of 16 is not the client's: after 500 prompt tokens it is the
    12 left, not a refusal."""
    body = {"model": MODEL, "prompt": [5] * 500, "ignore_eos": True}
    reply = client.post(COMPLETIONS, json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 12
    assert reply.json()["choices"][0]["finish_reason"] == "length"


def test_a_cap_is_named_and_bounds_the_default(tiny_model: Callable[[str], Path]) -> None:
    settings = GatewaySettings(MODEL, str(tiny_model("qwen35")), n_ctx=N_CTX, max_tokens_cap=5)
    with serving(settings, EngineConfig(n_ctx=N_CTX, n_slots=1, n_threads=1)) as served:
        with httpx.Client(base_url=served.url, timeout=60) as client:
            error = _refused(client, CHAT, _chat(max_tokens=6))
            assert error["param"] == "max_tokens" and "max_tokens_cap" in error["message"]
            reply = client.post(CHAT, json={**_chat(ignore_eos=True), "max_tokens": None})
            assert reply.json()["usage"]["completion_tokens"] == 5


# ---- the work budget -------------------------------------------------------------------------


def test_work_over_the_budget_is_refused_before_tokenising(
    served: Served, client: httpx.Client
) -> None:
    """16 prompts × n 2 × (1 + 300) tokens > 16 × 512: refused from the numbers alone;
    16 × 2 × a few tokens is served."""
    requests = served.engine.stats.requests
    error = _refused(client, COMPLETIONS, _text(["Hi"] * 16, n=2, max_tokens=300))
    assert error["param"] == "max_tokens" and "max_request_tokens" in error["message"]
    assert f"at most {16 * N_CTX}" in error["message"]
    assert served.engine.stats.requests == requests + 1  # only the normal chat beside it
    reply = client.post(COMPLETIONS, json=_text(["Hi"] * 16, n=2, max_tokens=2))
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 32


def test_work_counts_the_prompt_tokens(tiny_model: Callable[[str], Path]) -> None:
    """A budget of 600: 2 × (250 + 10) passes, 3 such prompts do not (found once
    tokenised)."""
    settings = GatewaySettings(
        MODEL, str(tiny_model("qwen35")), n_ctx=N_CTX, max_request_tokens=600
    )
    with serving(settings, EngineConfig(n_ctx=N_CTX, n_slots=1, n_threads=1)) as served:
        with httpx.Client(base_url=served.url, timeout=60) as client:
            prompts = [[7] * 250, [8] * 250]
            assert client.post(COMPLETIONS, json=_text(prompts, max_tokens=10)).status_code == 200
            error = _refused(client, COMPLETIONS, _text([*prompts, [9] * 250], max_tokens=10))
            assert "780 tokens" in error["message"] and "at most 600" in error["message"]


# ---- logit_bias ------------------------------------------------------------------------------


@pytest.mark.parametrize("spellings", [("1", "01"), ("7", "+7"), ("7", " 7"), ("10", "1_0")])
def test_one_token_id_given_twice_is_refused(
    client: httpx.Client, spellings: tuple[str, str]
) -> None:
    first, second = spellings
    error = _refused(client, CHAT, _chat(logit_bias={first: 1.0, second: 1.0}))
    assert error["param"] == "logit_bias"
    assert f"token id {int(first)} twice" in error["message"]


def test_logit_bias_entries_are_counted_and_checked(served: Served, client: httpx.Client) -> None:
    many = {str(i): 1.0 for i in range(LIMITS["max_logit_bias"] + 1)}
    error = _refused(client, CHAT, _chat(logit_bias=many))
    assert (error["param"], error["code"]) == ("logit_bias", "array_above_max_length")
    assert "max_logit_bias" in error["message"] and "9 items" in error["message"]
    n_vocab = served.engine.model.n_vocab
    error = _refused(client, CHAT, _chat(logit_bias={str(n_vocab): 1.0}))
    assert error["param"] == "logit_bias" and "not in the vocabulary" in error["message"]
    error = _refused(client, CHAT, _chat(logit_bias={"-1": 1.0}))
    assert "not in the vocabulary" in error["message"]
    allowed = dict(list(many.items())[: LIMITS["max_logit_bias"]])
    assert client.post(CHAT, json=_chat(logit_bias=allowed)).status_code == 200


# ---- list fields -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "setting"),
    [
        ("stop_token_ids", [1, 2, 3, 4, 5], "max_stop_token_ids"),
        ("tools", [_tool("a"), _tool("b"), _tool("c")], "max_tools"),
        ("documents", [{"text": "a"}, {"text": "b"}, {"text": "c"}], "max_documents"),
    ],
)
def test_a_list_over_its_bound_is_refused_naming_the_setting(
    client: httpx.Client, field: str, value: list, setting: str
) -> None:
    error = _refused(client, CHAT, _chat(**{field: value}))
    assert (error["param"], error["code"]) == (field, "array_above_max_length")
    assert setting in error["message"] and f"{len(value)} items" in error["message"]
    assert client.post(CHAT, json=_chat(**{field: value[:-1]})).status_code == 200


def test_a_list_is_counted_before_its_items_are_validated(client: httpx.Client) -> None:
    """Three tools, each invalid: the count is refused first."""
    error = _refused(client, CHAT, _chat(tools=[{"type": "nonsense"}] * 3))
    assert error["code"] == "array_above_max_length"


def test_content_parts_and_tool_calls_add_up_over_the_messages(client: httpx.Client) -> None:
    """3 parts, then 1 call and 1 part: 5 in all, over 4; refused at the message that
    passes it. Four in all are served."""
    part = {"type": "text", "text": "Hi."}
    call = {"id": "call_1", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": [part] * 3},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [part]},
    ]
    error = _refused(client, CHAT, _chat(messages=messages))
    assert (error["param"], error["code"]) == ("messages[2].content", "array_above_max_length")
    assert "5 content parts and tool calls" in error["message"]
    assert "max_message_parts" in error["message"]
    messages[0]["content"] = [part] * 2
    assert client.post(CHAT, json=_chat(messages=messages)).status_code == 200


def test_a_top_k_beyond_the_vocabulary_keeps_every_token(client: httpx.Client) -> None:
    """top_k 2**32 + 1 keeps every token, as top_k 0 does; passed on, llama.cpp's int32
    would have read it as 1 (greedy)."""
    sampled = {"temperature": 1.0, "seed": 3, "ignore_eos": True, "max_tokens": 8}
    reply = client.post(CHAT, json=_chat(top_k=2**32 + 1, **sampled))
    assert reply.status_code == 200, reply.text
    same = client.post(CHAT, json=_chat(top_k=0, **sampled)).json()
    assert reply.json()["choices"][0]["message"] == same["choices"][0]["message"]


# ---- the replica's own bound -----------------------------------------------------------------


def test_the_replica_bounds_penalty_windows_by_its_context(
    tiny_model: Callable[[str], Path], make_engine: Callable[..., Any]
) -> None:
    """Defence in depth: handed max_tokens 2**31 - 1 with every penalty (as only a caller
    past the gateway could), the engine sizes llama.cpp's windows by its 256-token context,
    generates to the context's end, and its RSS stays put."""
    engine = make_engine(tiny_model("qwen35"), n_ctx=256, n_slots=1, n_threads=1)
    prompt = engine.text_prompt("Repeat after me.")
    engine.generate(prompt, SamplingParams(max_tokens=2))  # warm: buffers allocated once
    process = psutil.Process()
    rss = process.memory_info().rss
    params = SamplingParams(
        max_tokens=BIG,
        presence_penalty=0.1,
        frequency_penalty=0.1,
        repetition_penalty=1.1,
        temperature=1.0,
        seed=1,
        ignore_eos=True,
    )
    done = engine.generate(prompt, params)
    assert len(prompt) + len(done.tokens) >= 250  # to the context's end
    assert process.memory_info().rss - rss < RSS_GROWTH_LIMIT


def test_the_settings_reach_the_gateway(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each bound is a BatonConfig setting, read from BATON_* like the others."""
    for name in [n for n in os.environ if n.startswith("BATON_") and n != "BATON_CACHE_DIR"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("BATON_MAX_LOGIT_BIAS", "300")
    monkeypatch.setenv("BATON_MAX_REQUEST_TOKENS", "100000")
    config = load_config(
        overrides={
            "model": str(tiny_model("llama")),
            "replicas": 1,
            "max_tokens_cap": 64,
            "max_tools": 3,
            "max_documents": 5,
            "max_stop_token_ids": 7,
            "max_message_parts": 9,
        }
    )
    built = {d.name: d for d in serve_build_app(build_app(config), name="baton").deployments}
    settings = built[GATEWAY_DEPLOYMENT].init_args[0]
    assert isinstance(settings, GatewaySettings)
    assert (settings.max_logit_bias, settings.max_request_tokens) == (300, 100000)
    assert (settings.max_tokens_cap, settings.max_tools) == (64, 3)
    assert (settings.max_documents, settings.max_stop_token_ids) == (5, 7)
    assert settings.max_message_parts == 9
