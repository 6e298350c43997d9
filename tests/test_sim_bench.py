"""`baton bench sim`, the routing simulator: deterministic, calibrated, and deciding with
the router's own code (pure Python, no model and no Ray: each test takes about a second)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from baton_serve.loadtests.plots import SIM_METRICS, sim_plots
from baton_serve.loadtests.sim_bench import (
    MEASURED_ROUTING,
    PROFILES,
    sim_benchmark,
    summarize,
    targets,
    validation,
)
from baton_serve.loadtests.sim_cluster import Cluster
from baton_serve.loadtests.sim_policies import BATON, POLICIES, ROUND_ROBIN, BatonPolicy
from baton_serve.loadtests.sim_workload import (
    BURST,
    ClusterWorkload,
    Phase,
    Session,
    Turn,
    block_chain,
    cluster_workload,
)
from baton_serve.router.routing.route_decision import REASONS

CPU = PROFILES["cpu"]
SMALL = ClusterWorkload(sessions_per_replica=3)


def _burst(sessions: int, shared: int, own: int) -> list[Phase]:
    """`sessions` one-turn sessions arriving at once, sharing a `shared`-token prefix."""
    system = (1, shared)
    return [
        Phase(
            [
                Session(BURST, i, 0.0, (system,), [Turn(((100 + i, own),), 8)])
                for i in range(sessions)
            ]
        )
    ]


def test_a_seeded_run_gives_the_same_figures_twice() -> None:
    phases = cluster_workload(SMALL, 4, CPU.prefill_tokens_per_s)
    first = summarize(Cluster(CPU, 4, BATON).run(phases))
    again = summarize(Cluster(CPU, 4, BATON).run(phases))
    assert first == again
    assert first["requests"] > 12 and 0 < first["cache_hit_ratio"] < 1
    other_seed = cluster_workload(ClusterWorkload(sessions_per_replica=3, seed=1), 4, 100.0)
    assert summarize(Cluster(CPU, 4, BATON).run(other_seed)) != first


def test_one_shared_prefix_is_computed_at_most_once_per_replica_under_baton() -> None:
    replicas, sessions, shared, own = 4, 32, 2000, 40
    run = Cluster(CPU, replicas, BATON).run(_burst(sessions, shared, own))
    computed = sum(r.computed_tokens for r in run.records)
    times_shared = (computed - sessions * own) / shared
    assert 1 <= times_shared <= replicas + 0.01, times_shared
    assert len({r.replica for r in run.records}) == replicas  # and the burst spread


def test_a_burst_on_two_replicas_computes_its_new_prefix_once_and_uses_both() -> None:
    """One replica computes the shared prefix; the other waits for it and pulls it (a
    second computation would gain only the shipping time), and its later requests join
    that pull rather than computing the prefix again."""
    sessions, shared, own = 4, 1000, 40
    run = Cluster(CPU, 2, BATON).run(_burst(sessions, shared, own))
    computed = sum(r.computed_tokens for r in run.records)
    assert (computed - sessions * own) / shared == pytest.approx(1.0)
    assert len({r.replica for r in run.records}) == 2
    assert run.reasons["peer_pull"] == 1 and run.reasons["in_flight"] == 2


def test_the_router_plans_pulls_at_the_bandwidth_replicas_report() -> None:
    """On the gpu profile a 2,000-token state is 262 MB: at the router's default 0.5 GB/s
    a pull never beats a 10,000 tok/s prefill, at the 25 GB/s link the replicas report it
    does (the router planned none before replicas reported their bandwidth)."""
    run = Cluster(PROFILES["gpu"], 4, BATON).run(_burst(32, 2000, 40))
    assert run.reasons["peer_pull"] >= 1
    assert summarize(run)["shipped_gb"] > 0


def test_round_robin_spreads_equal_work_exactly() -> None:
    run = Cluster(CPU, 4, ROUND_ROBIN).run(_burst(40, 10, 500))
    assert summarize(run)["load_imbalance"] == pytest.approx(1.0)


def test_the_baton_policy_decides_with_route_cost() -> None:
    """Its decisions carry the reasons `route_decision.decide` gives from `rank`'s plans,
    and its ledger (the router's own `RoutingLedger`) counts what it sent."""
    cluster = Cluster(CPU, 4, BATON)
    run = cluster.run(cluster_workload(SMALL, 4, CPU.prefill_tokens_per_s))
    assert isinstance(cluster.policy, BatonPolicy)
    assert set(REASONS.values()) & set(run.reasons)  # prefix hits, joins or pulls
    assert set(run.reasons) <= {*REASONS.values(), "load_fallback", "no_prefix"}
    assert sum(run.reasons.values()) == len(run.records)
    assert all(cluster.policy.ledger.load(rid) == 0 for rid in cluster.replicas)


def test_only_baton_ships_states() -> None:
    """Replicas pull from peers only under Baton's router (the only one that reaches a
    given replica), as `baton serve` deploys them."""
    phases = cluster_workload(SMALL, 4, CPU.prefill_tokens_per_s)
    shipped = {p: summarize(Cluster(CPU, 4, p).run(phases))["shipped_gb"] for p in POLICIES}
    assert shipped[BATON] > 0
    assert all(gb == 0 for p, gb in shipped.items() if p != BATON)


def test_the_block_chain_extends_with_the_prompt() -> None:
    short = ((1, 100), (2, 60))
    longer = (*short, (3, 24), (4, 60))
    assert block_chain(longer, 64)[:2] == block_chain(short, 64)
    assert len(block_chain(longer, 64)) == 244 // 64
    assert block_chain(((1, 100), (5, 60)), 64)[1] != block_chain(short, 64)[1]


def test_validation_sets_simulated_beside_measured() -> None:
    result = validation(CPU)
    assert set(result["policies"]) == set(MEASURED_ROUTING)
    for row in result["policies"].values():
        assert row["simulated"]["requests"] == 72  # bench routing's 72 measured requests
        # every policy's figures (medians over seeds) agree with the measured run within 25%
        assert all(row["agree"].values()), row


def test_a_small_benchmark_has_every_figure_and_a_plot_per_metric(tmp_path: Path) -> None:
    result = sim_benchmark(CPU, sizes=(4,), policies=(BATON, ROUND_ROBIN), workload=SMALL)
    figures = result["sizes"]["4"][BATON]
    for key in ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "load_imbalance", "shipped_gb"):
        assert figures[key] >= 0
    assert result["targets"] == {}  # no 64-replica run
    written = sim_plots(result, tmp_path)
    assert [p.name for p in written] == [name for name, _, _ in SIM_METRICS.values()]
    assert all(p.stat().st_size > 1000 for p in written)


def test_the_targets_compare_baton_with_the_best_other_at_64() -> None:
    at_64 = {
        BATON: {"ttft_p99_s": 4.0, "load_imbalance": 1.1},
        "pow2": {"ttft_p99_s": 10.0, "load_imbalance": 1.2},
        "chwbl": {"ttft_p99_s": 7.0, "load_imbalance": 1.2},
    }
    found = targets({"64": at_64})
    assert found["ttft_p99_over_best_other"]["value"] == pytest.approx(4 / 7)
    assert not found["ttft_p99_over_best_other"]["met"] and found["load_imbalance"]["met"]


def _baton(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "baton_serve.deploy.cli", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
    )


def test_the_command_prints_json_and_refuses_an_unknown_policy(tmp_path: Path) -> None:
    common = ["bench", "sim", "--replicas", "4", "--sessions-per-replica", "2"]
    done = _baton(*common, "--policies", "baton", "chwbl", "--json", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result["sizes"]["4"]) == {"baton", "chwbl"}
    assert (tmp_path / "sim_ttft_p99.png").exists()
    wrong = _baton(*common, "--policies", "random", "--out", str(tmp_path))
    assert wrong.returncode != 0 and "random" in wrong.stderr


@pytest.mark.parametrize("step_tokens", [CPU.step_tokens, 129])
def test_a_replica_steps_as_the_engine_does(step_tokens: int) -> None:
    """A step (a 256-token piece: 2.56 s on the cpu profile) is not interrupted; with no
    stream decoding the next carries a piece of each prompt, the one with the shortest
    remaining prefill first, as the step's tokens allow; a prompt's first token comes as its
    last piece is done; once a slot decodes, every step carries its token and one piece."""
    cpu = replace(CPU, step_noise=0.0, step_tokens=step_tokens)
    long = Session(BURST, 0, 0.0, (), [Turn(((1, 1000),), 8)])
    short = Session(BURST, 1, 0.5, (), [Turn(((2, 100),), 8)])
    run = Cluster(cpu, 1, ROUND_ROBIN).run([Phase([long, short])])
    ttft = {r.session: r.ttft_s for r in run.records}
    first = min(cpu.prefill_chunk, step_tokens)  # the long one's, alone
    beside = min(cpu.prefill_chunk, step_tokens - 100)  # its next, after the short one's

    # the short prompt waits for the long one's first step, then goes first in the next
    short_prefilled = (first + 100) / cpu.prefill_tokens_per_s
    assert ttft[1] == pytest.approx(short_prefilled - 0.5)
    # the long one's other tokens go one piece a step beside the short one's token (which
    # needs 7 more: it decodes throughout), each cut to what the step has room for
    rest = 1000 - first - beside
    steps = -(-rest // min(cpu.prefill_chunk, step_tokens - 1))
    assert steps == (2 if step_tokens > cpu.prefill_chunk + 100 else 7)
    long_prefilled = (
        (first + 100 + beside) / cpu.prefill_tokens_per_s
        + steps * cpu.decode_step_s(1)
        + rest / cpu.prefill_tokens_per_s
    )
    assert ttft[0] == pytest.approx(long_prefilled)


def test_a_decode_step_costs_between_one_stream_and_a_full_batch() -> None:
    assert CPU.decode_step_s(1) == pytest.approx(1 / CPU.decode_tokens_per_s)
    full = CPU.slots / CPU.batch_decode_tokens_per_s
    assert CPU.decode_step_s(CPU.slots) == pytest.approx(full)
    assert CPU.decode_step_s(1) < CPU.decode_step_s(2) < CPU.decode_step_s(CPU.slots)
    gpu = PROFILES["gpu"]  # weights read once per step: 16 streams cost what one does
    assert gpu.decode_step_s(gpu.slots) == pytest.approx(gpu.decode_step_s(1))


@pytest.mark.parametrize("policy", ["baton", "pow2"])
def test_a_slowed_clock_stretches_every_time_and_changes_no_decision(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench routing --engine emulated --slowdown K` compares its TTFTs divided by K with
    the simulator at full speed: that holds only if `slowed` scales every rate and interval
    (a missed one would change what the simulator decides on the slowed workload). Without
    step noise: with it, the clock's rounding alone reorders near-ties and the seeded noise
    then falls on other steps (a few % apart on this small workload). Exact ties (idle
    replicas that could pull the same state) are broken by a hash of the clock's reading, so
    that they rotate; here each run hashes its estimates' order instead, which a slower
    clock does not change."""
    from baton_serve.loadtests.emulated_routing import slowed
    from baton_serve.router.routing import route_cost

    def clock_free_tie(counter: Iterator[int]) -> Callable[[object, float], int]:
        return lambda estimate, _now: zlib.crc32(f"{next(counter)}".encode())

    quiet = replace(CPU, step_noise=0.0)
    slow_profile, slow_workload = slowed(quiet, SMALL, 4.0)
    monkeypatch.setattr(route_cost, "_tie", clock_free_tie(itertools.count()))
    fast = summarize(Cluster(quiet, 4, policy, 0).run(cluster_workload(SMALL, 4, 100.0)))
    phases = cluster_workload(slow_workload, 4, slow_profile.prefill_tokens_per_s)
    monkeypatch.setattr(route_cost, "_tie", clock_free_tie(itertools.count()))
    slow = summarize(Cluster(slow_profile, 4, policy, 0).run(phases))
    for name in ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s"):
        assert slow[name] == pytest.approx(4 * fast[name], rel=1e-6), name
    assert slow["computed_over_new"] == pytest.approx(fast["computed_over_new"], rel=1e-9)
