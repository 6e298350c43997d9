"""`baton bench routing` on a tiny model and workload: the result's shape and the behaviour
it must show (state shipped when a session's replica is busy), not the speed targets."""

from __future__ import annotations

import csv
import io
import json

from plot_files import assert_png

from baton_serve.deploy.config import RouterPolicy
from baton_serve.loadtests.progress import Progress
from baton_serve.loadtests.routing_bench import routing_benchmark
from baton_serve.loadtests.routing_report import format_report, write_outputs
from baton_serve.loadtests.routing_workload import CHAT, MOVED, RoutingWorkload

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
    "cached_ratio",
    "checkpoints_shipped",
    "bytes_shipped",
}


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
        assert REQUIRED <= set(figures) and REQUIRED <= set(figures[MOVED])
        assert figures["errors"] == 0 and figures[MOVED]["errors"] == 0
        assert figures["requests"] == WORKLOAD.sessions * WORKLOAD.turns
        assert 0 < figures["ttft_p50_s"] <= figures["ttft_p95_s"] <= figures["ttft_p99_s"]
        assert 0 < figures["new_prompt_tokens"] <= figures["prompt_tokens"]
    for record in records:  # the client-side tokenisation is the gateway's
        assert record.prompt_tokens == len(record.prompt), record
    # Same user messages for every policy: the first turns are identical prompts.
    first_turns = {
        p: sorted(len(r.prompt) for r in records if r.policy == p and r.turn == 1) for p in policies
    }
    assert len({tuple(v) for v in first_turns.values()}) == 1

    baton, round_robin = policies["baton"], policies["round-robin"]
    assert baton["computed_prompt_tokens"] < round_robin["computed_prompt_tokens"]
    assert baton[MOVED]["checkpoints_shipped"] >= 1 and baton[MOVED]["bytes_shipped"] > 0
    # The app's own metrics agree: Baton's router found prefixes, its replicas pulled.
    assert baton["routing_decisions"].get("prefix_hit", 0) > 0
    assert baton[MOVED]["pull_outcomes"].get("pulled", 0) == baton[MOVED]["checkpoints_shipped"]
    assert round_robin["checkpoints_shipped"] == round_robin[MOVED]["checkpoints_shipped"] == 0
    assert set(result["targets"]) == {"computed_over_new"}  # pow2 and the anchor were not run

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
    assert {row["scenario"] for row in rows} == {CHAT, MOVED}
    for plot in ("ttft_cdf.png", "computed_per_turn.png"):
        assert_png(tmp_path / plot)
    progress = stderr.getvalue()
    per_policy = WORKLOAD.sessions * WORKLOAD.turns + 2 * WORKLOAD.moved_sessions
    assert "policy baton (1/2): deploying" in progress
    assert f"policy round-robin (2/2): request {per_policy}/{per_policy}" in progress
    assert f"({2 * per_policy}/{2 * per_policy})" in progress
    report = format_report(result)
    assert "baton" in report and "round-robin" in report and "moved" in report
