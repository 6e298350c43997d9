"""`baton serve` observed from outside, as an operator would: a real subprocess serving a
generated hybrid model from its own Ray cluster, its Prometheus metrics scraped from
`--metrics-port`, its spans received by an OTLP/HTTP collector run by this test, its JSON log
lines read from Ray's worker logs."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from fixtures_ray import wait_healthy
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from prometheus_client.parser import text_string_to_metric_families

from baton_serve.deploy.ports import free_port

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen35"
SYSTEM = "You answer in short sentences about routing, caches and state. " * 12
SECRET = "zebra-quartz-lantern"
MAX_TOKENS = 6


def _value(kv: KeyValue) -> object:
    return getattr(kv.value, kv.value.WhichOneof("value"))


class _Collector:
    """An OTLP/HTTP trace receiver (protobuf, as the SDK's exporter sends) keeping every span:
    name, ids, attributes, and the process (pid, component) that sent it."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                collector._receive(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _receive(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            process = {kv.key: _value(kv) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        {
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_id": span.parent_span_id.hex(),
                            "attributes": {kv.key: _value(kv) for kv in span.attributes},
                            "pid": process["process.pid"],
                            "component": process["baton.component"],
                            "service": process["service.name"],
                        }
                    )

    def close(self) -> None:
        self._server.shutdown()


@dataclass
class Served:
    url: str
    metrics_url: str
    collector: _Collector
    ray_dir: Path
    output: list[str]
    replies: list[httpx.Response] = field(default_factory=list)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`baton serve` (one replica), having answered a two-turn conversation and a request
    for an unknown model."""
    collector = _Collector()
    port, metrics_port = free_port(), free_port()
    ray_dir = Path(tempfile.mkdtemp(prefix="bt", dir="/tmp"))  # short: Ray's socket paths
    env = {
        **os.environ,
        "BATON_CACHE_DIR": str(tmp_path_factory.mktemp("cache")),
        "RAY_TMPDIR": str(ray_dir),
        "RAY_metrics_report_interval_ms": "1000",  # metrics reach the agent within a second
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    command = [
        *(sys.executable, "-m", "baton_serve.deploy.cli", "serve", "--model", "tiny:qwen35"),
        *("--replicas", "1", "--cpus-per-replica", "0.5", "--n-ctx", "1024", "--slots", "1"),
        *("--port", str(port), "--metrics-port", str(metrics_port), "--log-format", "json"),
    ]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(process.stdout), daemon=True).start()
    served = Served(
        f"http://127.0.0.1:{port}",
        f"http://127.0.0.1:{metrics_port}/metrics",
        collector,
        ray_dir,
        output,
    )
    try:
        assert _poll(lambda: "Press Ctrl-C" in "".join(output), timeout=120), output
        wait_healthy(served.url)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": SECRET}]
        for turn in range(2):
            reply = _chat(served.url, messages)
            served.replies.append(reply)
            content = reply.json()["choices"][0]["message"]["content"]
            messages += [
                {"role": "assistant", "content": content},
                {"role": "user", "content": f"Turn {turn}?"},
            ]
        body = {"model": "no-such-model", "messages": messages}
        assert httpx.post(f"{served.url}/v1/chat/completions", json=body).status_code == 404
        yield served
    finally:
        process.send_signal(signal.SIGTERM)  # baton serve's own clean shutdown
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
        collector.close()
        shutil.rmtree(ray_dir, ignore_errors=True)


def _chat(url: str, messages: list[dict[str, str]]) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response


def _request_id(reply: httpx.Response) -> str:
    return reply.json()["id"].removeprefix("chatcmpl-")


def _poll(check: Callable[[], object], timeout: float = 60.0) -> object:
    """`check()`'s first truthy result, waiting for it (Ray exports metrics every second or
    so; the span processor, every 100 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def _scrape(url: str) -> dict[str, float]:
    """Every `ray_baton_*` sample, summed over replicas, keyed `name{label=value,...}` by the
    labels Baton sets (and by name alone)."""
    sums: dict[str, float] = {}
    ray_labels = {"Component", "NodeAddress", "SessionName", "Version", "WorkerId"}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if not sample.name.startswith("ray_baton_"):
                continue
            labels = {
                k: v
                for k, v in sample.labels.items()
                if k not in ray_labels
                and k not in ("application", "deployment", "replica")
                and not k.startswith("otel_")
            }
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items()))
            sums[key] = sums.get(key, 0.0) + sample.value
            if labels:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def test_the_banner_names_the_metrics_url(served: Served) -> None:
    banner = "".join(served.output)
    assert f"at {served.url}/v1" in banner
    assert f"Metrics (Prometheus) at {served.metrics_url}" in banner


def test_metrics_count_the_requests_tokens_routing_and_checkpoints(served: Served) -> None:
    usages = [reply.json()["usage"] for reply in served.replies]
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    chat = "ray_baton_requests_total{endpoint=/v1/chat/completions}"
    expected: dict[str, Callable[[float], bool]] = {
        chat + "{status=200}": lambda n: n == 2,
        chat + "{status=404}": lambda n: n == 1,
        "ray_baton_prompt_tokens_total": lambda n: n == prompt,
        "ray_baton_prompt_tokens_cached_total": lambda n: n == cached > 0,
        "ray_baton_prompt_tokens_computed_total": lambda n: n == prompt - cached,
        "ray_baton_generated_tokens_total": lambda n: n == 2 * MAX_TOKENS,
        "ray_baton_time_to_first_token_seconds_count": lambda n: n == 2,
        "ray_baton_inter_token_latency_seconds_count": lambda n: n == 2 * (MAX_TOKENS - 1),
        "ray_baton_routing_decisions_total{reason=prefix_hit}": lambda n: n >= 1,
        "ray_baton_index_lookup_seconds_count{caller=router}": lambda n: n >= 2,
        "ray_baton_checkpoints_taken_total": lambda n: n >= 2,
        "ray_baton_store_bytes": lambda n: n > 0,
        "ray_baton_slots_in_use": lambda n: n == 0,
        "ray_baton_queue_length": lambda n: n == 0,
    }

    def unmet() -> dict[str, float | None]:
        found = _scrape(served.metrics_url)
        return {
            name: found.get(name)
            for name, holds in expected.items()
            if name not in found or not holds(found[name])
        }

    assert _poll(lambda: not unmet()), unmet()


def test_one_trace_crosses_gateway_router_and_replica_processes(served: Served) -> None:
    reply = served.replies[1]
    request_id = _request_id(reply)

    def trace() -> dict[str, dict] | None:
        roots = [
            s
            for s in served.collector.spans
            if s["attributes"].get("baton.request_id") == request_id and not s["parent_id"]
        ]
        if not roots:
            return None
        spans = {
            s["name"]: s for s in served.collector.spans if s["trace_id"] == roots[0]["trace_id"]
        }
        return spans if "decode" in spans and "route" in spans else None

    spans = _poll(trace)
    assert spans, served.collector.spans
    root, route, replica = spans["POST /v1/chat/completions"], spans["route"], spans["replica"]
    assert {s["service"] for s in spans.values()} == {"baton"}
    assert root["component"] == route["component"] == "gateway" and root["pid"] == route["pid"]
    assert replica["component"] == "replica" and replica["pid"] != root["pid"]
    assert route["parent_id"] == replica["parent_id"] == root["span_id"]
    # The router reads its copy of the index (a lookup span only while the copy is not
    # current); a replica looks the index up before a pull it might make.
    assert route["attributes"]["baton.route.index"] in ("copy", "lookup")
    if route["attributes"]["baton.route.index"] == "lookup" or "index.lookup" in spans:
        assert spans["index.lookup"]["parent_id"] in (route["span_id"], replica["span_id"])
    for phase in ("queue", "restore", "prefill", "decode"):
        assert (
            spans[phase]["parent_id"] == replica["span_id"]
            and spans[phase]["pid"] == replica["pid"]
        )

    served_by = reply.headers["x-baton-replica"]
    usage = reply.json()["usage"]
    assert route["attributes"]["baton.route.reason"] == "prefix_hit"
    assert route["attributes"]["baton.route.replica"] == served_by
    assert 0 < route["attributes"]["baton.route.cached_tokens"] <= usage["prompt_tokens"]
    assert replica["attributes"]["baton.replica"] == served_by
    restored = spans["restore"]["attributes"]["baton.tokens_restored"]
    assert restored == usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert spans["decode"]["attributes"]["baton.tokens_generated"] == MAX_TOKENS


def test_json_log_lines_of_each_process_name_the_request_and_its_trace(served: Served) -> None:
    request_id = _request_id(served.replies[1])

    def lines() -> list[dict]:
        found = []
        for path in served.ray_dir.glob("ray/session_*/logs/worker-*.err"):
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith('{"ts"'):
                    found.append(json.loads(line))
        return found

    def mine() -> list[dict] | None:
        matching = [line for line in lines() if line.get("request_id") == request_id]
        return matching if len(matching) >= 2 else None

    matching = _poll(mine)
    assert matching, lines()
    by_logger = {line["logger"]: line for line in matching}
    gateway, replica = by_logger["baton.gateway"], by_logger["baton.replica"]
    assert gateway["status"] == 200 and gateway["path"] == "/v1/chat/completions"
    assert replica["cached_tokens"] > 0 and replica["completion_tokens"] == MAX_TOKENS
    assert gateway["trace_id"] == replica["trace_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", gateway["trace_id"])
    everything = json.dumps(lines())
    assert SECRET not in everything and "routing, caches and state" not in everything


def test_a_metrics_port_cannot_be_set_on_a_joined_cluster(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "baton_serve.deploy.cli", "serve", "--address", "127.0.0.1:1"]
        + ["--metrics-port", "9999", "--model", "tiny:llama"],
        env={**os.environ, "BATON_CACHE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "ray start --metrics-export-port" in done.stderr
