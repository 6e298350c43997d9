"""The whole Serve app end to end: real Ray cluster, real Redis, real HTTP, two replicas of
a generated hybrid model behind the gateway and Baton's request router."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest
import ray
from fixtures_ray import wait_healthy
from ray import serve
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
from ray.serve.handle import DeploymentHandle

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import GenerationRequest, ReplicaRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.deploy.app import APP_NAME, REPLICA_DEPLOYMENT, build_app
from baton_serve.deploy.config import BatonConfig
from baton_serve.loadtests.serve_app import replica_stats
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.router.gateway.serve_gateway import own_handle

ENGINE = EngineConfig(n_ctx=2048, n_slots=1, n_threads=1, prefill_chunk=128)
SYSTEM = "You answer in short sentences about routing, caches and state. " * 20


@pytest.fixture(scope="module", params=["embedded", "redis"])
def app(request, serve_port, tiny_model) -> Iterator[tuple[str, BatonConfig]]:
    index = (
        "embedded" if request.param == "embedded" else request.getfixturevalue("redis_server").url
    )
    config = BatonConfig(
        model=str(tiny_model("qwen35")),
        replicas=2,
        num_cpus_per_replica=0.5,
        engine=ENGINE,
        index=index,
        heartbeat_s=0.2,
        hmac_key=secrets.token_hex(16),
    )
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    url = f"http://127.0.0.1:{serve_port}"
    wait_healthy(url)
    yield url, config
    serve.delete(APP_NAME)


def _chat(
    url: str, config: BatonConfig, messages: list[dict], max_tokens: int = 8
) -> httpx.Response:
    body = {
        "model": config.served_model_name,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


def test_conversation_keeps_landing_on_the_replica_with_its_prefix(app) -> None:
    url, config = app
    messages = [{"role": "system", "content": SYSTEM}]
    served_by = []
    for turn in range(4):
        messages.append(
            {"role": "user", "content": f"Question {turn}: which replica holds item {turn}?"}
        )
        response = _chat(url, config, messages)
        body = response.json()
        served_by.append(response.headers["x-baton-replica"])
        if turn:
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, f"turn {turn}"
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    assert len(set(served_by[1:])) == 1, served_by


def test_a_busy_holders_load_spreads_by_shipping_its_state(app, tiny_model) -> None:
    """Long generations pile onto the conversation a replica holds: the other replica takes
    some of them by pulling the holder's state (not recomputing it), and the follow-up turn,
    wherever it lands, replies exactly what a cold engine computes."""
    url, config = app
    # Long enough that a pull pays at the tiny model's real prefill speed (10-26k tokens/s
    # here): shorter, recomputing it is cheaper, and the router and replicas know it.
    messages = [
        {"role": "system", "content": SYSTEM * 3 + " Shipping test."},
        {"role": "user", "content": "Start."},
    ]
    first = _chat(url, config, messages)
    holder = first.headers["x-baton-replica"]
    messages.append(
        {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}
    )
    messages.append({"role": "user", "content": "And now, from the other replica?"})
    time.sleep(1.0)  # the holder's end-of-reply checkpoint reaches the index
    pulls_before = _pulls(APP_NAME)

    # Long generations on the conversation the holder holds.
    busy = [
        threading.Thread(target=_chat, args=(url, config, messages[:2], 1200)) for _ in range(3)
    ]
    for thread in busy:
        thread.start()
    time.sleep(1.0)
    shipped = _chat(url, config, messages)
    for thread in busy:
        thread.join()

    pulled = {rid: n - pulls_before.get(rid, 0) for rid, n in _pulls(APP_NAME).items()}
    assert sum(n for rid, n in pulled.items() if rid != holder) >= 1, pulled
    usage = shipped.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # pulled or held, not recomputed
    with Engine(
        str(tiny_model("qwen35")), ENGINE.model_copy(update={"prefix_cache": False}), hmac_key=b"k"
    ) as cold:
        reference = cold.generate(cold.chat_prompt(messages), SamplingParams(max_tokens=8))
    assert shipped.json()["choices"][0]["message"]["content"] == reference.text
    assert usage["prompt_tokens"] == reference.usage.prompt_tokens


def _pulls(app: str) -> dict[str, int]:
    """Each replica's pull count."""
    return {s["replica_id"]: int(s["pulls"]) for s in asyncio.run(replica_stats(app))}


def test_a_request_over_4_mib_reaches_a_replica_over_grpc(app) -> None:
    """Serve's gRPC messages stop at 4 MiB by default; a request carries its prompt's text
    twice besides its tokens and hashes, past 4 MiB from about 250k tokens. The replicas take
    64 MiB (`SERVE_PROCESS_ENV`): here a 6 MiB text with a three-token prompt."""
    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, APP_NAME).options(
        method_name="generate", _by_reference=False
    )
    request = ReplicaRequest(
        generation=GenerationRequest(
            prompt=Prompt(tokens=(1, 2, 3)), sampling=SamplingParams(max_tokens=2)
        ),
        prompt="x" * (6 << 20),
    )
    completion = handle.remote(request).result(timeout_s=120)
    assert completion.usage.prompt_tokens == 3


def test_openai_client_against_the_served_app(app) -> None:
    url, config = app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model=config.served_model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=5
    )
    assert chat.choices[0].message.content is not None
    chunks = list(
        client.chat.completions.create(
            model=config.served_model_name,
            messages=[{"role": "user", "content": "Stream please"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    completion = client.completions.create(
        model=config.served_model_name, prompt=[1, 2, 3, 4], max_tokens=3
    )
    assert completion.usage.prompt_tokens == 4
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=config.served_model_name,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=-1,
        )


def test_bad_inputs_get_4xx_and_the_app_stays_healthy(app) -> None:
    url, config = app
    cases = [
        (b"{not json", 400),
        (b'{"model": 5, "messages": "no"}', 400),
        (
            b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "n": 3}'
            % config.served_model_name.encode(),
            400,
        ),
        (
            b'{"model": "%s", "prompt": "%s"}'
            % (config.served_model_name.encode(), b"word " * 5000),
            400,
        ),
    ]
    for body, status in cases:
        response = httpx.post(
            f"{url}/v1/chat/completions"
            if b"messages" in body or b"not json" in body
            else f"{url}/v1/completions",
            content=body,
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        assert response.status_code == status, (body[:60], response.text)
        assert "error" in response.json()
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    assert _chat(url, config, [{"role": "user", "content": "still here?"}]).status_code == 200


def test_the_checked_in_serve_config_builds_through_serves_own_loader(
    serve_port, tiny_model, tmp_path
) -> None:
    """What `serve run deploy/serve_config.yaml` does: validate the file with Serve's
    schema, import the builder, call it with the file's args (here overridden to a tiny
    model on one replica, and the cluster key's file: never the key itself), run the
    application."""
    import yaml
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(yaml.safe_load(open("deploy/serve_config.yaml")))
    (application,) = schema.applications
    key_file = tmp_path / "hmac-key"
    key_file.write_text("a-cluster-key-in-a-mounted-file")
    args = {
        **application.args,
        "hmac_key_file": str(key_file),
        "model": str(tiny_model("llama")),
        "replicas": 1,
        "num_cpus_per_replica": 0.5,
        "engine": {"n_ctx": 512, "n_slots": 1, "n_threads": 1},
    }
    built = call_user_app_builder_with_args_if_necessary(import_attr(application.import_path), args)
    serve.run(built, name="from-yaml", route_prefix="/from-yaml")
    try:
        response = httpx.post(
            f"http://127.0.0.1:{serve_port}/from-yaml/v1/completions",
            json={"model": tiny_model("llama").stem, "prompt": "Hello", "max_tokens": 3},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
    finally:
        serve.delete("from-yaml")


@serve.deployment(
    ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": {"BATON_PROBE": "kept"}}}
)
class ServeSettingsProbe:
    """What a replica's Serve runs by; with an environment of its own, as `replica_env` gives
    Baton's replicas."""

    def __call__(self) -> dict:
        import os

        from ray.serve._private import constants

        return {
            "haproxy": constants.RAY_SERVE_ENABLE_HA_PROXY,
            "grpc": constants.RAY_SERVE_USE_GRPC_BY_DEFAULT,
            "user_code_thread": constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD,
            "router_loop": constants.RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP,
            "own_env": os.environ.get("BATON_PROBE"),
        }


@serve.deployment(ray_actor_options={"num_cpus": 0})
class HandleTransportProbe:
    """Reports how a handle Serve passed in, and one remade here, reach their deployment."""

    def __init__(self, passed: DeploymentHandle) -> None:
        self._passed = passed

    def __call__(self) -> dict:
        return {
            "passed_by_reference": self._passed.handle_options._by_reference,
            "own_by_reference": own_handle(self._passed).handle_options._by_reference,
        }


def test_gateway_calls_replicas_over_grpc(serve_port) -> None:
    """A handle passed to a deployment keeps the driver's transport (Ray actor calls, by
    reference); the one the gateway remakes in its process (`own_handle`) follows the
    cluster's `SERVE_PROCESS_ENV`: gRPC."""
    app = HandleTransportProbe.bind(ServeSettingsProbe.bind())
    handle = serve.run(app, name="handle-transport", route_prefix=None)
    try:
        seen = handle.remote().result(timeout_s=60)
    finally:
        serve.delete("handle-transport")
    assert seen == {"passed_by_reference": True, "own_by_reference": False}


def test_serve_controller_loops_every_half_second(serve_port) -> None:
    """The controller sleeps 0.5 s between loops (`SERVE_PROCESS_ENV`), not Ray's 0.1 s: each
    loop that collects routing stats sends them to every handle of the deployment."""
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    metrics = ray.get(controller.get_health_metrics.remote(), timeout=60)
    assert metrics["last_sleep_duration_s"] >= 0.45, metrics


def test_http_comes_in_through_haproxy(serve_port) -> None:
    """The process that listens on Serve's HTTP port is HAProxy (`SERVE_PROCESS_ENV`), not
    Serve's Python proxy: a streamed chunk crosses no Ray hop between gateway and client."""
    listening = {
        c.pid
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == serve_port and c.pid
    }
    assert listening, f"nothing listens on Serve's port {serve_port}"
    assert {psutil.Process(pid).name() for pid in listening} == {"haproxy"}


def test_each_cluster_started_here_gets_its_own_haproxy_side_ports(monkeypatch) -> None:
    """HAProxy's exporter and stats ports are fixed by default; a cluster started on this
    machine gets free ones, so two Serve instances side by side both start (the tests that
    run `baton serve` or a benchmark beside this session's cluster do exactly that). A port
    the environment sets wins; a joined cluster keeps Ray's."""
    from baton_serve.deploy.local_ray import cluster_runtime_env

    names = ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    first, second = (cluster_runtime_env(started_here=True)["env_vars"] for _ in range(2))
    assert all(first[name].isdigit() and second[name].isdigit() for name in names)
    assert first[names[0]] != first[names[1]]
    assert not set(names) & set(cluster_runtime_env()["env_vars"])
    monkeypatch.setenv(names[1], "18404")
    assert cluster_runtime_env(started_here=True)["env_vars"][names[1]] == "18404"


def test_serve_processes_run_by_the_low_latency_settings(serve_port) -> None:
    """The local cluster's Serve processes call each other over gRPC and run user code and
    request routers on their own loop (`local_ray.SERVE_PROCESS_ENV`), also where a
    deployment sets variables of its own; this driver keeps Ray's defaults, so a handle
    still works outside asyncio."""
    handle = serve.run(ServeSettingsProbe.bind(), name="serve-settings", route_prefix=None)
    try:
        seen = handle.remote().result(timeout_s=60)
    finally:
        serve.delete("serve-settings")
    assert seen == {
        "haproxy": True,
        "grpc": True,
        "user_code_thread": False,
        "router_loop": False,
        "own_env": "kept",
    }
