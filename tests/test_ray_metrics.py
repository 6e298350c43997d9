"""`loadtests.ray_metrics`: the counters the benchmarks read from a metrics endpoint, over real HTTP."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from baton_serve.loadtests.ray_metrics import app_counters

EXPOSITION = """\
# HELP ray_baton_requests_total Requests.
# TYPE ray_baton_requests_total counter
ray_baton_requests_total{application="a",status="ok"} 3.0
ray_baton_requests_total{application="a",status="error"} 1.0
ray_baton_requests_total{application="b",status="ok"} 7.0
# HELP ray_baton_router_index_view_age_seconds Age of the router's index copy.
# TYPE ray_baton_router_index_view_age_seconds gauge
ray_baton_router_index_view_age_seconds{application="a"} {age}
# HELP ray_other_total Not Baton's.
# TYPE ray_other_total counter
ray_other_total{application="a"} 5.0
"""


@pytest.fixture
def metrics_url() -> Iterator[str]:
    """An endpoint whose gauge changes on every scrape, as the router's index age does."""
    scrapes = iter(range(1, 1_000_000))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = EXPOSITION.replace("{age}", f"{next(scrapes) * 0.1:.1f}").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()


def test_counters_are_summed_per_app_and_label_and_gauges_left_out(metrics_url: str) -> None:
    first = app_counters("a", metrics_url)
    assert first == {
        "ray_baton_requests_total": 4.0,
        "ray_baton_requests_total{status=ok}": 3.0,
        "ray_baton_requests_total{status=error}": 1.0,
    }
    # two scrapes agree although the gauge moved between them: the settle rule can end
    assert app_counters("a", metrics_url) == first
