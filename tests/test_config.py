"""Baton's configuration: sources and their priority, validation messages, secrets, Serve args."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from baton_serve.deploy.config import (
    BatonConfig,
    ConfigError,
    RouterPolicy,
    config_from_serve_args,
    load_config,
    to_serve_args,
)
from baton_serve.deploy.serve_config import serve_config, write_serve_config
from baton_serve.replicas.engine.engine_config import EngineConfig, for_device

API_KEY = "sk-api-key-do-not-leak"
HMAC_KEY = "hmac-key-do-not-leak-0123456789"
REDIS_PASSWORD = "redis-password-do-not-leak"


def write_yaml(folder: Path, data: object) -> Path:
    path = folder / "baton.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def config_error(**kwargs: object) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(**{"env": {}, **kwargs})  # type: ignore[arg-type]
    return str(caught.value)


def test_defaults() -> None:
    config = load_config(env={})
    assert config == BatonConfig()
    assert config.model is None
    assert config.replicas == 2 and config.gateway_replicas == 1
    assert config.num_gpus_per_replica == 0 and config.num_cpus_per_replica == 1.0
    assert config.engine == EngineConfig()
    assert config.index == "embedded"
    assert config.router is RouterPolicy.BATON
    assert config.api_keys == () and config.hmac_key is None
    assert (config.host, config.port) == ("127.0.0.1", 8000)
    assert config.max_body_bytes == 4 * 1024 * 1024
    assert config.heartbeat_s == 5.0
    assert config.served_model_name == "SmolLM2-135M-Instruct.Q4_1"


def test_the_retired_prefill_budget_is_read_as_step_tokens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="baton.engine"):
        assert EngineConfig(prefill_budget=512).step_tokens == 512
    assert "prefill_budget is retired" in caplog.text
    assert EngineConfig(prefill_budget=0).step_tokens == 1  # one piece a step, as before
    assert EngineConfig(prefill_budget=64, step_tokens=300).step_tokens == 300


def test_device_dependent_settings_are_decided_by_where_the_model_runs() -> None:
    cpu, gpu = for_device(EngineConfig(), False), for_device(EngineConfig(), True)
    assert (cpu.exact_reuse, cpu.flash_attn, cpu.one_call_steps) == (True, False, False)
    assert (gpu.exact_reuse, gpu.flash_attn, gpu.one_call_steps) == (False, None, True)
    chosen = EngineConfig(exact_reuse=True, flash_attn=True)
    assert for_device(chosen, True) == chosen and for_device(chosen, False) == chosen
    assert not EngineConfig().one_call_steps  # unresolved: as on the CPU


def test_a_step_in_one_call_fits_n_batch() -> None:
    exact = EngineConfig(step_tokens=4096, n_batch=512)
    assert not exact.one_call_steps and exact.step_budget == 4096  # each piece its own call
    one_call = EngineConfig(step_tokens=4096, n_batch=512, exact_reuse=False)
    assert one_call.one_call_steps and one_call.step_budget == 512


def test_yaml_file(tmp_path: Path) -> None:
    model = tmp_path / "qwen.gguf"
    model.write_bytes(b"GGUF")
    path = write_yaml(
        tmp_path,
        {
            "model": str(model),
            "replicas": 3,
            "engine": {"n_ctx": 2048, "n_slots": 8},
            "index": "redis://cache:6379/0",
            "router": "prefix-affinity",
            "api_keys": ["a-key", "b-key"],
        },
    )
    config = load_config(path, env={})
    assert config.model == str(model)
    assert config.served_model_name == "qwen"
    assert config.replicas == 3
    assert (config.engine.n_ctx, config.engine.n_slots) == (2048, 8)
    assert config.index == "redis://cache:6379/0"
    assert config.router is RouterPolicy.PREFIX_AFFINITY
    assert [key.get_secret_value() for key in config.api_keys] == ["a-key", "b-key"]


def test_env_overrides_yaml_and_nested_settings_merge(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"replicas": 3, "port": 9000, "engine": {"n_ctx": 2048}})
    env = {
        "BATON_REPLICAS": "5",
        "BATON_ENGINE__N_SLOTS": "8",
        "BATON_ROUTER": "pow2",
        "BATON_NUM_GPUS_PER_REPLICA": "0.5",
        "BATON_CACHE_DIR": "/tmp/elsewhere",  # another BATON_ variable, not a setting
        "PATH": "/usr/bin",
    }
    config = load_config(path, env=env)
    assert config.replicas == 5
    assert config.port == 9000
    assert (config.engine.n_ctx, config.engine.n_slots) == (2048, 8)
    assert config.router is RouterPolicy.POW2
    assert config.num_gpus_per_replica == 0.5


def test_nested_engine_from_env() -> None:
    config = load_config(env={"BATON_ENGINE__N_CTX": "2048", "BATON_ENGINE__FLASH_ATTN": "true"})
    assert config.engine.n_ctx == 2048
    assert config.engine.flash_attn is True
    assert config.engine.n_slots == EngineConfig().n_slots


def test_api_keys_from_env_list() -> None:
    config = load_config(env={"BATON_API_KEYS": " one, two ,,three "})
    assert [key.get_secret_value() for key in config.api_keys] == ["one", "two", "three"]
    assert load_config(env={"BATON_API_KEYS": ""}).api_keys == ()


def test_overrides_beat_env_and_none_is_ignored(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"replicas": 3, "heartbeat_s": 2.0})
    env = {"BATON_REPLICAS": "5", "BATON_PORT": "9000", "BATON_ENGINE__N_CTX": "2048"}
    overrides = {
        "replicas": 7,
        "port": None,
        "model": None,
        "engine": {"n_ctx": 1024, "n_slots": None},
    }
    config = load_config(path, env=env, overrides=overrides)
    assert config.replicas == 7
    assert config.port == 9000
    assert config.heartbeat_s == 2.0
    assert config.model is None
    assert config.engine.n_ctx == 1024
    assert config.engine.n_slots == EngineConfig().n_slots


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_GATEWAY_REPLICAS", "3")
    assert load_config().gateway_replicas == 3


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"replicas": 0}, "replicas: Input should be greater than or equal to 1"),
        ({"num_gpus_per_replica": -1}, "num_gpus_per_replica: Input should be greater than or"),
        ({"num_cpus_per_replica": 0}, "num_cpus_per_replica: Input should be greater than 0"),
        ({"gateway_replicas": 0}, "gateway_replicas: Input should be greater than or equal to 1"),
        (
            {"engine": {"n_ctx": 10}},
            "engine.n_ctx: must be 0 (the model's training context) or at least 64",
        ),
        (
            {"engine": {"n_slots": 8, "n_batch": 4, "prefill_chunk": 4}},
            "engine: n_slots (8) exceeds n_batch (4)",
        ),
        ({"engine": {"bogus": 1}}, "engine.bogus: unknown setting"),
        (
            {"engine": {"disk_budget_bytes": -1}},
            "engine.disk_budget_bytes: Input should be greater than or equal to 0",
        ),
        ({"engine": {"checkpoint_dir": ""}}, "engine.checkpoint_dir: String should have at least"),
        ({"index": "memcached://x"}, "index: expected 'embedded' or a redis:// or rediss:// URL"),
        ({"router": "random"}, "router: Input should be 'baton', 'pow2', 'prefix-affinity' or"),
        ({"port": 0}, "port: Input should be greater than or equal to 1"),
        ({"port": 70000}, "port: Input should be less than or equal to 65535"),
        ({"port": "http"}, "port: Input should be a valid integer"),
        ({"host": ""}, "host: String should have at least 1 character"),
        ({"max_body_bytes": 0}, "max_body_bytes: Input should be greater than or equal to 1"),
        ({"heartbeat_s": 0}, "heartbeat_s: Input should be greater than 0"),
        ({"heartbeat_s": float("inf")}, "heartbeat_s: Input should be a finite number"),
        (
            {"heartbeat_s": 20},
            "config: liveness_ttl_s (15) must exceed heartbeat_s (20), or live replicas drop",
        ),
        ({"liveness_ttl_s": -1}, "liveness_ttl_s: Input should be greater than 0"),
        (
            {"router": "pow2", "handoff_s": 5},
            "config: handoff_s (5) needs router 'baton': only Baton's router sends a state",
        ),
        ({"handoff_s": -1}, "handoff_s: Input should be greater than or equal to 0"),
        (
            {"router": "round-robin", "pull_bandwidth_gb_s": 25},
            "config: pull_bandwidth_gb_s needs router 'baton': round-robin never reads it",
        ),
        ({"pull_bandwidth_gb_s": 0}, "pull_bandwidth_gb_s: Input should be greater than 0"),
        (
            {"router": "pow2", "routing": {"load_slack": 1}},
            "config: routing needs router 'baton': pow2 never reads it",
        ),
        ({"routing": {"pull_safety": 2}}, "routing.pull_safety: Input should be less than or"),
        ({"routing": {"slack": 1}}, "routing.slack: unknown setting"),
        ({"replica_resources": {"CPU": 1}}, "replica_resources: 'CPU' is not a custom resource"),
        ({"gateway_resources": {"node:__internal_head__": 1}}, "is not a custom resource"),
        ({"replica_resources": {"gpu_node": 0}}, "'gpu_node': the amount must be positive, got 0"),
        ({"replica_resources": {"a": "inf"}}, "'a': the amount must be positive, got inf"),
        ({"replica_resources": {"a": "x"}}, "replica_resources.a: Input should be a valid number"),
        ({"max_replicas_per_node": 0}, "max_replicas_per_node: Input should be greater than or"),
        ({"model": "/no/such/model.gguf"}, "model: model file not found: /no/such/model.gguf"),
        ({"model": "tiny:gpt9"}, "model: unknown tiny model 'gpt9'; choose from llama, qwen35"),
        ({"model": ""}, "model: must not be empty"),
        ({"model_name": " "}, "model_name: must not be empty"),
        ({"api_keys": ["ok-key", ""]}, "api_keys: an API key must not be empty"),
        ({"hmac_key": "short"}, "hmac_key: must be at least 16 characters"),
        ({"bogus": 1}, "bogus: unknown setting"),
    ],
)
def test_errors_name_the_field(overrides: dict[str, object], expected: str) -> None:
    assert expected in config_error(overrides=overrides)


def test_every_problem_is_listed_and_env_values_are_checked() -> None:
    message = config_error(
        env={"BATON_REPLICAS": "many", "BATON_ENGINE__N_CTX": "1", "BATON_INDEX": "mysql://db"}
    )
    assert "replicas: Input should be a valid integer" in message
    assert "engine.n_ctx: must be 0 (the model's training context) or at least 64" in message
    assert "index: expected 'embedded'" in message


def test_unknown_yaml_key_is_named(tmp_path: Path) -> None:
    message = config_error(yaml_path=write_yaml(tmp_path, {"replica": 3, "engine": {"nctx": 1}}))
    assert "replica: unknown setting" in message
    assert "engine.nctx: unknown setting" in message


def test_bad_yaml_files_are_named(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(f"hmac_key: {HMAC_KEY}\nreplicas: [2\n")
    message = config_error(yaml_path=broken)
    assert str(broken) in message and "line" in message
    assert HMAC_KEY not in message

    listing = tmp_path / "list.yaml"
    listing.write_text("- replicas\n")
    assert f"config file {listing} must hold a mapping" in config_error(yaml_path=listing)

    missing = tmp_path / "missing.yaml"
    assert f"cannot read config file {missing}" in config_error(yaml_path=missing)

    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty, env={}) == BatonConfig()


def test_secrets_hidden_in_repr_and_errors() -> None:
    config = load_config(
        env={
            "BATON_API_KEYS": API_KEY,
            "BATON_HMAC_KEY": HMAC_KEY,
            "BATON_INDEX": f"redis://:{REDIS_PASSWORD}@cache:6379/0",
        }
    )
    for text in (repr(config), str(config)):
        assert API_KEY not in text and HMAC_KEY not in text and REDIS_PASSWORD not in text
    assert "redis://***@cache:6379/0" in repr(config)
    assert config.index == f"redis://:{REDIS_PASSWORD}@cache:6379/0"  # the value itself is intact

    message = config_error(
        overrides={
            "api_keys": [API_KEY, 7],
            "hmac_key": HMAC_KEY[:8],
            "index": f"http://:{REDIS_PASSWORD}@cache",
            "replicas": 0,
        }
    )
    assert "api_keys.1" in message and "hmac_key" in message and "index" in message
    assert API_KEY not in message and HMAC_KEY[:8] not in message and REDIS_PASSWORD not in message


def test_model_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_config(env={}, overrides={"model": "tiny:lfm2"}).served_model_name == "tiny-lfm2"
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    config = load_config(env={}, overrides={"model": "m.gguf", "model_name": "served"})
    assert config.model == str(tmp_path / "m.gguf")  # absolute: Serve replicas run elsewhere
    assert config.served_model_name == "served"


def test_with_hmac_key() -> None:
    config = load_config(env={})
    keyed = config.with_hmac_key()
    assert keyed.hmac_key is not None and len(keyed.hmac_key.get_secret_value()) == 64
    assert int(keyed.hmac_key.get_secret_value(), 16) >= 0
    assert keyed.with_hmac_key() is keyed
    assert config.hmac_key is None
    assert config.with_hmac_key().hmac_key != keyed.hmac_key


def test_serve_args_round_trip(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    config = load_config(
        env={"BATON_API_KEYS": "k1,k2", "BATON_ENGINE__N_CTX": "2048"},
        overrides={
            "model": str(model),
            "num_gpus_per_replica": 0.25,
            "router": "round-robin",
            "index": "rediss://:pw@cache:6380",
        },
    )
    args = to_serve_args(config)
    assert json.loads(json.dumps(args)) == args
    assert "api_keys" not in args  # gateways read them on their nodes
    assert to_serve_args(config.with_hmac_key()) == args  # the cluster key is never in args
    assert args["router"] == "round-robin"
    assert args["engine"] == {"n_ctx": 2048}  # unset fields (n_threads) default where Serve runs
    restored = config_from_serve_args(args)
    assert restored == config.model_copy(update={"api_keys": ()})
    assert to_serve_args(restored) == args
    assert config_from_serve_args(to_serve_args(BatonConfig())) == BatonConfig()
    with pytest.raises(ConfigError, match="replicas: Input should be greater"):
        config_from_serve_args({**args, "replicas": 0})


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's own schema, on import
def test_serve_config_matches_ray_schema(tmp_path: Path) -> None:
    from ray.serve.schema import ServeDeploySchema

    config = load_config(
        env={"BATON_HMAC_KEY": HMAC_KEY}, overrides={"host": "0.0.0.0", "port": 8080, "replicas": 4}
    )
    document = serve_config(config, app_name="chat")
    schema = ServeDeploySchema.model_validate(document)
    assert (schema.http_options.host, schema.http_options.port) == ("0.0.0.0", 8080)
    (app,) = schema.applications
    assert (app.name, app.route_prefix, app.import_path) == (
        "chat",
        "/",
        "baton_serve.deploy.app:app_builder",
    )
    assert app.args == to_serve_args(config)
    restored = config_from_serve_args(app.args)
    assert restored.hmac_key is None and to_serve_args(restored) == app.args

    path = tmp_path / "serve.yaml"
    write_serve_config(config, path)
    assert yaml.safe_load(path.read_text()) == serve_config(config)
    assert HMAC_KEY not in path.read_text()  # replicas read it on their nodes
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_app_builder_reads_baton_variables_under_the_args(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Serve import path (`serve run`, the Helm chart) merges the builder's `BATON_*`
    environment under its args: the chart passes secrets that way, from Kubernetes Secrets."""

    from baton_serve.deploy import app

    built: list[BatonConfig] = []
    monkeypatch.setattr(app, "build_app", built.append)
    for name in [n for n in os.environ if n.startswith("BATON_")]:
        monkeypatch.delenv(name)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    config = load_config(env={}, overrides={"model": str(model), "replicas": 3})
    with pytest.raises(ConfigError, match="no cluster key"):  # none from the nodes
        app.app_builder(to_serve_args(config))
    key_file = tmp_path / "hmac-key"
    app.app_builder({**to_serve_args(config), "hmac_key_file": str(key_file)})

    index = f"redis://:{REDIS_PASSWORD}@baton-redis:6379/0"
    monkeypatch.setenv("BATON_API_KEYS", f"{API_KEY},second-key")
    monkeypatch.setenv("BATON_HMAC_KEY", HMAC_KEY)
    monkeypatch.setenv("BATON_INDEX", index)
    monkeypatch.setenv("BATON_REPLICAS", "7")
    app.app_builder({**to_serve_args(config), "engine": {"n_ctx": 2048}})

    plain, merged = built
    assert plain == config.model_copy(update={"hmac_key_file": str(key_file)})
    assert [key.get_secret_value() for key in merged.api_keys] == [API_KEY, "second-key"]
    assert merged.hmac_key is not None and merged.hmac_key.get_secret_value() == HMAC_KEY
    assert merged.index == index
    assert merged.replicas == 3  # args win over the environment
    assert (merged.model, merged.engine.n_ctx) == (str(model), 2048)
