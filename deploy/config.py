"""Baton's configuration: one model for `baton serve`, the Ray Serve app builder and the Helm chart.

`load_config` reads, highest priority first: explicit overrides (CLI flags), `BATON_*`
environment variables (nested with `__`, e.g. `BATON_ENGINE__N_CTX`), a YAML file, and the
defaults below (`config_sources` reads the file and the variables). `to_serve_args` /
`config_from_serve_args` carry a config to the Serve app.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import (
    ConfigDict,
    Field,
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
from baton_serve.deploy.credentials import Credentials
from baton_serve.deploy.request_bounds import RequestBounds
from baton_serve.deploy.routing_settings import RoutingSettings
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.models.default_model import DEFAULT_MODEL_FILE
from baton_serve.replicas.models.hf_hub import HF_PREFIX, parse_hf_ref
from baton_serve.replicas.models.model_source import TINY_PREFIX
from baton_serve.replicas.models.tiny_model import ARCHITECTURES

# Memory a gateway holds per byte of a body as it arrives: the buffer, then its copy (16
# trickled 4 MiB bodies peaked at 1.05 bytes a byte: docs/robustness.md).
GATEWAY_BODY_EXPANSION = 2
# Requests one gateway replica takes at once: 256 bodies of 4 MiB (max_body_bytes' default)
# × GATEWAY_BODY_EXPANSION is 2 GiB, what the chart's 8 GiB head pod spares beside Ray.
GATEWAY_MAX_ONGOING = 256
# Ray's built-in resources have settings of their own (or none to set): not custom resources.
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class RouterPolicy(str, Enum):
    """How the gateway picks a replica for a request."""

    BATON = "baton"
    POW2 = "pow2"
    PREFIX_AFFINITY = "prefix-affinity"
    ROUND_ROBIN = "round-robin"


class BatonConfig(Credentials, RequestBounds):
    """Everything `baton serve` deploys: the model, replicas, engine, index, router and API."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str | None = Field(
        default=None,
        description="a GGUF path; tiny:ARCH (a generated test model, cached under "
        "$BATON_CACHE_DIR); hf://ORG/REPO/PATH[@REVISION] (a Hugging Face file, downloaded once "
        "into $BATON_CACHE_DIR/models); unset: SmolLM2-135M-Instruct",
    )
    mmproj: str | None = Field(
        default=None,
        description="a multimodal projector GGUF matched to the model (llama.cpp's mtmd, as "
        "llama-server's --mmproj): a path; hf://ORG/REPO/PATH[@REVISION]; tiny:ARCH (a generated "
        "projector for the generated model tiny:ARCH). Unset: the model reads text only, and a "
        "chat with an image or audio clip gets a 400 naming the part",
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
    gateway_max_ongoing_requests: int = Field(
        default=GATEWAY_MAX_ONGOING,
        ge=1,
        description="requests one gateway replica takes at once (Serve's max_ongoing_requests; "
        "beyond it, 503). Each may be a body of max_body_bytes arriving (2 bytes a byte: the "
        "buffer, then its copy), so the default's 256 × 4 MiB × 2 = 2 GiB fits beside Ray "
        "on the chart's 8 GiB head pod, where 1,000 did not; a request past its parse holds "
        "about 24 bytes a byte of its prompt's text, which the context bounds",
    )
    gateway_memory_bytes: int | None = Field(
        default=None,
        ge=1,
        description="memory a gateway replica reserves from Ray (its ray_actor_options "
        "memory): it is placed only on a node with that much unreserved; at least "
        "gateway_max_ongoing_requests × max_body_bytes × 2 (the bodies arriving; less is "
        "refused); unset: none reserved",
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
    routing: RoutingSettings = Field(
        default_factory=RoutingSettings,
        description="how Baton's router weighs replicas and when a replica pulls a prefix "
        "state (routing.* below); router baton only",
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
        """Settings that must agree: the gateway's memory and its bodies, liveness over
        heartbeats, and what only Baton's router acts on refused with another."""
        bodies = self.gateway_max_ongoing_requests * self.max_body_bytes * GATEWAY_BODY_EXPANSION
        if self.gateway_memory_bytes is not None and self.gateway_memory_bytes < bodies:
            raise ValueError(
                f"gateway_memory_bytes ({self.gateway_memory_bytes}) cannot hold "
                f"gateway_max_ongoing_requests ({self.gateway_max_ongoing_requests}) bodies of "
                f"max_body_bytes ({self.max_body_bytes}) arriving ({GATEWAY_BODY_EXPANSION} "
                f"bytes a byte: {bodies}): raise it, or lower one of those"
            )
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
        for name in ("pull_bandwidth_gb_s", "routing"):
            if router is not RouterPolicy.BATON and name in given:
                raise ValueError(f"{name} needs router 'baton': {router.value} never reads it")
        return self

    @property
    def pull_bandwidth_bytes_per_s(self) -> float:
        """`pull_bandwidth_gb_s` in bytes a second."""
        return self.pull_bandwidth_gb_s * 1e9

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
    """The settings given explicitly, as plain JSON-able data, without the cluster key or
    the API keys: Serve stores and shows its args, so replicas and gateways read those on
    their nodes (`cache_store.cluster_key`, `router.gateway.api_key_source`).

    Unset fields are left out, so defaults (such as `engine.n_threads`, the CPU count) are
    taken where the Serve app runs.
    """
    return config.model_dump(mode="json", exclude_unset=True, exclude={"hmac_key", "api_keys"})


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
