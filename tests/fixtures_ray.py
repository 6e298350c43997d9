"""A local Ray cluster shared by the test session (2 logical CPUs, no dashboard).

Imported first by conftest.py: `deploy.local_ray` sets Ray's environment before Ray is
imported anywhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from baton_serve.deploy.local_ray import local_ray
from baton_serve.loadtests.serve_app import wait_healthy  # noqa: F401  (the tests' import point)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """Ray initialised in namespace "baton" for the session; it flushes metrics every
    second (not 10), so tests reading an app's metrics wait less."""
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    with local_ray(num_cpus=2):
        yield


@pytest.fixture(scope="session")
def serve_port(ray_cluster: None) -> Iterator[int]:
    """Ray Serve's HTTP proxy on a free local port, for the session."""
    from ray import serve

    from baton_serve.loadtests.redis_server import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()
