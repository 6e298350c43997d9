"""Traces and structured logs in one process: the real gateway app in front of real replicas
of a generated hybrid model, spans kept by the OpenTelemetry SDK's in-memory exporter, log
lines written as JSON to a buffer."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from baton_serve.cache_store.index.index_connect import connect_index
from baton_serve.cache_store.pull_cost import ShipCost
from baton_serve.cache_store.telemetry import tracing
from baton_serve.cache_store.telemetry.logs import configure_logging
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import GenerationRequest, ReplicaRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.replica import Replica
from baton_serve.replicas.shipping import ShippedBlob, ShipPolicy
from baton_serve.router.gateway.gateway import GatewaySettings, create_app

MODEL = "baton-tiny"
KEY = "sk-observability-key"
CONFIG = EngineConfig(n_ctx=1024, n_slots=1, n_threads=2)
SECRET_PROMPT = "The launch code is pineapple-marmalade"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process for the test, into an in-memory exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    yield exporter
    tracing.use_provider(None)
    provider.shutdown()


@pytest.fixture
def log_lines() -> Iterator[Callable[[], list[dict]]]:
    """The `baton` loggers as JSON into a buffer; call the fixture for the lines so far."""
    buffer = io.StringIO()
    configure_logging("json", "INFO", stream=buffer)
    yield lambda: [json.loads(line) for line in buffer.getvalue().splitlines()]
    logger = logging.getLogger("baton")
    logger.handlers.clear()
    logger.setLevel(logging.NOTSET)
    logger.propagate = True


@contextlib.asynccontextmanager
async def _gateway(model: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway app (wanting API key KEY) over one replica, spoken to in process."""
    engine = Engine(str(model), CONFIG, hmac_key=b"k")
    replica = Replica("r0", engine)
    await replica.start()
    settings = GatewaySettings(MODEL, str(model), n_ctx=CONFIG.n_ctx, api_keys=(KEY,))
    app = create_app(settings, replica)
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as client,
        ):
            yield client
    finally:
        await replica.close()
        engine.close()


def _chat(messages: list[dict[str, str]], max_tokens: int = 6) -> dict[str, object]:
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True}


def _by_name(spans: tuple[ReadableSpan, ...], trace_id: int) -> dict[str, list[ReadableSpan]]:
    named: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        if span.context.trace_id == trace_id:
            named.setdefault(span.name, []).append(span)
    return named


def test_one_trace_from_the_client_through_gateway_replica_and_engine(
    spans: InMemorySpanExporter, tiny_model: Callable[[str], Path]
) -> None:
    async def conversation() -> dict:
        async with _gateway(tiny_model("qwen35")) as client:
            messages = [{"role": "user", "content": SECRET_PROMPT + " Tell me more."}]
            first = (await client.post("/v1/chat/completions", json=_chat(messages))).json()
            messages += [
                {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And then?"},
            ]
            traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
            response = await client.post(
                "/v1/chat/completions",
                json=_chat(messages),
                headers={"traceparent": traceparent},
            )
            assert response.status_code == 200, response.text
            return response.json()

    second = asyncio.run(conversation())
    named = _by_name(spans.get_finished_spans(), int(CLIENT_TRACE, 16))

    (root,) = named["POST /v1/chat/completions"]
    assert root.kind is SpanKind.SERVER
    assert root.parent is not None and root.parent.span_id == int(CLIENT_SPAN, 16)
    assert root.attributes["http.response.status_code"] == 200
    assert second["id"] == f"chatcmpl-{root.attributes['baton.request_id']}"
    for name in ("auth", "tokenise", "hash", "replica"):
        (span,) = named[name]
        assert span.parent.span_id == root.context.span_id, name
    assert named["auth"][0].attributes["baton.authorized"] is True
    assert named["tokenise"][0].attributes["baton.prompt_tokens"] > 0

    (replica,) = named["replica"]
    usage = second["usage"]
    assert replica.attributes["baton.replica"] == "r0"
    assert (
        replica.attributes["baton.cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    )
    phases = [named[name][0] for name in ("queue", "restore", "prefill", "decode")]
    for phase in phases:
        assert phase.parent.span_id == replica.context.span_id
        assert replica.start_time <= phase.start_time <= phase.end_time <= replica.end_time
    for before, after in zip(phases, phases[1:]):
        assert before.end_time == after.start_time  # one after the other, no gap
    restore, prefill, decode = phases[1:]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and restore.attributes["baton.tokens_restored"] == cached
    assert prefill.attributes["baton.tokens_computed"] == usage["prompt_tokens"] - cached
    assert decode.attributes["baton.tokens_generated"] == usage["completion_tokens"] == 6
    assert decode.attributes["baton.tokens_per_s"] > 0
    assert not any(
        SECRET_PROMPT in json.dumps(dict(s.attributes)) for s in spans.get_finished_spans()
    )


class _LocalPeer:
    """The `PeerDirectory` of two replicas in one process: a fetch is the peer's own export,
    a bit flipped on the way when asked (a blob damaged in transit)."""

    def __init__(self, peer: Replica, flip_bit: int | None = None) -> None:
        self.peer, self.flip_bit = peer, flip_bit

    async def fetch(
        self, replica_id: str, tokens: tuple[int, ...], min_tokens: int, wait_s: float = 0.0
    ) -> ShippedBlob | None:
        blob = await self.peer.export_when_ready(tokens, min_tokens, wait_s)
        if blob is not None and self.flip_bit is not None:
            head, state = blob
            damaged = bytearray(head)  # the bit is one of the header's
            damaged[self.flip_bit // 8] ^= 1 << (self.flip_bit % 8)
            blob = bytes(damaged), state
        return blob


@pytest.mark.parametrize(
    ("flip_bit", "outcome", "reason"),
    [(None, "pulled", None), (8 * 120 + 1, "rejected", "bad_hmac")],  # a bit of the HMAC
    ids=["pulled", "damaged"],
)
def test_a_pull_from_a_peer_is_a_span_with_its_bytes_and_outcome(
    flip_bit: int | None,
    outcome: str,
    reason: str | None,
    spans: InMemorySpanExporter,
    log_lines: Callable[[], list[dict]],
    redis_server,
    tiny_model: Callable[[str], Path],
) -> None:
    path = str(tiny_model("qwen35"))
    prompt = tuple(int(t) for t in np.random.default_rng(7).integers(1000, 40000, size=400))
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    eager = ShipPolicy(ShipCost(min_gain_tokens=16, safety=1.0), prefill_tokens_per_s=50.0)

    async def scenario() -> ReplicaRequest:
        with Engine(path, CONFIG, hmac_key=b"k") as a, Engine(path, CONFIG, hmac_key=b"k") as b:
            a_index = await connect_index(redis_server.url, a.fingerprint)
            b_index = await connect_index(redis_server.url, b.fingerprint)
            holder = Replica(f"holder-{outcome}", a, index=a_index, heartbeat_s=0.1)
            puller = Replica(
                f"puller-{outcome}",
                b,
                index=b_index,
                peers=_LocalPeer(holder, flip_bit),
                policy=eager,
            )
            await holder.start()
            await puller.start()
            first = await holder.generate(
                ReplicaRequest(
                    generation=GenerationRequest(prompt=Prompt(tokens=prompt), sampling=sampling)
                )
            )
            await asyncio.to_thread(a.wait_idle, 10)
            history = prompt + tuple(first.tokens)
            for _ in range(100):  # the holder's checkpoints reach the index
                if holder.replica_id in await b_index.lookup(b.hash_chain(history)):
                    break
                await asyncio.sleep(0.05)
            follow_up = ReplicaRequest(
                generation=GenerationRequest(
                    prompt=Prompt(tokens=history + (5, 6, 7)), sampling=sampling
                ),
                trace_context={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
            )
            await puller.generate(follow_up)
            for replica, index in ((holder, a_index), (puller, b_index)):
                await replica.close()
                await index.close()
            return follow_up

    request = asyncio.run(scenario())
    named = _by_name(spans.get_finished_spans(), int(CLIENT_TRACE, 16))
    (replica,) = named["replica"]
    (lookup,) = named["index.lookup"]
    (pull,) = named["pull"]
    assert lookup.parent.span_id == pull.parent.span_id == replica.context.span_id
    assert pull.attributes["baton.peer"] == f"holder-{outcome}"
    assert pull.attributes["baton.pull.outcome"] == outcome
    assert pull.attributes["baton.pull.bytes"] > 0 and pull.attributes["baton.pull.fetch_ms"] > 0
    assert pull.attributes.get("baton.pull.reject_reason") == reason
    restored = named["restore"][0].attributes["baton.tokens_restored"]
    assert (restored > 0) == (outcome == "pulled")

    request_id = request.generation.request_id
    lines = [line for line in log_lines() if line.get("request_id") == request_id]
    assert lines[-1]["logger"] == "baton.replica" and lines[-1]["cached_tokens"] == restored
    assert lines[-1]["trace_id"] == CLIENT_TRACE
    if reason:
        (rejected,) = [line for line in lines if line["level"] == "WARNING"]
        assert "rejected a state blob" in rejected["msg"]


def test_json_log_lines_name_their_request_and_hold_no_prompt_or_key(
    log_lines: Callable[[], list[dict]], tiny_model: Callable[[str], Path]
) -> None:
    async def requests() -> list[str]:
        async with _gateway(tiny_model("qwen35")) as client:
            ids = []
            for body in (
                _chat([{"role": "user", "content": SECRET_PROMPT}]),
                {"model": MODEL, "prompt": SECRET_PROMPT, "max_tokens": 3, "stream": True},
            ):
                response = await client.post(
                    "/v1/chat/completions" if "messages" in body else "/v1/completions", json=body
                )
                assert response.status_code == 200
                ids.append(re.search(r'"id":"(?:chat)?cmpl-([0-9a-f]+)"', response.text)[1])
            unknown = await client.post("/v1/completions", json={**body, "model": "nope"})
            assert unknown.status_code == 404
            return ids

    ids = asyncio.run(requests())
    lines = log_lines()
    text = json.dumps(lines)
    assert SECRET_PROMPT not in text and "pineapple" not in text and KEY not in text
    assert all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    for request_id in ids:
        mine = [line for line in lines if line.get("request_id") == request_id]
        gateway = [line for line in mine if line["logger"] == "baton.gateway"]
        replica = [line for line in mine if line["logger"] == "baton.replica"]
        assert len(gateway) == 1 and gateway[0]["status"] == 200
        assert len(replica) == 1 and replica[0]["prompt_tokens"] > 0
    statuses = [line["status"] for line in lines if line["logger"] == "baton.gateway"]
    assert statuses == [200, 200, 404]


def test_tracing_is_off_unless_the_environment_asks(capsys: pytest.CaptureFixture[str]) -> None:
    assert tracing.span_processors({}) == []
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert tracing.span_processors({**endpoint, "OTEL_TRACES_EXPORTER": "none"}) == []
    assert tracing.span_processors({**endpoint, "OTEL_SDK_DISABLED": "true"}) == []
    (otlp,) = tracing.span_processors(endpoint)
    assert isinstance(otlp, BatchSpanProcessor)
    otlp.shutdown()

    (console,) = tracing.span_processors({"OTEL_TRACES_EXPORTER": "console"})
    provider = TracerProvider()
    provider.add_span_processor(console)
    provider.get_tracer("test").start_span("printed").end()
    provider.shutdown()
    assert json.loads(capsys.readouterr().out)["name"] == "printed"
