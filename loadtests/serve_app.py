"""A Baton application deployed for a benchmark or a test, and its replicas reached as actors."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping

import httpx
import ray
from ray import serve
from ray.serve._private.common import REPLICA_ID_FULL_ID_STR_PREFIX
from ray.serve._private.constants import SERVE_NAMESPACE
from ray.serve.deployment import Application

from baton_serve.deploy.app import (
    REPLICA_DEPLOYMENT,
    build_app,
    local_cluster_cpus,
    logical_cpus,
)
from baton_serve.deploy.config import BatonConfig
from baton_serve.deploy.local_ray import local_ray
from baton_serve.deploy.ports import free_port

READY_TIMEOUT_S = 120.0
IDLE_TIMEOUT_S = 120.0


@contextlib.contextmanager
def serve_app(config: BatonConfig, name: str, http_port: int | None) -> Iterator[str]:
    """The app for `config` under `name` at route `/name`; yields its base URL once healthy.

    Starts Serve on a free port (and shuts it down after) unless `http_port` names the port
    of a Serve instance already running; then only this app is added and deleted.
    """
    with serve_application(build_app(config), name, http_port) as url:
        yield url


@contextlib.contextmanager
def serve_application(app: Application, name: str, http_port: int | None) -> Iterator[str]:
    """`serve_app` for any Serve application answering `GET /health`."""
    port = http_port or free_port()
    if http_port is None:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(app, name=name, route_prefix=f"/{name}")
        try:
            url = f"http://127.0.0.1:{port}/{name}"
            wait_healthy(url)
            yield url
        finally:
            serve.delete(name)
    finally:
        if http_port is None:
            serve.shutdown()


@contextlib.contextmanager
def on_local_ray(
    config: BatonConfig, name: str, env: Mapping[str, str] | None = None
) -> Iterator[tuple[str, str]]:
    """A fresh local Ray cluster (its processes see `env` too) with `config` deployed as
    `name`; yields the app's base URL and served model name."""
    cpus = local_cluster_cpus(logical_cpus(config))
    with on_local_ray_application(lambda: build_app(config), name, cpus, env) as url:
        yield url, config.served_model_name


@contextlib.contextmanager
def on_local_ray_application(
    build: Callable[[], Application], name: str, num_cpus: int, env: Mapping[str, str] | None
) -> Iterator[str]:
    """`on_local_ray` for any application answering `GET /health`, built by `build` once
    `env` is set; yields its base URL."""
    env = env or {}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        with local_ray(num_cpus), serve_application(build(), name, None) as url:
            yield url
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def wait_healthy(url: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until `GET url/health` answers 200."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
    raise TimeoutError(f"the Serve app at {url} never became healthy")


def replica_names(app: str) -> dict[str, str]:
    """The app's live replica actors' names by replica id: Serve names them
    `SERVE_REPLICA::app#deployment#id`."""
    prefix = f"{REPLICA_ID_FULL_ID_STR_PREFIX}{app}#{REPLICA_DEPLOYMENT}#"
    return {
        actor["name"][len(prefix) :]: actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == SERVE_NAMESPACE and actor["name"].startswith(prefix)
    }


def replica_actors(app: str) -> dict[str, ray.actor.ActorHandle]:
    """The app's replica actors by replica id: reaching each directly is how a benchmark or
    test reads every replica's counters, whatever the request router would choose."""
    return {
        replica: ray.get_actor(name, namespace=SERVE_NAMESPACE)
        for replica, name in replica_names(app).items()
    }


async def replica_stats(app: str) -> list[dict]:
    """Each replica's `record_routing_stats()` (load, cache bytes, pull counters)."""
    actors = replica_actors(app).values()
    return list(await asyncio.gather(*(actor.record_routing_stats.remote() for actor in actors)))


async def wait_idle(app: str, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Until no replica of `app` has anything queued or running (reply replays included)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(s["queued"] == 0 and s["running"] == 0 for s in await replica_stats(app)):
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"the replicas of {app} did not go idle")
