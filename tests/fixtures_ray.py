"""A local Ray cluster shared by the test session (2 logical CPUs, no dashboard).

Imported first by conftest.py: `deploy.local_ray` sets Ray's environment before Ray is
imported anywhere.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import ray

from baton_serve.deploy.local_ray import local_ray, start_local_ray
from baton_serve.loadtests.serve_app import wait_healthy  # noqa: F401  (the tests' import point)

SESSION_CPUS = 2
_session_serve_port: list[int] = []  # Serve's port once `serve_port` started it


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """Ray initialised in namespace "baton" for the session; it flushes metrics every
    second (not 10), so tests reading an app's metrics wait less."""
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    with local_ray(num_cpus=SESSION_CPUS):
        yield


@pytest.fixture(scope="session")
def serve_port(ray_cluster: None) -> Iterator[int]:
    """Ray Serve's HTTP ingress (HAProxy) on a free local port, for the session."""
    from ray import serve

    from baton_serve.deploy.ports import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    _session_serve_port[:] = [port]
    yield port
    serve.shutdown()
    _session_serve_port.clear()


@contextlib.contextmanager
def session_ray_paused() -> Iterator[None]:
    """The session's local Ray (and its Serve) stopped for the block, then started again
    (on the same Serve port): a process drives one Ray cluster at a time, so a module with
    a cluster of its own (`test_multinode.py`) lets go of the session's meanwhile."""
    if not ray.is_initialized():
        yield
        return
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    try:
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        start_local_ray(SESSION_CPUS)
        if _session_serve_port:
            serve.start(http_options={"host": "127.0.0.1", "port": _session_serve_port[0]})
