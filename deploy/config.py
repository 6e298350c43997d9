"""Baton's configuration: one model for `baton serve`, the Ray Serve app builder and the Helm chart.

`load_config` reads, highest priority first: explicit overrides (CLI flags), `BATON_*`
environment variables (nested with `__`, e.g. `BATON_ENGINE__N_CTX`), a YAML file, and the
defaults below (`config_sources` reads the file and the variables). `to_serve_args` /
`config_from_serve_args` carry a config to the Serve app.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Iterator, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from baton_serve.cache_store.index.index import EMBEDDED_SPEC
from baton_serve.cache_store.index.redis_address import (
    REDIS_FORMS,
    is_redis_address,
    parse_redis_address,
    redact,
)
from baton_serve.cache_store.pull_cost import ShipCost
from baton_serve.deploy.config_sources import (
    ConfigError,
    from_env,
    merge,
    read_yaml,
    without_none,
)
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.models.default_model import DEFAULT_MODEL_FILE
from baton_serve.replicas.models.hf_hub import HF_PREFIX, parse_hf_ref
from baton_serve.replicas.models.model_source import TINY_PREFIX
from baton_serve.replicas.models.tiny_model import ARCHITECTURES

MIN_HMAC_KEY_CHARS = 16
# Ray's built-in resources have settings of their own (or none to set): not custom resources.
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class RouterPolicy(str, Enum):
    """How the gateway picks a replica for a request."""

    BATON = "baton"
    POW2 = "pow2"
    PREFIX_AFFINITY = "prefix-affinity"
    ROUND_ROBIN = "round-robin"


class BatonConfig(BaseModel):
    """Everything `baton serve` deploys: the model, replicas, engine, index, router and API."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str | None = Field(
        default=None,
        description="a GGUF path; tiny:ARCH (a generated test model, cached under "
        "$BATON_CACHE_DIR); hf://ORG/REPO/PATH[@REVISION] (a Hugging Face file, downloaded once "
        "into $BATON_CACHE_DIR/models); unset: SmolLM2-135M-Instruct",
    )
    model_name: str | None = Field(
        default=None,
        description="the model's name in the OpenAI API (/v1/models, a request's model field); "
        "unset: the model file's stem",
    )
    replicas: int = Field(
        default=2, ge=1, description="size of the replica deployment (one engine each)"
    )
    num_gpus_per_replica: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="GPUs a replica asks Ray for (1: one replica per GPU)",
    )
    num_cpus_per_replica: float = Field(
        default=1.0,
        gt=0,
        allow_inf_nan=False,
        description="logical Ray CPUs a replica asks for, and its llama.cpp threads unless "
        "engine.n_threads is set; unset, baton serve's own local cluster gives each replica an "
        "equal share of this machine's cores (physical cores of its CPU affinity, capped by a "
        "cgroup CPU quota)",
    )
    gateway_replicas: int = Field(
        default=1, ge=1, description="size of the gateway (HTTP) deployment"
    )
    replica_resources: dict[str, float] = Field(
        default_factory=dict,
        description='custom Ray resources a replica asks for, e.g. {"baton_replica": 1}: '
        "replicas run only on nodes started with them (ray start --resources); CPU, GPU, "
        "memory and node:… are refused (they have settings of their own, or are Ray's)",
    )
    gateway_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources a gateway replica asks for"
    )
    replica_env: dict[str, str] = Field(
        default_factory=dict,
        description="environment variables of the replica processes (their Ray runtime_env), "
        'e.g. {"GGML_VK_VISIBLE_DEVICES": "0"}: llama.cpp\'s Vulkan backend then uses a '
        "software device (Mesa's lavapipe) it skips by default",
    )
    max_replicas_per_node: int | None = Field(
        default=None,
        ge=1,
        description="Serve's max_replicas_per_node for the replicas: spreads them over nodes "
        "(1: a node's death costs one replica)",
    )
    rollout_surge_percent: int = Field(
        default=0,
        ge=0,
        le=100,
        description="Serve's max_surge_percent for the replicas: in a rolling update this share "
        "of extra replicas (rounded up: 1 or more) starts before old ones stop, so no replica "
        "stops with no peer to hand its states to and a single replica has no gap; it needs "
        "room for the extra replicas (0: Serve stops an old replica before starting its "
        "replacement)",
    )
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="every replica's engine settings"
    )
    index: str = Field(
        default=EMBEDDED_SPEC,
        description="the checkpoint index: embedded (a Ray actor on the head node), or Redis: "
        "redis://[:PASSWORD@]HOST:PORT/DB (one server); "
        "redis+sentinel://[:PASSWORD@]HOST:26379[,HOST:26379…]/MASTER[/DB]"
        "[?sentinel_password=…] (the master its Sentinels name, followed through a failover; "
        "the password is the master's, sentinel_password the Sentinels'); "
        "redis+cluster://[:PASSWORD@]HOST:PORT[,HOST:PORT…] (a Redis Cluster's seed nodes; "
        "one database); rediss… for TLS. A malformed address is refused naming the problem",
    )
    router: RouterPolicy = Field(
        default=RouterPolicy.BATON,
        description="how the gateway picks a replica: baton (by prefixes held, being computed "
        "or pullable, and load), pow2 (Ray's default), prefix-affinity (Ray Serve LLM's "
        "PrefixCacheAffinityRouter) or round-robin",
    )
    api_keys: tuple[SecretStr, ...] = Field(
        default=(),
        description="accepted API keys: when set, every path but /health needs "
        "Authorization: Bearer KEY (deny-by-default); empty: no auth; BATON_API_KEYS is a "
        "comma-separated list",
    )
    hmac_key: SecretStr | None = Field(
        default=None,
        description="the cluster key (at least 16 characters) that signs state blobs between "
        "replicas and on disk; replicas read it from their environment or hmac_key_file, never "
        "from Serve's arguments; unset: generated per serve, so a disk tier "
        "(engine.checkpoint_dir) needs a fixed one",
    )
    hmac_key_file: str | None = Field(
        default=None,
        min_length=1,
        description="a file holding the cluster key instead (a mounted Secret): every node "
        "must have it at this path",
    )
    host: str = Field(
        default="127.0.0.1", min_length=1, description="address the HTTP API listens on"
    )
    port: int = Field(default=8000, ge=1, le=65535, description="port of the HTTP API")
    metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Prometheus /metrics port of the local Ray cluster baton serve starts "
        "(unset: Ray picks one)",
    )
    max_body_bytes: int = Field(
        default=4 << 20, ge=1, description="largest request body accepted (larger: 413)"
    )
    max_messages: int = Field(
        default=2048,
        ge=1,
        description="most messages in one chat request; more get a 400 naming the setting, "
        "before any message is validated",
    )
    max_prompts: int = Field(
        default=256,
        ge=1,
        description="most prompts in one completion request; more get a 400 naming the setting",
    )
    max_prompt_bytes: int = Field(
        default=4 << 20,
        ge=1,
        description="largest prompt text, a chat as its template renders it; larger gets a "
        "413, before it is tokenised",
    )
    max_queued_requests: int = Field(
        default=64,
        ge=1,
        description="requests a gateway holds while every replica is full (each replica "
        "accepts 4 × n_slots + 4); beyond that, 503 with Retry-After: 1",
    )
    heartbeat_s: float = Field(
        default=5.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds between a replica's heartbeats to the index",
    )
    liveness_ttl_s: float = Field(
        default=15.0,
        gt=0,
        allow_inf_nan=False,
        description="a replica without a heartbeat for this long drops out of index lookups "
        "(it must exceed heartbeat_s)",
    )
    handoff_s: float = Field(
        default=10.0,
        ge=0,
        le=300,
        allow_inf_nan=False,
        description="a replica Serve stops (scale-down, a rolling update) hands its hottest "
        "checkpoints to the replicas that stay for up to this long, after its requests in "
        "flight finished; 0 turns it off; router baton only (another router cannot send a "
        "state to a chosen replica: a handoff_s set with one is refused, and the default does "
        "nothing)",
    )
    pull_bandwidth_gb_s: float = Field(
        default=ShipCost.bandwidth_bytes_per_s / 1e9,
        gt=0,
        le=10_000,
        allow_inf_nan=False,
        description="GB/s a state pull is assumed to move until each replica has measured its "
        "own: whether pulling a prefix beats computing it. The default is the slowest path "
        "measured (Ray's object managers between nodes); on a fast fabric set the link's, or "
        "a large model's long prefixes may never look worth pulling; router baton only",
    )
    stream_ping_s: float = Field(
        default=15.0,
        ge=0,
        allow_inf_nan=False,
        description="a streamed reply's headers go out as soon as a replica admits the "
        "request; while no token comes (a long prefill, a queue) the gateway sends an SSE "
        "comment (: ping) every this many seconds, so proxies with idle timeouts (often 60 s) "
        "do not cut the stream; 0 turns pings off",
    )

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if value.startswith(TINY_PREFIX):
            arch = value[len(TINY_PREFIX) :]
            if arch not in ARCHITECTURES:
                choices = ", ".join(ARCHITECTURES)
                raise ValueError(f"unknown tiny model {arch!r}; choose from {choices}")
            return value
        if value.startswith(HF_PREFIX):
            parse_hf_ref(value)  # downloaded by resolve_model, where the model is loaded
            return value
        if not value:
            raise ValueError("must not be empty (leave it unset for the default model)")
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"model file not found: {path}")
        return str(path.absolute())

    @field_validator("model_name")
    @classmethod
    def _check_model_name(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty (leave it unset to serve the model file's stem)")
        return value

    @field_validator("index")
    @classmethod
    def _check_index(cls, value: str) -> str:
        if value == EMBEDDED_SPEC:
            return value
        if not is_redis_address(value):
            raise ValueError(f"expected {EMBEDDED_SPEC!r} or {REDIS_FORMS}")
        parse_redis_address(value)  # its ValueError names what is wrong
        return value

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, value: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        if any(not key.get_secret_value() for key in value):
            raise ValueError("an API key must not be empty")
        return value

    @field_validator("hmac_key")
    @classmethod
    def _check_hmac_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_HMAC_KEY_CHARS:
            raise ValueError(f"must be at least {MIN_HMAC_KEY_CHARS} characters")
        return value

    @field_validator("replica_resources", "gateway_resources")
    @classmethod
    def _check_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if not name or name.startswith("node:") or name in RAY_BUILTIN_RESOURCES:
                raise ValueError(
                    f"{name!r} is not a custom resource (CPUs and GPUs have their own settings)"
                )
            if not (math.isfinite(amount) and amount > 0):
                raise ValueError(f"{name!r}: the amount must be positive, got {amount}")
        return value

    @model_validator(mode="after")
    def _check_together(self) -> BatonConfig:
        """Settings that must agree: one key source, liveness over heartbeats, and what only
        Baton's router acts on refused with another."""
        if self.hmac_key is not None and self.hmac_key_file is not None:
            raise ValueError("set hmac_key (BATON_HMAC_KEY) or hmac_key_file, not both")
        if self.liveness_ttl_s <= self.heartbeat_s:
            raise ValueError(
                f"liveness_ttl_s ({self.liveness_ttl_s:g}) must exceed heartbeat_s "
                f"({self.heartbeat_s:g}), or live replicas drop out of the index"
            )
        given, router = self.model_fields_set, self.router
        if router is not RouterPolicy.BATON and "handoff_s" in given and self.handoff_s > 0:
            raise ValueError(
                f"handoff_s ({self.handoff_s:g}) needs router 'baton': only Baton's router "
                f"sends a state to a chosen replica (set handoff_s to 0 for {router.value})"
            )
        if router is not RouterPolicy.BATON and "pull_bandwidth_gb_s" in given:
            raise ValueError(
                f"pull_bandwidth_gb_s needs router 'baton': {router.value} never pulls"
            )
        return self

    @property
    def handoff_seconds(self) -> float:
        """How long a leaving replica hands off: 0 unless Baton's router can reach peers."""
        return self.handoff_s if self.router is RouterPolicy.BATON else 0.0

    @property
    def served_model_name(self) -> str:
        """The model's name in the OpenAI API: `model_name`, else the model file's stem."""
        if self.model_name:
            return self.model_name
        if self.model is None:
            return Path(DEFAULT_MODEL_FILE).stem
        if self.model.startswith(TINY_PREFIX):
            return f"tiny-{self.model[len(TINY_PREFIX) :]}"  # the file resolve_model writes
        if self.model.startswith(HF_PREFIX):
            return Path(parse_hf_ref(self.model).path).stem  # without the @revision
        return Path(self.model).stem

    def with_hmac_key(self) -> BatonConfig:
        """This config, with a random 32-byte (hex) `hmac_key` if none is set."""
        if self.hmac_key is not None:
            return self
        return self.model_copy(update={"hmac_key": SecretStr(secrets.token_hex(32))})

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        for name, value in super().__repr_args__():
            yield name, (redact(value) if name == "index" else value)


def load_config(
    yaml_path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> BatonConfig:
    """Read overrides > `BATON_*` variables of `env` (default: os.environ) > YAML > defaults.

    `overrides` may nest (`{"engine": {"n_ctx": 2048}}`); None values in it are ignored.
    Raises `ConfigError` naming every invalid field, or the file that cannot be read.
    """
    data = read_yaml(Path(yaml_path)) if yaml_path is not None else {}
    data = merge(data, from_env(os.environ if env is None else env, BatonConfig.model_fields))
    data = merge(data, without_none(overrides or {}))
    return _validate(data)


def to_serve_args(config: BatonConfig) -> dict[str, Any]:
    """The settings given explicitly, as plain JSON-able data with API keys revealed, and
    without the cluster key: replicas read it from their nodes (`cache_store.cluster_key`).

    Unset fields are left out, so defaults (such as `engine.n_threads`, the CPU count) are
    taken where the Serve app runs.
    """
    args = config.model_dump(mode="json", exclude_unset=True, exclude={"hmac_key"})
    if "api_keys" in args:
        args["api_keys"] = [key.get_secret_value() for key in config.api_keys]
    return args


def config_from_serve_args(args: Mapping[str, Any]) -> BatonConfig:
    """The config `to_serve_args` encoded (the Serve application builder's `args`)."""
    return _validate(args)


def _validate(data: Mapping[str, Any]) -> BatonConfig:
    try:
        return BatonConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    """One line per problem, without the offending values (they may be secrets)."""
    lines = ["invalid Baton configuration:"]
    for error in exc.errors(include_input=False, include_url=False):
        field = ".".join(str(part) for part in error["loc"]) or "config"
        if error["type"] == "extra_forbidden":
            message = "unknown setting"
        else:
            message = error["msg"].removeprefix("Value error, ")
        lines.append(f"  {field}: {message}")
    return "\n".join(lines)
