"""The Baton Serve application: a gateway deployment in front of the replica deployment.

`build_app(config)` is what `baton serve` runs; `app_builder(args)` is the import path a
Serve config names (`serve run`, `serve deploy`, and the Helm chart's serveConfigV2), with
`args` made by `deploy.config.to_serve_args`. The cluster key and the API keys are never among
a deployment's arguments (Serve stores and shows them): replicas read the one on their node
(`replica_key_file`), gateways the others (`gateway_key_source`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from baton_serve.cache_store.checkpoints.cluster_key import (
    KEY_ENV,
    KEY_FILE_ENV,
    write_private_key_file,
)
from baton_serve.cache_store.fingerprint import file_fingerprint
from baton_serve.cache_store.index.index import EMBEDDED_SPEC
from baton_serve.deploy.capacity_check import check_object_store_fits, fit_store_budget
from baton_serve.deploy.config import BatonConfig, ConfigError, RouterPolicy, load_config
from baton_serve.deploy.index_placement import start_embedded_index_on_head
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.media_input import MediaBounds
from baton_serve.replicas.models.model_source import resolve_model, resolve_projector
from baton_serve.replicas.serve_deployment import ReplicaDeployment, ReplicaSettings
from baton_serve.router.gateway.api_key_source import (
    API_KEYS_ENV,
    API_KEYS_FILE_ENV,
    APIKeySource,
    split_api_keys,
)
from baton_serve.router.gateway.gateway import GatewaySettings
from baton_serve.router.gateway.grammar_limits import GrammarLimits
from baton_serve.router.gateway.poison_requests import QuarantineSettings
from baton_serve.router.gateway.serve_gateway import GatewayDeployment

APP_NAME = "baton"
REPLICA_DEPLOYMENT = "Replica"
GATEWAY_DEPLOYMENT = "Gateway"
ROUTING_STATS_PERIOD_S = 0.5
GATEWAY_CPUS = 0.1
RETRY_AFTER_S = 1
# What a leaving replica may take: requests in flight finish, then the hand-off, then
# leaving the index, or writing what RAM holds to the disk tier for the next start.
DRAIN_S = 30.0
CLOSE_S = 5.0
DISK_FLUSH_S = 25.0

_ROUTERS = {
    RouterPolicy.BATON: "baton_serve.router.routing.request_router:BatonRouter",
    RouterPolicy.POW2: "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter",
    RouterPolicy.PREFIX_AFFINITY: (
        "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
        "PrefixCacheAffinityRouter"
    ),
    RouterPolicy.ROUND_ROBIN: "baton_serve.router.routing.safe_router:RoundRobinRouter",
}


def router_config(config: BatonConfig, model_path: Path) -> RequestRouterConfig:
    kwargs = {}
    if config.router is RouterPolicy.BATON:
        with LlamaModel(model_path, vocab_only=True) as vocab:
            kind = vocab.kind
        kwargs = {
            "index": config.index,
            "fingerprint_hex": file_fingerprint(model_path).hex(),
            "block_tokens": config.engine.block_tokens,
            # Attention states serve every prefix of themselves; hybrid ones only their own.
            "every_block": not kind.needs_checkpoints,
            **config.routing.router_kwargs(config.pull_bandwidth_bytes_per_s),
        }
    return RequestRouterConfig(
        request_router_class=_ROUTERS[config.router],
        request_router_kwargs=kwargs,
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
    )


def logical_cpus(config: BatonConfig) -> float:
    """Ray CPUs the application asks for."""
    return config.replicas * config.num_cpus_per_replica + config.gateway_replicas * GATEWAY_CPUS


def local_cluster_cpus(logical: float) -> int:
    """Ray CPUs a local cluster declares for an app asking for `logical` of them: the
    machine's count, or more where the app asks more (Ray's CPUs are logical; declaring
    fewer, Serve would wait forever to place the last replica)."""
    return max(os.cpu_count() or 1, math.ceil(logical))


def engine_threads(config: BatonConfig) -> int:
    """llama.cpp threads of each replica: `engine.n_threads` where set, else one per
    logical CPU the replica asks Ray for."""
    if "n_threads" in config.engine.model_fields_set:
        return config.engine.n_threads
    return max(1, math.ceil(config.num_cpus_per_replica))


def replica_env(config: BatonConfig) -> dict[str, str]:
    """The replica processes' environment: `replica_env`, and where replicas share the
    machine's cores (`engine.node_cores`), a short OpenMP spin at ggml's barriers: a prompt
    step may run more threads than there are idle cores until a neighbour's step ends, and
    a thread spinning on a core another replica computes on holds up both. Measured on 2
    cores, SmolLM2, two processes: a 460-token prompt on 2 threads beside a 1-thread decode
    took 4.0-4.4 s with OpenMP's default spin and 2.65 s with GOMP_SPINCOUNT=3000 (2.6 s on
    one thread), while a 2-thread decode kept its 16 ms a token (OpenMP's passive policy:
    41 ms)."""
    env = dict(config.replica_env)
    node_cores = config.engine.node_cores
    sharing = node_cores is not None and node_cores > engine_threads(config)
    if sharing and "OMP_WAIT_POLICY" not in env:
        env.setdefault("GOMP_SPINCOUNT", "3000")
    return env


def replica_actor_options(config: BatonConfig) -> dict:
    """The replica deployment's `ray_actor_options` (a Serve config that overrides them
    replaces them whole, so it starts from these)."""
    options: dict[str, object] = {
        "num_cpus": config.num_cpus_per_replica,
        "num_gpus": config.num_gpus_per_replica,
        "resources": dict(config.replica_resources),
    }
    if env := replica_env(config):
        options["runtime_env"] = {"env_vars": env}
    return options


def shutdown_timeout_s(config: BatonConfig) -> float:
    """Serve's `graceful_shutdown_timeout_s` for the replicas: time to drain, hand off and
    close (the chart's pod termination grace period must be longer)."""
    closing = CLOSE_S if config.engine.checkpoint_dir is None else DISK_FLUSH_S
    return DRAIN_S + config.handoff_seconds + closing


def check_cluster_key(config: BatonConfig) -> None:
    """Refuse a disk tier without an explicit cluster key: with a key generated per start,
    every start would delete the checkpoint files the one before left."""
    if config.engine.checkpoint_dir is not None and not (config.hmac_key or config.hmac_key_file):
        raise ConfigError(
            "engine.checkpoint_dir (--checkpoint-dir) needs a fixed cluster key: set "
            f"{KEY_ENV} (at least 16 characters) or {KEY_FILE_ENV} (a file holding it), or "
            "hmac_key / hmac_key_file in the config file; a key generated at each start "
            "could not verify the files the previous start left"
        )


def replica_key_file(config: BatonConfig) -> str | None:
    """Where the replicas read the cluster key: `hmac_key_file` (at that path on every
    node); None when the key is this process's `BATON_HMAC_KEY`, which every node's
    environment holds (the chart's pods; a local cluster inherits `baton serve`'s);
    otherwise a private file written here (mode 0600, deleted when this process exits)
    with the key given, or a generated one: a cluster on this machine reads it there."""
    if config.hmac_key_file is not None:
        return config.hmac_key_file
    key = config.with_hmac_key().hmac_key.get_secret_value()  # type: ignore[union-attr]
    if config.hmac_key is not None and key == os.environ.get(KEY_ENV):
        return None
    return str(write_private_key_file(key))


def gateway_key_source(config: BatonConfig) -> APIKeySource:
    """Where the gateways read the API keys, as `replica_key_file` for the cluster key:
    `api_keys_file`; their own `BATON_API_KEYS` when the keys are this process's (every
    node's environment holds it: the chart's pods, a local cluster); otherwise a private file
    written here (mode 0600, deleted when this process exits) holding the keys given."""
    if config.api_keys_file is not None:
        return APIKeySource(required=True, file=config.api_keys_file)
    keys = tuple(key.get_secret_value() for key in config.api_keys)
    if not keys:
        return APIKeySource(required=False)
    if keys == split_api_keys(os.environ.get(API_KEYS_ENV, "")):
        return APIKeySource(required=True)
    key_file = write_private_key_file("\n".join(keys), "api-keys")
    return APIKeySource(required=True, file=str(key_file))


def gateway_actor_options(config: BatonConfig) -> dict:
    """The gateway deployment's `ray_actor_options`: its CPU share, custom resources (where
    it may run) and, where set, the memory it reserves."""
    options: dict[str, object] = {
        "num_cpus": GATEWAY_CPUS,
        "resources": dict(config.gateway_resources),
    }
    if config.gateway_memory_bytes is not None:
        options["memory"] = config.gateway_memory_bytes
    return options


def replica_max_ongoing(n_slots: int) -> int:
    """Requests one replica accepts at once. The router decides by load; this only bounds
    it."""
    return 4 * n_slots + 4


def build_app(config: BatonConfig, *, startup_dir: str | None = None) -> Application:
    """The application for `config`. Without a cluster key, one is generated here and
    written where this machine's replicas read it (`replica_key_file`). With `startup_dir`,
    replicas on this machine report their start-up stages there (`deploy/startup.py`)."""
    check_cluster_key(config)
    model_path = resolve_model(config.model)
    mmproj = str(resolve_projector(config.mmproj, model_path)) if config.mmproj else None
    engine = config.engine.model_copy(update={"n_threads": engine_threads(config)})
    if config.index == EMBEDDED_SPEC and ray.is_initialized():
        start_embedded_index_on_head()  # not on a worker, which may die
    replica = serve.deployment(
        ReplicaDeployment,
        name=REPLICA_DEPLOYMENT,
        num_replicas=config.replicas,
        max_ongoing_requests=replica_max_ongoing(config.engine.n_slots),
        # Beyond that, each gateway holds this many; the next get 503 with Retry-After.
        max_queued_requests=config.max_queued_requests,
        backpressure_config={"status_code": 503, "retry_after_s": RETRY_AFTER_S},
        ray_actor_options=replica_actor_options(config),
        max_replicas_per_node=config.max_replicas_per_node,
        max_surge_percent=config.rollout_surge_percent,
        request_router_config=router_config(config, model_path),
        graceful_shutdown_timeout_s=shutdown_timeout_s(config),
    ).bind(
        ReplicaSettings(
            model_path=str(model_path),
            mmproj=mmproj,
            engine=engine,
            hmac_key_file=replica_key_file(config),
            index=config.index,
            ship=config.router is RouterPolicy.BATON,
            routed_by_baton=config.router is RouterPolicy.BATON,
            ship_cost=config.routing.ship_cost(config.pull_bandwidth_bytes_per_s),
            pull_deadline_s=config.routing.pull_deadline_s,
            stream_bounds=config.routing.stream_bounds(),
            heartbeat_s=config.heartbeat_s,
            liveness_ttl_s=config.liveness_ttl_s,
            handoff_s=config.handoff_seconds,
            startup_dir=startup_dir,
        )
    )
    gateway = serve.deployment(
        GatewayDeployment,
        name=GATEWAY_DEPLOYMENT,
        num_replicas=config.gateway_replicas,
        ray_actor_options=gateway_actor_options(config),
        max_ongoing_requests=config.gateway_max_ongoing_requests,
    )
    settings = GatewaySettings(
        model_name=config.served_model_name,
        model_path=str(model_path),
        mmproj=mmproj,
        media_bounds=MediaBounds(
            max_images=config.max_images,
            max_image_bytes=config.max_image_bytes,
            max_image_pixels=config.max_image_pixels,
            url_hosts=tuple(config.image_url_hosts),
            fetch_timeout_s=config.image_fetch_timeout_s,
            max_audio_clips=config.max_audio_clips,
            max_audio_bytes=config.max_audio_bytes,
            max_audio_seconds=config.max_audio_seconds,
        ),
        n_ctx=config.engine.n_ctx,
        block_tokens=config.engine.block_tokens,
        chat_template=config.engine.chat_template,
        max_body_bytes=config.max_body_bytes,
        body_read_timeout_s=config.body_read_timeout_s,
        max_messages=config.max_messages,
        max_prompts=config.max_prompts,
        max_prompt_bytes=config.max_prompt_bytes,
        max_tokens_cap=config.max_tokens_cap,
        max_request_tokens=config.max_request_tokens,
        max_tools=config.max_tools,
        max_documents=config.max_documents,
        max_logit_bias=config.max_logit_bias,
        max_stop_token_ids=config.max_stop_token_ids,
        max_message_parts=config.max_message_parts,
        grammar_limits=GrammarLimits(
            max_chars=config.max_grammar_chars,
            max_nesting=config.engine.max_grammar_nesting,
            max_choices=config.max_grammar_choices,
            timeout_s=config.schema_timeout_s,
        ),
        stream_ping_s=config.stream_ping_s,
        engine=f"emulated:{emulated.name}" if (emulated := config.engine.emulated) else "llama.cpp",
    )
    quarantine = QuarantineSettings(
        quarantine_s=config.poison_quarantine_s, max_entries=config.poison_quarantine_entries
    )
    return gateway.bind(settings, replica, gateway_key_source(config), quarantine)


def app_builder(args: dict) -> Application:
    """Entry point for a Serve config's `import_path` (`deploy.app:app_builder`).

    `args` override the `BATON_*` environment variables of the process that builds the app
    (the Helm chart passes API keys, the HMAC key and the Redis URL that way, from Secrets).
    The cluster key must come from that environment (`BATON_HMAC_KEY`, or
    `BATON_HMAC_KEY_FILE` / `hmac_key_file` naming a file every node has): the app may run
    on nodes this process cannot write a key file to, and args are stored with the app.
    """
    if "hmac_key" in args:
        raise ConfigError(
            "a Serve config's args must not hold hmac_key (Serve stores and shows them): "
            f"set {KEY_ENV} or {KEY_FILE_ENV} on every Ray node instead"
        )
    if "api_keys" in args:
        raise ConfigError(
            "a Serve config's args must not hold api_keys (Serve stores and shows them): "
            f"set {API_KEYS_ENV} or {API_KEYS_FILE_ENV} on every Ray node, or api_keys_file"
        )
    config = load_config(overrides=args)
    if config.hmac_key is None and config.hmac_key_file is None:
        raise ConfigError(
            f"no cluster key: set {KEY_ENV} (the key) or {KEY_FILE_ENV} (a file holding it) "
            "on every Ray node, where Serve builds the app and where replicas run"
        )
    config = fit_store_budget(config)
    check_object_store_fits(config)  # before anything is deployed
    return build_app(config)
