"""`baton bench gateway` end to end on a tiny model: two short rate steps through the real
Serve app (proxy, one gateway replica, Baton's router, embedded index) on 2 instant
emulated replicas, then the same steps against Ray Serve's floor (a FastAPI ingress and one
handle call, no Baton code, on a fresh Ray); every figure is in the JSON for both, no request
failed, and /health names the emulated engine. The traced run (a second Ray start, with tracing on) is left out to keep
the test short; `baton bench peer`'s test covers the span breakdown it reuses.

The bench runs in its own process (`baton bench gateway --json`): it starts and stops Ray
itself, which must not meet the Ray this test session may hold.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from plot_files import assert_png

from baton_serve.loadtests.gateway_cli import format_report
from baton_serve.loadtests.gateway_rate import LIMITS_MS, passes, sustained

BENCH_TIMEOUT_S = 300
RATES = (5.0, 10.0)


@pytest.mark.slow
def test_the_gateway_bench_measures_each_rate_step(tiny_model, tmp_path) -> None:
    command = [
        *(sys.executable, "-m", "baton_serve.deploy.cli", "bench", "gateway"),
        *("--model", str(tiny_model("llama")), "--replicas", "2"),
        *("--rates", ",".join(f"{r:g}" for r in RATES), "--step-s", "2"),
        *("--breakdown-rate", "0", "--json", "--out", str(tmp_path)),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "gateway.json").read_text())  # Ray may print to stdout too

    assert result["engine"] == "emulated:instant"
    assert result["health"] == {"status": "ok", "engine": "emulated:instant"}
    floor = result["floor"]
    assert "no Baton code" in floor["app"]
    for ramp in (result, floor):
        _assert_measured(ramp["steps"])
        assert set(ramp["sustained_per_s"]) == {f"p99_le_{limit:g}ms" for limit in LIMITS_MS}
    assert "breakdown" not in result
    report = format_report(result).splitlines()
    own = report[report.index("Baton's own part (Baton - floor), ms:") + 1 :]
    assert len(own) == min(len(result["steps"]), len(floor["steps"])), report
    assert_png(tmp_path / "gateway_latency.png")


def _assert_measured(steps: list[dict]) -> None:
    """Each step sent, answered every request, and has its latencies and CPU."""
    assert [s["offered_per_s"] for s in steps] == list(RATES[: len(steps)]) and steps
    for step in steps:
        assert step["requests"] > 0 and step["errors"] == 0, step
        assert step["achieved_per_s"] > 0
        for figure in ("ttft_ms", "total_ms"):
            assert set(step[figure]) == {"p50", "p95", "p99"}, step
        assert 0 < step["ttft_ms"]["p50"] <= step["ttft_ms"]["p99"] <= step["total_ms"]["p99"]
        assert step["cpu_cores"]["generator"] > 0 and step["cpu_cores"]["gateway"] > 0, step


def _step(offered: float, p99_ms: float, *, answered: float = 1.0, errors: int = 0) -> dict:
    sent = offered * 10
    return {
        "offered_per_s": offered,
        "sent_per_s": offered,
        "requests": sent,
        "errors": errors,
        "achieved_per_s": offered * answered,
        "ttft_ms": {"p50": p99_ms / 2, "p95": p99_ms, "p99": p99_ms},
    }


def test_the_sustained_rate_is_the_highest_step_within_the_limit_that_kept_up() -> None:
    steps = [
        _step(10, 4.0),
        _step(20, 8.0),
        _step(40, 30.0),  # past 10 ms, within 50
        _step(80, 9.0, answered=0.9),  # fast, but it fell behind what it sent
        _step(160, 7.0, errors=1),  # a failed request: no pass
    ]
    assert sustained(steps) == {"p99_le_10ms": 20, "p99_le_50ms": 40}
    assert not passes(_step(5, 60.0), 50.0)
    assert sustained([_step(10, 80.0)]) == {"p99_le_10ms": None, "p99_le_50ms": None}
