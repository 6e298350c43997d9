"""`baton bench soak` for 15 seconds on a tiny model: locust's mixed workload runs with no
failures, the figures over time and the replicas' memory are read back, progress is shown and
the plots are written (how long it runs changes none of these)."""

from __future__ import annotations

import io
from pathlib import Path

from plot_files import assert_png

from baton_serve.loadtests.progress import Progress
from baton_serve.loadtests.soak_bench import format_report, soak_benchmark


def test_short_soak_reports_requests_ttft_and_replica_memory(
    tiny_model, serve_port, tmp_path
) -> None:
    result = soak_benchmark(
        tiny_model("llama"),
        minutes=0.25,
        out_dir=tmp_path,
        users=3,
        replicas=1,
        system_tokens=200,
        max_tokens=8,
        cpus_per_replica=0.5,
        http_port=serve_port,
        progress=Progress("bench soak", stderr := io.StringIO()),
    )
    assert result["requests"] > 10 and result["failures"] == 0
    assert 0 < result["ttft_p50_s"] <= result["ttft_p99_s"]
    assert result["windows"] and sum(w["requests"] for w in result["windows"]) == result["requests"]
    (replica,) = result["memory"]["replicas"].values()
    assert replica["rss_start_mb"] > 10 and replica["rss_end_mb"] > 10
    assert {"soak_stats.csv", "soak_samples.csv", "soak.html"} <= {
        p.rsplit("/", 1)[-1] for p in result["reports"]
    }
    report = format_report(result)
    assert "largest growth" in report
    assert [Path(p).name for p in result["plots"]] == ["soak_rss.png", "soak_ttft.png"]
    for plot in result["plots"]:
        assert_png(Path(plot))
        assert plot in result["reports"] and plot in report.splitlines()[-1]
    progress = stderr.getvalue()
    assert "locust: 3 users for 15 s" in progress
    assert f"done: {result['requests']} requests, 0 failures, TTFT p50" in progress
