"""`baton bench routing` on a tiny model and workload: the result's shape and the behaviour
it must show (state shipped when a session's replica is busy), not the speed targets."""

from __future__ import annotations

import csv
import io
import json

import pytest
from plot_files import assert_png

from baton_serve.deploy.config import RouterPolicy
from baton_serve.loadtests.progress import Progress
from baton_serve.loadtests.routing_bench import routing_benchmark
from baton_serve.loadtests.routing_report import ALL, format_report, write_outputs
from baton_serve.loadtests.routing_workload import (
    AGENT,
    BURST,
    CHAT,
    MOVED,
    SCENARIOS,
    RoutingWorkload,
)

WORKLOAD = RoutingWorkload(
    sessions=3,
    turns=3,
    concurrency=2,
    system_tokens=300,
    document_tokens=1200,  # a pull must beat recomputing this on a fast tiny model
    turn_tokens=30,
    reply_tokens=8,
    think_s=0.2,
    moved_sessions=1,
    burst_sessions=3,
    agent_sessions=2,
    agent_steps=3,
    tool_tokens=20,
)
POLICIES = (RouterPolicy.BATON, RouterPolicy.ROUND_ROBIN)
REQUIRED = {
    "requests",
    "errors",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "total_s",
    "prompt_tokens",
    "computed_prompt_tokens",
    "new_prompt_tokens",
    "distinct_prompt_tokens",
    "cached_ratio",
    "computed_over_distinct",
    "checkpoints_shipped",
    "bytes_shipped",
}
EXPECTED_REQUESTS = {CHAT: 9, BURST: 3, AGENT: 6, MOVED: 2}


def test_routing_benchmark_compares_policies_on_one_workload(
    tiny_model, serve_port, redis_server, tmp_path
) -> None:
    result, records = routing_benchmark(
        tiny_model("qwen35"),
        workload=WORKLOAD,
        policies=POLICIES,
        index=redis_server.url,
        cpus_per_replica=0.5,
        http_port=serve_port,
        progress=Progress("bench routing", stderr := io.StringIO()),
    )
    policies = result["policies"]
    assert list(policies) == [p.value for p in POLICIES]
    for figures in policies.values():
        assert figures[ALL]["requests"] == WORKLOAD.requests() == sum(EXPECTED_REQUESTS.values())
        for scenario in SCENARIOS:
            row = figures[scenario]
            assert REQUIRED <= set(row), scenario
            assert row["errors"] == 0 and row["requests"] == EXPECTED_REQUESTS[scenario]
            assert 0 < row["ttft_p50_s"] <= row["ttft_p95_s"] <= row["ttft_p99_s"]
            assert 0 < row["distinct_prompt_tokens"] <= row["prompt_tokens"]
        assert 0 < figures[CHAT]["new_prompt_tokens"] <= figures[CHAT]["prompt_tokens"]
        assert figures[AGENT]["follow_ups"] == WORKLOAD.agent_sessions * (WORKLOAD.agent_steps - 1)
        assert figures[BURST]["shared_prefix_tokens"] >= WORKLOAD.system_tokens
    for record in records:  # the client-side tokenisation is the gateway's
        assert record.prompt_tokens == len(record.prompt), record
    # Same user messages for every policy: the first turns are identical prompts.
    first_turns = {
        p: sorted(len(r.prompt) for r in records if r.policy == p and r.turn == 1) for p in policies
    }
    assert len({tuple(v) for v in first_turns.values()}) == 1

    baton, round_robin = policies["baton"], policies["round-robin"]
    assert baton[CHAT]["computed_prompt_tokens"] < round_robin[CHAT]["computed_prompt_tokens"]
    assert baton[MOVED]["checkpoints_shipped"] >= 1 and baton[MOVED]["bytes_shipped"] > 0
    # The burst's shared system prompt is computed at most once per replica (give or take the
    # few tokens after it that a request restoring the system prompt's checkpoint recomputes).
    assert baton[BURST]["shared_computed_times"] <= 2.1
    # Agent steps with no pause keep their cache.
    assert baton[AGENT]["follow_ups_kept"] == baton[AGENT]["follow_ups"]
    # The app's own metrics agree: Baton's router found prefixes, its replicas pulled.
    assert baton[CHAT]["routing_decisions"].get("prefix_hit", 0) > 0
    assert baton[MOVED]["pull_outcomes"].get("pulled", 0) == baton[MOVED]["checkpoints_shipped"]
    assert round_robin[MOVED]["checkpoints_shipped"] == 0
    # against the other policies run (round robin here): never behind the best of them
    assert set(result["targets"]) == {
        "errors",
        "computed_over_new",
        "burst_shared_prefix_computed_times",
        "agent_follow_ups_kept",
        "ttft_p50_over_best_other",
        "ttft_p95_over_best_other",
        "ttft_p99_over_best_other",
        "computed_over_least_other",
    }
    computed = result["targets"]["computed_over_least_other"]
    assert computed["value"] == pytest.approx(
        baton[ALL]["computed_prompt_tokens"] / round_robin[ALL]["computed_prompt_tokens"]
    )
    assert computed["target"] == "<= 1.05"

    written = write_outputs(result, records, tmp_path)
    assert {p.name for p in written} == {
        "summary.json",
        "policies.csv",
        "requests.csv",
        "ttft_cdf.png",
        "computed_per_turn.png",
    }
    assert json.loads((tmp_path / "summary.json").read_text()) == result
    with (tmp_path / "requests.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == len(records)
    assert {row["scenario"] for row in rows} == set(SCENARIOS)
    for plot in ("ttft_cdf.png", "computed_per_turn.png"):
        assert_png(tmp_path / plot)
    progress = stderr.getvalue()
    per_policy = WORKLOAD.requests()
    assert "policy baton (1/2): deploying" in progress
    assert f"policy round-robin (2/2): request {per_policy}/{per_policy}" in progress
    assert f"({2 * per_policy}/{2 * per_policy})" in progress
    report = format_report(result)
    assert "baton" in report and "round-robin" in report
    assert all(f"\n{scenario}: " in report for scenario in SCENARIOS)
