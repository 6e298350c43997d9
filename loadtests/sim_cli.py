"""`baton bench sim`: its flags, registered into `baton bench`."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from baton_serve.loadtests.bench_common import (
    bench_progress,
    needs_extra,
    non_negative_float,
    positive_float,
    positive_int,
    print_report,
)

_SIM_PROFILE_FLAGS = {  # flag -> what it overrides in the profile
    "prefill-tok-s": "prompt tokens per second a replica computes",
    "decode-tok-s": "tokens per second one stream decodes alone",
    "batch-decode-tok-s": "tokens per second all slots decode together",
    "link-gb-s": "GB/s a state moves between replicas",
    "restore-gb-s": "GB/s a pulled state is restored",
    "ship-latency-s": "fixed cost of one pull (s)",
    "bytes-per-token": "state bytes per token of context",
    "cache-gb": "each replica's checkpoint budget (GB)",
    "step-noise": "sigma of the lognormal noise on each step's time (0: none)",
}
_MAY_BE_ZERO = {"ship-latency-s", "cache-gb", "step-noise"}  # the others are speeds and sizes


def add_sim_command(benches: argparse._SubParsersAction) -> None:
    """Add `sim` to the `baton bench` benchmarks."""
    sim = benches.add_parser(
        "sim", help="routing policies on simulated clusters of 4-256 replicas (no model, no Ray)"
    )
    sim.add_argument("--profile", choices=("cpu", "gpu"), default="cpu")
    sim.add_argument("--replicas", type=int, nargs="+", help="cluster sizes (default 4 16 64 256)")
    sim.add_argument(
        "--policies",
        nargs="+",
        metavar="POLICY",
        help="baton pow2 prefix-affinity chwbl round-robin (default: all)",
    )
    for name, what in _SIM_PROFILE_FLAGS.items():
        kind = non_negative_float if name in _MAY_BE_ZERO else positive_float
        sim.add_argument(f"--{name}", type=kind, help=what)
    sim.add_argument("--slots", type=positive_int, help="requests a replica runs at once")
    sim.add_argument("--prefill-chunk", type=positive_int, help="prompt tokens of one prefill step")
    sim.add_argument(
        "--step-tokens",
        type=positive_int,
        help="tokens of one step: decoding streams' rows plus prompt pieces (the engine's "
        "step_tokens)",
    )
    sim.add_argument("--sessions-per-replica", type=int, help="sessions per replica (default 12)")
    sim.add_argument(
        "--load", type=float, help="ideal prefill work over prefill capacity (default 0.7)"
    )
    sim.add_argument("--seed", type=int, help="seed of the workload and the draws (default 0)")
    sim.add_argument(
        "--validate",
        action="store_true",
        help="simulate bench routing's workload on 2 replicas; compare with its measurements",
    )
    sim.add_argument("--out", default="bench-out/sim", help="PNG plots go here")
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.set_defaults(run=_bench_sim)


@needs_extra
def _bench_sim(args: argparse.Namespace) -> int:
    from baton_serve.loadtests.plots import sim_plots
    from baton_serve.loadtests.sim_bench import (
        SIZES,
        format_report,
        format_validation,
        profile_with,
        sim_benchmark,
        validation,
    )
    from baton_serve.loadtests.sim_policies import POLICIES
    from baton_serve.loadtests.sim_workload import ClusterWorkload

    def scaled(value: float | None, factor: float) -> float | None:
        return None if value is None else value * factor

    profile = profile_with(
        args.profile,
        prefill_tokens_per_s=args.prefill_tok_s,
        decode_tokens_per_s=args.decode_tok_s,
        batch_decode_tokens_per_s=args.batch_decode_tok_s,
        link_bytes_per_s=scaled(args.link_gb_s, 1e9),
        restore_bytes_per_s=scaled(args.restore_gb_s, 1e9),
        ship_latency_s=args.ship_latency_s,
        bytes_per_token=None if args.bytes_per_token is None else int(args.bytes_per_token),
        cache_bytes=None if args.cache_gb is None else int(args.cache_gb * 1e9),
        slots=args.slots,
        prefill_chunk=args.prefill_chunk,
        step_tokens=args.step_tokens,
        step_noise=args.step_noise,
    )
    policies = args.policies or list(POLICIES)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    if args.validate:
        ignored = [
            flag
            for flag, value in (
                ("--replicas", args.replicas),
                ("--sessions-per-replica", args.sessions_per_replica),
                ("--load", args.load),
                ("--seed", args.seed),  # it takes the median over seeds 0-8
            )
            if value is not None
        ]
        if ignored:
            raise ValueError(
                f"--validate runs bench routing's workload on 2 replicas: drop {ignored}"
            )
        if args.policies and "chwbl" in args.policies:
            raise ValueError("--validate: bench routing measured no chwbl run to compare with")
        result = validation(profile, [p for p in policies if p != "chwbl"])
        print_report(args, result, format_validation(result), [])
        return 0
    workload = ClusterWorkload(seed=args.seed or 0)
    given = {"sessions_per_replica": args.sessions_per_replica, "load": args.load}
    workload = replace(workload, **{k: v for k, v in given.items() if v is not None})
    with bench_progress(args, "sim") as progress:
        result = sim_benchmark(
            profile,
            sizes=args.replicas or SIZES,
            policies=policies,
            workload=workload,
            progress=progress,
        )
        progress.step("plotting")
        written = sim_plots(result, Path(args.out))
    print_report(args, result, format_report(result), written)
    return 0
