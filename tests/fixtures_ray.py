"""A local Ray cluster shared by the test session (2 logical CPUs, no dashboard).

Imported first by conftest.py: `deploy.local_ray` sets Ray's environment before Ray is
imported anywhere.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from deploy.local_ray import local_ray


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

    from loadtests.redis_server import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()


def wait_healthy(url: str, timeout: float = 90.0) -> None:
    """Wait until a Baton app's `/health` answers 200."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the app never became healthy")
