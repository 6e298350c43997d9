"""API keys reach gateways as the cluster key reaches replicas: from a file or the gateway's
own environment, never inside Serve's deployment arguments or a Serve config's args (Serve
stores those in Ray's GCS, and the chart's GCS fault tolerance in Redis, and shows them).
The apps are built as Serve's controller builds them; the last test serves one."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures_ray import wait_healthy
from gateway_harness import post_slowly
from ray import serve
from serve_build import clear_baton_variables, deployments, kept_by_serve

from baton_serve.deploy import app as app_module
from baton_serve.deploy.app import APP_NAME, GATEWAY_DEPLOYMENT, build_app
from baton_serve.deploy.config import BatonConfig, ConfigError, load_config, to_serve_args
from baton_serve.deploy.serve_config import serve_config
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.router.gateway.api_key_source import APIKeyError, APIKeySource

KEYS = ("sk-travel-do-not-leak-1", "sk-travel-do-not-leak-2")
HMAC_KEY = "cluster-key-for-the-api-key-tests"


@pytest.fixture(autouse=True)
def no_baton_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_baton_variables(monkeypatch)


def gateway_keys(built: dict[str, Any]) -> APIKeySource:
    """What the gateway deployment's arguments say of its keys (settings, replicas, keys…)."""
    settings, _, keys, *_ = built[GATEWAY_DEPLOYMENT].init_args
    assert settings.api_keys == ()
    return keys


def assert_no_key_in(built: dict[str, Any]) -> None:
    """Nothing Serve keeps of any deployment (arguments, options, config) holds a key."""
    for deployment in built.values():
        kept = kept_by_serve(deployment)
        assert not [key for key in KEYS if key.encode() in kept]


def test_serve_args_and_a_serve_config_carry_no_api_key() -> None:
    """Before, `to_serve_args` revealed the keys into the args, and `baton serve-config`
    wrote them into the Serve config; now a config with keys is refused there, naming where
    keys go instead."""
    config = BatonConfig(api_keys=KEYS)
    args = to_serve_args(config)
    assert "api_keys" not in args and not [key for key in KEYS if key in repr(args)]
    with pytest.raises(ConfigError, match="cannot carry api_keys") as refused:
        serve_config(config)
    assert "BATON_API_KEYS" in str(refused.value)
    assert not [key for key in KEYS if key in str(refused.value)]


def test_a_local_app_hands_gateways_a_private_key_file_not_the_keys(
    tiny_model: Callable[[str], Path],
) -> None:
    config = BatonConfig(model=str(tiny_model("llama")), replicas=1, api_keys=KEYS)
    built = deployments(build_app(config))
    assert_no_key_in(built)
    keys = gateway_keys(built)
    assert keys.required and keys.file is not None
    key_file = Path(keys.file)
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert key_file.parent.stat().st_mode & 0o777 == 0o700
    assert keys.read(env={}) == KEYS

    open_app = deployments(build_app(BatonConfig(model=str(tiny_model("llama")))))
    assert gateway_keys(open_app) == APIKeySource(required=False)


def test_with_the_keys_in_the_environment_gateways_read_their_own(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATON_API_KEYS", ",".join(KEYS))
    config = load_config(overrides={"model": str(tiny_model("llama")), "replicas": 1})
    built = deployments(build_app(config))
    assert gateway_keys(built) == APIKeySource(required=True)
    assert_no_key_in(built)
    assert gateway_keys(built).read() == KEYS


def test_app_builder_takes_the_keys_from_the_nodes_never_from_args(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATON_HMAC_KEY", HMAC_KEY)
    args = {"model": str(tiny_model("llama")), "replicas": 1}
    with pytest.raises(ConfigError, match="must not hold api_keys") as in_args:
        app_module.app_builder({**args, "api_keys": list(KEYS)})
    assert not [key for key in KEYS if key in str(in_args.value)]
    mounted = tmp_path / "api-keys"
    mounted.write_text("\n".join(KEYS) + "\n")  # as a Secret mounted as a file may hold them
    monkeypatch.setenv("BATON_API_KEYS_FILE", str(mounted))
    built = deployments(app_module.app_builder(args))
    assert gateway_keys(built) == APIKeySource(required=True, file=str(mounted))
    assert_no_key_in(built)


def test_reading_the_keys_names_what_is_missing(tmp_path: Path) -> None:
    """A gateway whose keys are required but cannot be read fails to start (it never serves
    without auth), saying where it looked."""
    required = APIKeySource(required=True)
    with pytest.raises(APIKeyError, match="BATON_API_KEYS holds none"):
        required.read(env={})
    with pytest.raises(APIKeyError, match="cannot read the API keys file .*missing"):
        APIKeySource(required=True, file=str(tmp_path / "missing")).read(env={})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(APIKeyError, match=f"the API keys file {empty} holds none"):
        required.read(env={"BATON_API_KEYS_FILE": str(empty)})
    assert required.read(env={"BATON_API_KEYS": f" {KEYS[0]} ,{KEYS[1]}\n"}) == KEYS
    assert APIKeySource(required=False).read(env={"BATON_API_KEYS": KEYS[0]}) == ()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"api_keys": ["a,b"]}, "must not hold a comma"),
        ({"api_keys": ["a\nb"]}, "must not hold a comma or a line break"),
        ({"api_keys": list(KEYS), "api_keys_file": "/keys"}, "api_keys_file"),
    ],
)
def test_keys_that_could_not_travel_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(env={}, overrides=settings)


def test_a_served_gateway_reads_its_keys_on_its_node_and_cuts_a_trickled_body(
    tiny_model: Callable[[str], Path], serve_port: int
) -> None:
    """The real app on the session's Ray Serve (HAProxy, then the gateway replica): the
    gateway reads the keys from the file the builder wrote and refuses a request without
    one; a body trickled through HAProxy gets the gateway's 408 after its 2 s deadline while
    a normal request beside it is answered."""
    config = BatonConfig(
        model=str(tiny_model("llama")),
        replicas=1,
        num_cpus_per_replica=0.5,
        engine=EngineConfig(n_ctx=512, n_slots=1, n_threads=1),
        hmac_key=secrets.token_hex(16),
        api_keys=KEYS,
        body_read_timeout_s=2.0,
    )
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    url = f"http://127.0.0.1:{serve_port}"
    try:
        wait_healthy(url)
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
        keyed = {"Authorization": f"Bearer {KEYS[1]}"}
        assert httpx.get(f"{url}/v1/models", headers=keyed, timeout=30).status_code == 200
        chat = {
            "model": config.served_model_name,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 2,
        }

        async def beside() -> tuple[tuple[float, bytes, bool], httpx.Response]:
            body = httpx.Request("POST", url, json=chat).content
            trickled = asyncio.create_task(post_slowly(url, body, 0.5, headers=keyed))
            await asyncio.sleep(0.5)
            async with httpx.AsyncClient(base_url=url, headers=keyed, timeout=60) as client:
                normal = await client.post("/v1/chat/completions", json=chat)
            return await trickled, normal

        # HAProxy keeps the client's connection (its own client timeout); the gateway's
        # slot is what the deadline frees.
        (answered_s, reply, _), normal = asyncio.run(beside())
        assert normal.status_code == 200, normal.text
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:300]
        assert b"body_read_timeout_s" in reply and 2.0 <= answered_s < 4.0, answered_s
    finally:
        serve.delete(APP_NAME)
