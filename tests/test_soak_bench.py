"""`baton bench soak` for half a minute on a tiny model: locust's mixed workload runs with no
failures, and the figures over time and the replicas' memory are read back."""

from __future__ import annotations

from baton_serve.loadtests.soak_bench import format_report, soak_benchmark


def test_short_soak_reports_requests_ttft_and_replica_memory(
    tiny_model, serve_port, tmp_path
) -> None:
    result = soak_benchmark(
        tiny_model("llama"),
        minutes=0.5,
        out_dir=tmp_path,
        users=3,
        replicas=1,
        system_tokens=200,
        max_tokens=8,
        cpus_per_replica=0.5,
        http_port=serve_port,
    )
    assert result["requests"] > 10 and result["failures"] == 0
    assert 0 < result["ttft_p50_s"] <= result["ttft_p99_s"]
    assert result["windows"] and sum(w["requests"] for w in result["windows"]) == result["requests"]
    (replica,) = result["memory"]["replicas"].values()
    assert replica["rss_start_mb"] > 10 and replica["rss_end_mb"] > 10
    assert {"soak_stats.csv", "soak_samples.csv", "soak.html"} <= {
        p.rsplit("/", 1)[-1] for p in result["reports"]
    }
    assert "largest growth" in format_report(result)
