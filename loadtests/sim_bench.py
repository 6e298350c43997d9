"""`baton bench sim`: the routing policies on simulated clusters of 4 to 256 replicas.

A discrete-event simulation (`sim_cluster`) of replicas whose costs come from a profile —
"cpu": SmolLM2 on this machine, from docs/benchmarks.md's `bench engine`, `bench ship` and
`bench routing` figures; "gpu": parameters — routed by each policy (`sim_policies`; Baton's
is the router's own decision code). The workload (`sim_workload.cluster_workload`) grows
with the replica count, so the load per replica is the same at every size.

`validation` replays `bench routing`'s workload on 2 simulated replicas and sets the
simulated figures beside the measured ones.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, replace

import numpy as np

from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.loadtests.sim_cluster import Cluster, RunResult
from baton_serve.loadtests.sim_policies import BATON, POLICIES
from baton_serve.loadtests.sim_profile import Profile
from baton_serve.loadtests.sim_workload import (
    ClusterWorkload,
    cluster_workload,
    routing_bench_phases,
)

SIZES = (4, 16, 64, 256)
TARGET_REPLICAS = 64
P99_RATIO_TARGET = 0.5  # Baton's TTFT p99 over the best other policy's
IMBALANCE_TARGET = 1.3
AGREEMENT = 0.25  # simulated within this share of measured
VALIDATION_SEEDS = 9
VALIDATED = ("ttft_p50_s", "ttft_mean_s", "computed_over_new")  # MEASURED_ROUTING's figures

PROFILES = {
    # SmolLM2-135M Q4_1 on this 2-core machine, one llama.cpp thread per replica as in
    # `bench routing`: ~100 prompt tok/s at its 1,000-2,000-token contexts; decode 60 tok/s
    # for one stream and 60 tok/s for 4 together (`bench engine --threads 1 --concurrency
    # 4`: a step costs about the same per stream at any batch on one CPU thread); a
    # 2,048-token state is 47.2 MB and moves in 0.019 s, 0.006 s of it the restore, the
    # whole pull about 0.02 s more (`bench ship`, 2026-11-24, state blob format 3); the
    # store's default budget is 2 GiB. Step noise 0.15: short follow-ups' TTFT per token
    # spreads by 7-16% (CV) in `bench routing` runs, where two replicas share two cores with
    # the gateway and the client.
    "cpu": Profile(
        "cpu",
        prefill_tokens_per_s=100.0,
        decode_tokens_per_s=60.0,
        batch_decode_tokens_per_s=60.0,
        slots=4,
        link_bytes_per_s=3.6e9,
        ship_latency_s=0.02,
        restore_bytes_per_s=8.1e9,
        bytes_per_token=23_047,
        cache_bytes=2 * 2**30,
        step_noise=0.15,
    ),
    # A GPU serving an 8B GQA model (128 KiB of fp16 KV per token): parameters, not a
    # measurement; override them on the command line. A decode step takes about as long
    # for 16 streams as for one (weights are read once per step).
    "gpu": Profile(
        "gpu",
        prefill_tokens_per_s=10_000.0,
        decode_tokens_per_s=100.0,
        batch_decode_tokens_per_s=1600.0,
        slots=16,
        link_bytes_per_s=25e9,
        ship_latency_s=0.005,
        restore_bytes_per_s=50e9,
        bytes_per_token=131_072,
        cache_bytes=40 * 10**9,
        step_noise=0.05,
    ),
}

# `baton bench routing`, SmolLM2, 2 replicas, 2026-11-24, a quiet machine (docs/benchmarks.md, "Routing
# policies"): whole-workload TTFT p50 and mean (s), and computed / new tokens.
MEASURED_ROUTING = {
    "baton": {"ttft_p50_s": 1.574, "ttft_mean_s": 4.29, "computed_over_new": 0.802},
    "pow2": {"ttft_p50_s": 2.216, "ttft_mean_s": 5.94, "computed_over_new": 1.099},
    "prefix-affinity": {"ttft_p50_s": 2.163, "ttft_mean_s": 4.80, "computed_over_new": 0.651},
    "round-robin": {"ttft_p50_s": 3.342, "ttft_mean_s": 6.18, "computed_over_new": 1.178},
}


def profile_with(name: str, **overrides: float | int | None) -> Profile:
    """Profile `name` with the given fields replaced (None: kept)."""
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose from {', '.join(PROFILES)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(PROFILES[name], **given)


def summarize(run: RunResult) -> dict:
    """One run's figures."""
    rows = run.records
    ttfts = np.array([r.ttft_s for r in rows])
    prompt = sum(r.prompt_tokens for r in rows)
    reused = sum(r.reused_tokens for r in rows)
    computed = sum(r.computed_tokens for r in rows)
    new = sum(r.new_tokens for r in rows)
    busy = np.array(run.busy_s)
    return {
        "requests": len(rows),
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_mean_s": float(ttfts.mean()),
        "ttft_p95_s": float(np.percentile(ttfts, 95)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "cache_hit_ratio": reused / prompt,
        "computed_over_new": computed / new if new else None,
        "load_imbalance": float(busy.max() / busy.mean()) if busy.mean() else None,
        "shipped_gb": sum(r.shipped_bytes for r in rows) / 1e9,
        "decisions": dict(run.reasons),
    }


def sim_benchmark(
    profile: Profile,
    *,
    sizes: Sequence[int] = SIZES,
    policies: Sequence[str] = POLICIES,
    workload: ClusterWorkload = ClusterWorkload(),
    progress: Progress = SILENT,
) -> dict:
    """Every policy at every size; the figures and the targets."""
    progress.start(len(sizes) * len(policies))
    results: dict[str, dict[str, dict]] = {}
    for n in sizes:
        phases = cluster_workload(workload, n, profile.prefill_tokens_per_s)
        for policy in policies:
            progress.step(f"{n} replicas: {policy}")
            started = time.perf_counter()
            figures = summarize(Cluster(profile, n, policy, workload.seed).run(phases))
            figures["wall_s"] = time.perf_counter() - started
            results.setdefault(str(n), {})[policy] = figures
    return {
        "profile": asdict(profile),
        "workload": asdict(workload),
        "sizes": results,
        "targets": targets(results),
    }


def targets(results: dict[str, dict[str, dict]]) -> dict:
    """The issue's targets at 64 replicas (when simulated, with Baton and another)."""
    at = results.get(str(TARGET_REPLICAS), {})
    others = [f["ttft_p99_s"] for p, f in at.items() if p != BATON]
    if BATON not in at or not others:
        return {}
    ratio = at[BATON]["ttft_p99_s"] / min(others)
    imbalance = at[BATON]["load_imbalance"]
    return {
        "ttft_p99_over_best_other": {
            "value": ratio,
            "target": f"<= {P99_RATIO_TARGET}",
            "met": ratio <= P99_RATIO_TARGET,
        },
        "load_imbalance": {
            "value": imbalance,
            "target": f"<= {IMBALANCE_TARGET}",
            "met": imbalance <= IMBALANCE_TARGET,
        },
    }


def validation(
    profile: Profile,
    policies: Sequence[str] = tuple(MEASURED_ROUTING),
    seeds: int = VALIDATION_SEEDS,
) -> dict:
    """`bench routing`'s workload on 2 simulated replicas, beside its measured figures: each
    figure the median over `seeds` runs (the host's noise and pow2's draws differ by seed;
    the measured run is one draw of them), with its range."""
    rows = {}
    for policy in policies:
        runs = [
            summarize(Cluster(profile, 2, policy, seed).run(routing_bench_phases()))
            for seed in range(seeds)
        ]
        simulated = {key: float(np.median([run[key] for run in runs])) for key in VALIDATED}
        simulated["requests"] = runs[0]["requests"]
        spread = {
            key: [min(run[key] for run in runs), max(run[key] for run in runs)] for key in VALIDATED
        }
        row = {"simulated": simulated, "range": spread}
        measured = MEASURED_ROUTING.get(policy)
        if measured:
            row["measured"] = measured
            row["agree"] = {
                key: abs(simulated[key] - value) <= AGREEMENT * value
                for key, value in measured.items()
            }
        rows[policy] = row
    return {"profile": asdict(profile), "seeds": seeds, "policies": rows}


# ---- text --------------------------------------------------------------------------------------


def format_report(result: dict) -> str:
    lines = [
        f"profile {result['profile']['name']}: prefill {result['profile']['prefill_tokens_per_s']:g}"
        f" tok/s, decode {result['profile']['decode_tokens_per_s']:g} tok/s for one stream and"
        f" {result['profile']['batch_decode_tokens_per_s']:g} for all"
        f" {result['profile']['slots']} slots, link {result['profile']['link_bytes_per_s'] / 1e9:g} GB/s,"
        f" step noise {result['profile']['step_noise']:g}",
        "",
        "| replicas | policy | requests | TTFT p50 s | p95 s | p99 s | cache hit | computed / new"
        " | load imbalance | shipped GB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, by_policy in result["sizes"].items():
        for policy, f in by_policy.items():
            lines.append(
                f"| {n} | {policy} | {f['requests']} | {f['ttft_p50_s']:.2f} | {f['ttft_p95_s']:.2f}"
                f" | {f['ttft_p99_s']:.2f} | {f['cache_hit_ratio']:.3f} | {f['computed_over_new']:.3f}"
                f" | {f['load_imbalance']:.2f} | {f['shipped_gb']:.1f} |"
            )
    if result["targets"]:
        lines += ["", f"targets ({TARGET_REPLICAS} replicas):"]
        for name, t in result["targets"].items():
            verdict = "met" if t["met"] else "NOT met"
            lines.append(f"  {name}: {t['value']:.3f} (target {t['target']}) {verdict}")
    return "\n".join(lines)


def format_validation(result: dict) -> str:
    lines = [
        "bench routing's workload, 2 replicas: simulated vs measured (docs/benchmarks.md, SmolLM2)",
        "| policy | TTFT p50 s sim | measured | agree | TTFT mean s sim | measured | agree"
        " | computed / new sim | measured | agree |",
        "|---|---:|---:|---|---:|---:|---|---:|---:|---|",
    ]
    for policy, row in result["policies"].items():
        sim, measured, agree = row["simulated"], row.get("measured", {}), row.get("agree", {})

        def cell(
            key: str,
            sim: dict = sim,
            measured: dict = measured,
            agree: dict = agree,
            spread: dict = row["range"],
        ) -> str:
            low, high = spread[key]
            simulated = f"{sim[key]:.3f} ({low:.2f}-{high:.2f})"
            if key not in measured:
                return f"{simulated} | – | –"
            return f"{simulated} | {measured[key]:.3f} | {'yes' if agree[key] else 'NO'}"

        cells = " | ".join(cell(key) for key in VALIDATED)
        lines.append(f"| {policy} | {cells} |")
    lines.append(
        f"(simulated: the median (range) over {result['seeds']} seeds; agree: within"
        f" {AGREEMENT:.0%}"
        " of the measured figure)"
    )
    return "\n".join(lines)
