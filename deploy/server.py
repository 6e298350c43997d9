"""`baton serve`: a local (or joined) Ray cluster running the Baton application."""

from __future__ import annotations

import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ray import serve

from baton_serve.cache_store.checkpoints.disk_dir import check_checkpoint_dir
from baton_serve.cache_store.index.redis_address import redact
from baton_serve.deploy.app import (
    APP_NAME,
    build_app,
    check_cluster_key,
    engine_threads,
    local_cluster_cpus,
    logical_cpus,
)
from baton_serve.deploy.capacity_check import (
    check_gpus_fit,
    check_object_store_fits,
    fit_store_budget,
)
from baton_serve.deploy.config import BatonConfig
from baton_serve.deploy.cpu_layout import share_cpus, usable_cpus
from baton_serve.deploy.local_ray import local_ray, metrics_export_port
from baton_serve.deploy.startup import deploy_with_progress
from baton_serve.replicas.models.model_check import check_model
from baton_serve.replicas.models.model_source import resolve_model


def serve_until_interrupted(config: BatonConfig, *, address: str | None = None) -> None:
    """Run the app until Ctrl-C or SIGTERM, then shut it down cleanly."""
    if address and config.metrics_port:
        raise ValueError(
            "metrics_port sets the metrics port of the cluster baton serve starts; a joined "
            "cluster serves metrics where `ray start --metrics-export-port` put them"
        )
    check_cluster_key(config)  # a disk tier needs a fixed key, before anything starts
    if not address:  # a joined cluster's replicas may not run on this machine
        config = share_cpus(config, usable_cpus())
        if config.engine.checkpoint_dir is not None:
            check_checkpoint_dir(config.engine.checkpoint_dir)
        print(f"checking {config.served_model_name} ...", flush=True)
        report = check_model(
            resolve_model(config.model),
            n_gpu_layers=config.engine.n_gpu_layers,
            cpu_repack=config.engine.cpu_repack,
            env=config.replica_env,
            engine=config.engine,
            gpu_share=min(config.num_gpus_per_replica, 1.0) or 1.0,
        )
        print(f"  {report.summary()}", flush=True)
        if (timing := config.engine.emulated) is not None:
            print(f"  engine emulated:{timing.name}: steps take the profile's time", flush=True)
        if config.engine.n_gpu_layers != 0 and report.device == "CPU":
            print(
                f"  n_gpu_layers is {config.engine.n_gpu_layers} but llama.cpp has no GPU "
                "device here: the model runs on the CPU",
                flush=True,
            )
    # Ray's CPUs are logical: a local cluster must declare at least what the app asks for,
    # or Serve waits forever to place the last replica.
    num_cpus = None if address else local_cluster_cpus(logical_cpus(config))
    with (
        _startup_dir(local=not address) as stages_dir,
        local_ray(num_cpus, address=address, metrics_port=config.metrics_port),
    ):
        config = fit_store_budget(config)
        check_object_store_fits(config)  # before anything is deployed
        if not address:  # a joined cluster may grow (an autoscaler adds GPU nodes)
            check_gpus_fit(config)
        # After ray.init, which installs handlers of its own: both signals mean "stop".
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _raise_interrupt)
        serve.start(http_options={"host": config.host, "port": config.port})
        try:
            print(
                f"starting {config.replicas} replica(s) of {config.served_model_name}, "
                f"{engine_threads(config)} llama.cpp thread(s) each ...",
                flush=True,
            )
            app = build_app(config, startup_dir=stages_dir)
            deploy_with_progress(app, name=APP_NAME, stages_dir=stages_dir)
            print(_banner(config, None if address else metrics_export_port()), flush=True)
            threading.Event().wait()
        except KeyboardInterrupt:
            print("shutting down ...", flush=True)
        finally:
            serve.delete(APP_NAME)
            if not address:  # a joined cluster keeps its Serve instance
                serve.shutdown()
    if not address:
        _wait_port_released(config.host, config.port)


@contextmanager
def _startup_dir(*, local: bool) -> Iterator[str | None]:
    """Where the replicas of a local cluster report their start-up stages; none for a
    joined cluster (its replicas may run on other machines)."""
    if not local:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="baton-startup-") as folder:
        yield folder


def _wait_port_released(host: str, port: int, timeout_s: float = 15.0) -> None:
    """Return once Serve's HTTP ingress (HAProxy), a process of the local cluster that
    outlives the shutdown call by a moment, has let go of the HTTP port, so a `baton serve`
    started right after this one exits can bind it (else it fails with "Failed to bind")."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as HAProxy binds
            try:
                probe.bind((host, port))
                return
            except OSError:
                time.sleep(0.2)
    print(f"port {port} is still in use {timeout_s:.0f} s after the shutdown", flush=True)


def _raise_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _banner(config: BatonConfig, metrics_port: int | None) -> str:
    url = f"http://{config.host}:{config.port}"
    keyed = config.api_keys or config.api_keys_file
    auth = ' -H "Authorization: Bearer $BATON_API_KEY"' if keyed else ""
    metrics = f"Metrics (Prometheus) at http://127.0.0.1:{metrics_port}/metrics\n"
    return (
        f"Baton is serving {config.served_model_name} at {url}/v1 "
        f"({config.router.value} router, {redact(config.index).split('@')[-1]} index)\n"
        f"  curl {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{config.served_model_name}", '
        f'"messages": [{{"role": "user", "content": "Hello!"}}]}}\'\n'
        f"{metrics if metrics_port else ''}"
        "Press Ctrl-C to stop."
    )
