"""The OpenAI gateway over real HTTP: uvicorn serving a real replica of a generated hybrid
model, spoken to with httpx and with the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI
from gateway_harness import Served, serving
from openai.types.chat import ChatCompletionMessageParam
from ray.serve.exceptions import BackPressureError

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import (
    Completion,
    EngineClosed,
    PromptTooLong,
    ReplicaRequest,
    TokenEvent,
)
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.models.tiny_model import ModelVariant, write_tiny_model
from baton_serve.router.gateway.gateway import GatewaySettings, create_app

MODEL = "baton-tiny"
KEY = "sk-test-key"
CAP = 512
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello! Who are you?"}]


@pytest.fixture(scope="module")
def served(tiny_model: Callable[[str], Path]) -> Iterator[Served]:
    """The open gateway: two slots, a 1024-token context, max_tokens capped at CAP."""
    settings = GatewaySettings(MODEL, str(tiny_model("qwen35")), n_ctx=1024, max_tokens_cap=CAP)
    with serving(settings, EngineConfig(n_ctx=1024, n_slots=2, n_threads=2)) as served:
        yield served


@pytest.fixture(scope="module")
def keyed(tiny_model: Callable[[str], Path]) -> Iterator[Served]:
    """A gateway that wants API key KEY; one slot, so a stuck stream would block it."""
    settings = GatewaySettings(MODEL, str(tiny_model("qwen35")), n_ctx=4096, api_keys=(KEY,))
    with serving(settings, EngineConfig(n_ctx=4096, n_slots=1, n_threads=2)) as served:
        yield served


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=60) as client:
        yield client


def _data_lines(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def _chat(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 8, "ignore_eos": True, **fields}


def _text(prompt: object, **fields: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, **fields}


# ---- the API -------------------------------------------------------------------------------


def test_chat_completion(client: httpx.Client) -> None:
    response = client.post(CHAT, json=_chat())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-") and abs(body["created"] - time.time()) < 60
    assert response.headers["x-baton-replica"] == "r0"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(
        choice["message"]["content"], str
    )
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]


def test_chat_stream_gives_the_same_reply_in_chunks(client: httpx.Client) -> None:
    request = _chat(temperature=0, max_tokens=12)
    whole = client.post(CHAT, json=request).json()
    streamed = {**request, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", CHAT, json=streamed) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        data = _data_lines(response)

    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(
        c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks
    )
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    *content, usage_chunk = chunks
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert text == whole["choices"][0]["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in content][-2:] == [None, "length"]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 12
    assert usage_chunk["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def test_content_parts_are_joined(client: httpx.Client) -> None:
    parts = [{"type": "text", "text": "Hello!"}, {"type": "text", "text": "Who are you?"}]
    response = client.post(CHAT, json=_chat(messages=[{"role": "user", "content": parts}]))
    assert response.status_code == 200, response.text


def test_completion_of_text_texts_and_token_ids(client: httpx.Client) -> None:
    one = client.post(
        COMPLETIONS, json=_text("Once upon a time", max_tokens=5, ignore_eos=True)
    ).json()
    assert one["object"] == "text_completion" and one["id"].startswith("cmpl-")
    assert len(one["choices"]) == 1 and one["usage"]["completion_tokens"] == 5

    texts = ["The sky is", "Cats like", "Numbers: 1, 2,"]
    many = client.post(COMPLETIONS, json=_text(texts, max_tokens=3, ignore_eos=True)).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert many["usage"]["completion_tokens"] == 9

    ids = [17, 4, 9001, 250, 33, 7]
    exact = client.post(COMPLETIONS, json=_text(ids, max_tokens=2)).json()
    assert exact["usage"]["prompt_tokens"] == len(ids)

    batches = client.post(COMPLETIONS, json=_text([[1, 2, 3], [4, 5]], max_tokens=2)).json()
    assert len(batches["choices"]) == 2 and batches["usage"]["prompt_tokens"] == 5


def test_completion_stream(client: httpx.Client) -> None:
    request = _text("Once upon a time", max_tokens=6, ignore_eos=True, stream=True)
    with client.stream("POST", COMPLETIONS, json=request) as response:
        data = _data_lines(response)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[-1]


def test_second_chat_turn_reuses_the_first(client: httpx.Client) -> None:
    first = [
        {
            "role": "system",
            "content": "You are a terse assistant who answers in one sentence. " * 4,
        },
        {"role": "user", "content": "Name a colour."},
    ]
    turn1 = client.post(CHAT, json=_chat(messages=first, temperature=0)).json()
    reply = turn1["choices"][0]["message"]
    second = [*first, reply, {"role": "user", "content": "And another one?"}]
    turn2 = client.post(CHAT, json=_chat(messages=second, temperature=0)).json()
    assert turn2["usage"]["prompt_tokens"] > turn1["usage"]["prompt_tokens"]
    assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_models_and_health(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"]) for m in models["data"]] == [(MODEL, "model")]
    health = client.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_health_follows_readiness(keyed: Served) -> None:
    keyed.readiness["ready"] = False
    try:
        assert httpx.get(f"{keyed.url}/health").status_code == 503
    finally:
        keyed.readiness["ready"] = True
    assert httpx.get(f"{keyed.url}/health").status_code == 200


def test_health_names_the_engine_it_is_told(tiny_model: Callable[[str], Path]) -> None:
    """Deployed, the gateway is told what computes (`emulated:NAME` or llama.cpp) and
    /health says so, ready or not; a gateway not told says only its status."""
    path = str(tiny_model("qwen35"))
    settings = GatewaySettings(MODEL, path, n_ctx=1024, engine="emulated:instant")

    async def ready() -> bool:
        return readiness["ready"]

    async def health(app: FastAPI) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.get("/health")

    readiness = {"ready": True}
    app = create_app(settings, FailingReplica(RuntimeError("unused")), ready=ready)
    found = asyncio.run(health(app))
    assert found.status_code == 200
    assert found.json() == {"status": "ok", "engine": "emulated:instant"}
    readiness["ready"] = False
    found = asyncio.run(health(app))
    assert found.status_code == 503
    assert found.json() == {"status": "unavailable", "engine": "emulated:instant"}
    plain = create_app(GatewaySettings(MODEL, path, n_ctx=1024), FailingReplica(RuntimeError()))
    assert asyncio.run(health(plain)).json() == {"status": "ok"}


# ---- the official client -------------------------------------------------------------------


def test_openai_client(served: Served) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    no_eos = {"ignore_eos": True}

    chat = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=6, extra_body=no_eos
    )
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 6
    assert chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens is not None

    text = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body=no_eos)
    assert text.usage is not None and text.usage.completion_tokens == 4

    ids = client.completions.create(model=MODEL, prompt=[11, 22, 33, 44], max_tokens=2)
    assert ids.usage is not None and ids.usage.prompt_tokens == 4

    stream = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=no_eos,
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"

    text_chunks = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=3, stream=True, extra_body=no_eos
    )
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"


def test_openai_client_errors(served: Served, keyed: Served) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=HELLO, n=3)  # 2 slots
    assert bad.value.param == "n" and bad.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=MODEL, prompt=[1] * 2000)
    assert long.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt="Hi")
    assert missing.value.code == "model_not_found"
    wrong_key = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as denied:
        wrong_key.models.list()
    assert denied.value.code == "invalid_api_key"
    assert openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY).models.list().data[0].id == MODEL


# ---- bad requests --------------------------------------------------------------------------


def _says(content: object) -> list[dict[str, object]]:
    return [{"role": "user", "content": content}]


TOO_LONG = (400, None, "context_length_exceeded")
IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
BAD_REQUESTS = [  # path, body (JSON, or raw bytes), then (status, param, code)
    pytest.param(
        CHAT, b'{"model": "baton-tiny", "messages": [', (400, None, None), id="malformed JSON"
    ),
    pytest.param(CHAT, b"", (400, None, None), id="empty body"),
    pytest.param(CHAT, b"[1, 2]", (400, None, None), id="a JSON array"),
    pytest.param(CHAT, {"messages": HELLO}, (400, "model", None), id="no model"),
    pytest.param(CHAT, _chat(messages="hi"), (400, "messages", None), id="messages not a list"),
    pytest.param(CHAT, _chat(messages=[]), (400, "messages", None), id="no messages"),
    pytest.param(
        CHAT, _chat(messages=_says(5)), (400, "messages[0].content", None), id="content a number"
    ),
    pytest.param(
        CHAT,
        _chat(messages=_says([{"type": "image_url"}])),
        (400, "messages[0].content", None),
        id="image",
    ),
    pytest.param(
        CHAT,
        _chat(messages=_says([{"type": "text", "text": "see"}, IMAGE_PART])),
        (400, "messages[0].content[1]", None),
        id="an image for a model without a projector",
    ),
    pytest.param(
        CHAT,
        _chat(
            messages=_says(
                [{"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}}]
            )
        ),
        (400, "messages[0].content[0]", None),
        id="audio for a model without a projector",
    ),
    pytest.param(CHAT, _chat(max_tokens=-1), (400, "max_tokens", None), id="max_tokens negative"),
    pytest.param(CHAT, _chat(max_tokens="many"), (400, "max_tokens", None), id="max_tokens a word"),
    pytest.param(
        CHAT, _chat(max_tokens=CAP + 1), (400, "max_tokens", None), id="max_tokens over the cap"
    ),
    pytest.param(CHAT, _chat(n=3), (400, "n", None), id="n over the slots"),
    pytest.param(CHAT, _chat(n=17), (400, "n", None), id="n over 16"),
    pytest.param(
        CHAT,
        _chat(functions=[]),
        (400, "functions", "unsupported_parameter"),
        id="legacy functions",
    ),
    pytest.param(
        CHAT,
        _chat(verbosity="low"),
        (400, "verbosity", "unsupported_parameter"),
        id="unknown field",
    ),
    pytest.param(
        CHAT,
        _chat(messages=[{"role": "user", "content": "x", "audio": {}}]),
        (400, "messages[0].audio", "unsupported_parameter"),
        id="unknown message field",
    ),
    pytest.param(
        CHAT,
        _chat(stream=True, stream_options={"include_usage": True, "x": 1}),
        (400, "stream_options.x", "unsupported_parameter"),
        id="unknown stream option",
    ),
    pytest.param(
        COMPLETIONS, _text("a", suffix="b"), (400, "suffix", "unsupported_parameter"), id="suffix"
    ),
    pytest.param(
        COMPLETIONS, _text("a", best_of=2), (400, "best_of", "unsupported_parameter"), id="best_of"
    ),
    pytest.param(CHAT, _chat(temperature=3), (400, "temperature", None), id="temperature 3"),
    pytest.param(CHAT, _chat(top_p=0), (400, "top_p", None), id="top_p 0"),
    pytest.param(CHAT, _chat(stop=["a", "b", "c", "d", "e"]), (400, "stop", None), id="five stops"),
    pytest.param(CHAT, _chat(stop=[""]), (400, "stop[0]", None), id="empty stop"),
    pytest.param(CHAT, _chat(seed=-1), (400, "seed", None), id="negative seed"),
    pytest.param(CHAT, _chat(top_logprobs=2), (400, "top_logprobs", None), id="top_logprobs alone"),
    pytest.param(
        CHAT, _chat(logprobs=True, top_logprobs=21), (400, "top_logprobs", None), id="top 21"
    ),
    pytest.param(CHAT, _chat(presence_penalty=2.5), (400, "presence_penalty", None), id="penalty"),
    pytest.param(
        CHAT, _chat(repetition_penalty=0), (400, "repetition_penalty", None), id="repetition 0"
    ),
    pytest.param(CHAT, _chat(logit_bias={"x": 1}), (400, "logit_bias", None), id="bias key"),
    pytest.param(
        CHAT, _chat(logit_bias={"10": 101}), (400, "logit_bias.10", None), id="bias > 100"
    ),
    pytest.param(
        CHAT, _chat(logit_bias={"99999999": 1}), (400, "logit_bias", None), id="bias id range"
    ),
    pytest.param(
        CHAT, _chat(stop_token_ids=[99999999]), (400, "stop_token_ids", None), id="stop id range"
    ),
    pytest.param(
        CHAT,
        _chat(stream_options={"include_usage": True}),
        (400, "stream_options", None),
        id="no stream",
    ),
    pytest.param(CHAT, _chat(model="gpt-4"), (404, "model", "model_not_found"), id="unknown model"),
    pytest.param(CHAT, _chat(messages=_says("word " * 2000)), TOO_LONG, id="huge chat"),
    pytest.param(COMPLETIONS, _text("word " * 2000), TOO_LONG, id="huge prompt"),
    pytest.param(COMPLETIONS, _text(5), (400, "prompt", None), id="prompt a number"),
    pytest.param(COMPLETIONS, _text([[1, 2], "a"]), (400, "prompt", None), id="mixed prompt"),
    pytest.param(COMPLETIONS, _text([1, 10**6]), (400, "prompt", None), id="token id too big"),
    pytest.param(COMPLETIONS, _text([-1, 2]), (400, "prompt", None), id="negative token id"),
    pytest.param(COMPLETIONS, _text([2**70]), (400, "prompt", None), id="token id past int64"),
    pytest.param(
        COMPLETIONS, _text("a", echo=True, logprobs=1), (400, "logprobs", None), id="echo+logprobs"
    ),
    pytest.param(
        COMPLETIONS,
        _text(["a", "b"], stream=True),
        (400, "prompt", None),
        id="stream of two prompts",
    ),
]


@pytest.mark.parametrize(("path", "body", "expected"), BAD_REQUESTS)
def test_bad_request_gets_an_openai_error(
    client: httpx.Client, path: str, body: object, expected: tuple[int, str | None, str | None]
) -> None:
    status, param, code = expected
    if isinstance(body, bytes):
        response = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    if code == "context_length_exceeded":
        assert "1024" in error["message"] and "prompt has" in error["message"]


def test_unknown_routes_get_openai_errors(client: httpx.Client) -> None:
    missing = client.post("/v1/embeddings", json={})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    wrong_method = client.get(CHAT)
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_oversized_body_is_refused_before_parsing(client: httpx.Client) -> None:
    big = b'{"model": "baton-tiny", "prompt": "' + b"a" * (5 << 20) + b'"}'
    declared = client.post(COMPLETIONS, content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: only the bytes tell
        for start in range(0, len(big), 1 << 16):
            yield big[start : start + (1 << 16)]

    streamed = client.post(
        COMPLETIONS, content=chunked(), headers={"content-type": "application/json"}
    )
    assert streamed.status_code == 413
    assert client.get("/health").status_code == 200


def test_harmless_fields_are_accepted(client: httpx.Client) -> None:
    """Fields with no effect on the reply are accepted, not refused; an unknown field's
    error names it."""
    harmless = {
        "user": "u-1",
        "metadata": {"team": "a"},
        "store": False,
        "service_tier": "auto",
        "safety_identifier": "s",
        "prompt_cache_key": "k",
    }
    assert client.post(CHAT, json=_chat(**harmless)).status_code == 200
    refused = client.post(CHAT, json=_chat(logit_bias_x=1, tools_x=2)).json()["error"]
    assert refused["param"] == "logit_bias_x" and refused["code"] == "unsupported_parameter"
    assert "logit_bias_x, tools_x" in refused["message"]
    for asking_for_more in ({"store": True}, {"service_tier": "priority"}):
        response = client.post(CHAT, json=_chat(**asking_for_more))
        assert response.status_code == 400, asking_for_more


def test_lone_surrogates_are_a_client_mistake(client: httpx.Client) -> None:
    """JSON can carry "\\ud800", which is not encodable text: a 400, never a 500."""
    bad = "text \ud800 here"
    for path, body in [
        (CHAT, _chat(messages=[{"role": "user", "content": bad}])),
        (COMPLETIONS, _text(bad)),
        ("/tokenize", {"content": bad}),
    ]:
        headers = {"content-type": "application/json"}
        response = client.post(path, content=json.dumps(body), headers=headers)  # \ud800 escaped
        assert response.status_code == 400, (path, response.text)
        assert "surrogate" in response.json()["error"]["message"]


def test_server_still_serves_after_bad_requests(client: httpx.Client) -> None:
    response = client.post(COMPLETIONS, json=_text("Still there?", max_tokens=2))
    assert response.status_code == 200, response.text


# ---- API keys ------------------------------------------------------------------------------


def test_api_key_is_required_on_the_api_only(keyed: Served) -> None:
    with httpx.Client(base_url=keyed.url) as client:
        wrong = "Bearer é".encode("latin-1")
        for headers in (
            {},
            {"authorization": "Bearer sk-wrong"},
            {"authorization": f"Basic {KEY}"},
            {b"authorization": wrong},
        ):
            denied = client.get("/v1/models", headers=headers)
            assert denied.status_code == 401
            assert denied.json()["error"]["code"] == "invalid_api_key"
            assert denied.headers["www-authenticate"] == "Bearer"
        assert (
            client.post(
                CHAT, content=b"{", headers={"content-type": "application/json"}
            ).status_code
            == 401
        )
        assert (
            client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        )
        assert client.get("/health").status_code == 200


# ---- client disconnects --------------------------------------------------------------------


def test_disconnect_mid_stream_frees_the_slot(keyed: Served) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    # About 20 s of generation if nothing stops it; the engine has one slot.
    long = _text("Tell me everything.", max_tokens=4000, ignore_eos=True, stream=True)
    with httpx.Client(base_url=keyed.url, headers=auth, timeout=60) as client:
        with client.stream("POST", COMPLETIONS, json=long) as response:
            assert response.status_code == 200
            received = 0
            for line in response.iter_lines():
                received += line.startswith("data: ")
                if received == 3:
                    break
        closed_at = time.monotonic()
        assert keyed.engine.wait_idle(timeout=10)
        assert time.monotonic() - closed_at < 5
        after = client.post(COMPLETIONS, json=_text("Next!", max_tokens=3))
        assert after.status_code == 200, after.text


# ---- failures of the replica ---------------------------------------------------------------


class FailingReplica:
    """Raises `error` at once, or after `tokens_first` tokens of a stream."""

    def __init__(self, error: Exception, tokens_first: int = 0) -> None:
        self.error = error
        self.tokens_first = tokens_first

    async def generate(self, request: ReplicaRequest) -> Completion:
        raise self.error

    async def stream(
        self, request: ReplicaRequest
    ) -> AsyncGenerator[TokenEvent | Completion, None]:
        for token in range(self.tokens_first):
            yield TokenEvent(token=token, text="x")
        raise self.error


def _post_in_process(app: FastAPI, body: dict[str, object]) -> httpx.Response:
    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.post(COMPLETIONS, json=body)

    return asyncio.run(post())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (RuntimeError("secret detail"), 500, None),
        (EngineClosed("engine shut down"), 503, "no_capacity"),
        (PromptTooLong(2000, 1024), 400, "context_length_exceeded"),
        (BackPressureError(8, 8, status_code=503, retry_after_s=1), 503, "no_capacity"),
        (BackPressureError(8, 8, status_code=429, retry_after_s=0.2), 429, "too_many_requests"),
    ],
    ids=["unexpected", "closed", "too long", "queue full", "queue full (429)"],
)
def test_replica_failures_map_to_statuses(
    tiny_model: Callable[[str], Path], error: Exception, status: int, code: str | None, stream: bool
) -> None:
    settings = GatewaySettings(model_name=MODEL, model_path=str(tiny_model("qwen35")), n_ctx=1024)
    app = create_app(settings, FailingReplica(error))
    response = _post_in_process(app, _text("Hi", stream=stream))
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    assert "secret" not in response.text
    if status in (429, 503):
        assert response.headers["retry-after"] == "1"


def test_failure_mid_stream_is_an_error_event(tiny_model: Callable[[str], Path]) -> None:
    settings = GatewaySettings(model_name=MODEL, model_path=str(tiny_model("qwen35")), n_ctx=1024)
    app = create_app(settings, FailingReplica(RuntimeError("secret detail"), tokens_first=2))
    response = _post_in_process(app, _text("Hi", stream=True))
    assert response.status_code == 200
    data = [
        line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")
    ]
    assert data[-1] == "[DONE]"
    assert [json.loads(d)["choices"][0]["text"] for d in data[:2]] == ["x", "x"]
    assert json.loads(data[-2])["error"]["type"] == "server_error"
    assert "secret" not in response.text


def test_api_key_is_required_under_a_route_prefix(tiny_model: Callable[[str], Path]) -> None:
    """Mounted at a prefix (a Serve `route_prefix`), Starlette's `path` includes the prefix:
    the key check must still apply to `/prefix/v1/...`."""
    settings = GatewaySettings(
        model_name=MODEL, model_path=str(tiny_model("qwen35")), n_ctx=1024, api_keys=(KEY,)
    )
    app = create_app(settings, FailingReplica(RuntimeError("unused")))

    async def get(headers: dict[str, str]) -> httpx.Response:
        transport = httpx.ASGITransport(app=app, root_path="/baton")
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.get("/baton/v1/models", headers=headers)

    assert asyncio.run(get({})).status_code == 401
    assert asyncio.run(get({"authorization": f"Bearer {KEY}"})).status_code == 200


def test_a_long_prefill_streams_headers_then_pings_then_tokens(
    tiny_model: Callable[[str], Path],
) -> None:
    """Headers go out once the replica admits the request, and SSE comments keep the
    connection busy until the first token (a real prefill of a long prompt); the official
    client reads through them."""
    settings = GatewaySettings(MODEL, str(tiny_model("llama")), n_ctx=8192, stream_ping_s=0.001)
    with serving(settings, EngineConfig(n_ctx=8192, n_slots=1, n_threads=1)) as served:
        body = {"model": MODEL, "prompt": [7] * 6000, "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event")
            lines = [line for line in r.iter_lines() if line]
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data: {"))
        pings = [line for line in lines[: first_data + 2] if line == ": ping"]
        assert pings, lines[:5]
        assert lines[-1] == "data: [DONE]"
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused")
        stream = client.completions.create(
            model=MODEL, prompt=[7] * 6000, max_tokens=3, stream=True
        )
        assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text) >= 1


# ---- sampling fields and log-probabilities ------------------------------------------------


def test_openai_client_logprobs(served: Served) -> None:
    """Chat logprobs through the official client: one entry per token, its text and bytes
    agree with the reply, the chosen token leads its alternatives (greedy)."""
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_completion_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    (choice,) = reply.choices
    entries = choice.logprobs.content
    assert len(entries) == reply.usage.completion_tokens == 6
    assert b"".join(bytes(e.bytes) for e in entries).decode() == choice.message.content
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_completion_tokens=6,
        temperature=0,
        logprobs=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = [
        entry
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    assert all(e.top_logprobs == [] for e in streamed)


def test_completion_logprobs_offsets(client: httpx.Client) -> None:
    body = _text("Once upon a time", max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    (choice,) = client.post(COMPLETIONS, json=body).json()["choices"]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"][0] == 0
    for i, token in enumerate(logprobs["tokens"][:-1]):
        assert logprobs["text_offset"][i + 1] == logprobs["text_offset"][i] + len(token)
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    assert all(p <= 0 for p in logprobs["token_logprobs"])

    lines = _stream_lines(client, {**body, "stream": True})
    chunks = [json.loads(line)["choices"][0] for line in lines if line != "[DONE]"]
    streamed = [c["logprobs"] for c in chunks if c.get("logprobs")]
    assert sum((s["tokens"] for s in streamed), []) == logprobs["tokens"]
    assert sum((s["text_offset"] for s in streamed), []) == logprobs["text_offset"]


def _stream_lines(client: httpx.Client, body: dict[str, object]) -> list[str]:
    with client.stream("POST", COMPLETIONS, json=body) as response:
        assert response.status_code == 200
        return _data_lines(response)


def test_logit_bias_and_penalties_reach_the_sampler(served: Served, client: httpx.Client) -> None:
    """-100 bans the greedy reply's first token; +100 forces a token; penalties give what
    the engine gives with them (their effect is tested in test_sampler_chain)."""
    prompt = (5, 6, 7)
    first = served.engine.generate(Prompt(tokens=prompt), SamplingParams(max_tokens=1)).tokens[0]

    def greedy_text(**fields: object) -> str:
        body = _text(list(prompt), max_tokens=8, temperature=0, ignore_eos=True, **fields)
        response = client.post(COMPLETIONS, json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    token_text = served.engine.model.token_text
    plain = greedy_text()
    assert plain.startswith(token_text(first))
    assert not greedy_text(logit_bias={str(first): -100}).startswith(token_text(first))
    assert greedy_text(logit_bias={"42": 100}) == token_text(42) * 8
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 1.5, "repetition_penalty": 1.3}
    direct = served.engine.generate(
        Prompt(tokens=prompt), SamplingParams(max_tokens=8, ignore_eos=True, **penalties)
    )
    assert greedy_text(**penalties) == direct.text  # the fields reach the sampler unchanged


# ---- /tokenize and /detokenize --------------------------------------------------------------


def test_tokenize_round_trip(served: Served, client: httpx.Client) -> None:
    """llama-server's shapes and defaults: no BOS unless asked, special tokens parsed."""
    text = "<|im_start|>Hello, wörld!"
    ids = client.post("/tokenize", json={"content": text}).json()["tokens"]
    assert ids == served.engine.model.tokenize(text)
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"content": text}
    pieces = client.post("/tokenize", json={"content": text, "with_pieces": True}).json()
    assert [p["id"] for p in pieces["tokens"]] == ids
    joined = b"".join(
        bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode()
        for p in pieces["tokens"]
    )
    assert joined.decode() == text
    literal = client.post("/tokenize", json={"content": text, "parse_special": False}).json()
    assert len(literal["tokens"]) > len(ids)
    with_bos = client.post("/tokenize", json={"content": "Hi", "add_special": True}).json()
    plain = client.post("/tokenize", json={"content": "Hi"}).json()
    bos = served.engine.model.bos_token
    assert with_bos["tokens"] == ([bos] if served.engine.model.add_bos else []) + plain["tokens"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/tokenize", {"content": "x", "extra": 1}, "extra"),
        ("/tokenize", {}, "content"),
    ],
)
def test_tokenizer_bad_input(client: httpx.Client, path: str, body: dict, param: str) -> None:
    response = client.post(path, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_tokenizer_needs_the_key(keyed: Served) -> None:
    with httpx.Client(base_url=keyed.url) as client:
        assert client.post("/tokenize", json={"content": "x"}).status_code == 401
        headers = {"Authorization": f"Bearer {KEY}"}
        assert client.post("/tokenize", json={"content": "x"}, headers=headers).status_code == 200


def test_tokenizer_on_a_vocabulary_without_text(tmp_path: Path) -> None:
    """A model whose vocabulary has no text: a clear 400, never a llama.cpp abort."""
    path = write_tiny_model("llama", tmp_path / "none.gguf", variant=ModelVariant(vocab="none"))
    settings = GatewaySettings(MODEL, str(path), n_ctx=256)
    with serving(settings, EngineConfig(n_ctx=256, n_slots=1, n_threads=1)) as served:
        with httpx.Client(base_url=served.url) as client:
            for path_, body in [("/tokenize", {"content": "x"}), ("/detokenize", {"tokens": [1]})]:
                response = client.post(path_, json=body)
                assert response.status_code == 400, response.text
                assert "text" in response.json()["error"]["message"]


# ---- n > 1 ---------------------------------------------------------------------------------


def test_n_choices_with_the_openai_client(served: Served) -> None:
    """Two choices from one prefill: whole and streamed (the SDK's deltas by index), seeded
    so that streamed equals whole; the prompt is counted once in the usage."""
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    asked = {"model": MODEL, "messages": HELLO, "n": 2, "temperature": 1.0, "seed": 4}
    limit = {"max_completion_tokens": 6, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**asked, **limit)
    assert [c.index for c in whole.choices] == [0, 1]
    texts = [c.message.content for c in whole.choices]
    assert texts[0] != texts[1]
    single = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_completion_tokens=6, extra_body={"ignore_eos": True}
    )
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens
    assert whole.usage.completion_tokens == 12

    streamed = {0: "", 1: ""}
    finished = {}
    for chunk in client.chat.completions.create(**asked, **limit, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert [streamed[0], streamed[1]] == texts
    assert finished == {0: "length", 1: "length"}


def test_n_choices_for_several_prompts_are_numbered_prompt_major(client: httpx.Client) -> None:
    body = _text(["One", "Two"], n=2, max_tokens=3, temperature=1.0, seed=1, ignore_eos=True)
    response = client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert response.json()["usage"]["completion_tokens"] == 12
