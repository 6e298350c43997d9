"""`baton bench routing`'s `--engine emulated` flags (the benchmark: `emulated_routing`):
`bench sim`'s cluster workload through the real system on emulated replicas."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from baton_serve.deploy.config import RouterPolicy
from baton_serve.loadtests.bench_common import bench_progress, factor, positive_int, print_report
from baton_serve.replicas.models.model_source import resolve_model

Run = Callable[[argparse.Namespace], int]


def add_emulated_flags(routing: argparse.ArgumentParser, llama_run: Run) -> None:
    """Add `--engine`, `--profile` and the cluster workload's size to `bench routing`;
    `llama_run` runs it as before, on llama.cpp replicas."""
    routing.add_argument(
        "--engine",
        choices=("llama", "emulated"),
        default="llama",
        help="emulated: bench sim's cluster workload on replicas whose compute is the "
        "profile's time (every other part real), beside the simulator on the same workload",
    )
    routing.add_argument(
        "--profile", choices=("cpu", "gpu"), default="cpu", help="--engine emulated: the timing"
    )
    routing.add_argument(
        "--sessions-per-replica",
        type=positive_int,
        help="--engine emulated: sessions per replica (default 12, as bench sim)",
    )
    routing.add_argument(
        "--slowdown",
        type=factor,
        default=1.0,
        help="--engine emulated: run the cluster on a clock this many times slower (compute, "
        "link, pauses, arrivals; TTFTs reported divided by it), for more replicas than the "
        "machine's cores keep up with (Ray's own work then weighs this many times less)",
    )

    def run(args: argparse.Namespace) -> int:
        return _emulated(args) if args.engine == "emulated" else llama_run(args)

    routing.set_defaults(run=run)


def _emulated(args: argparse.Namespace) -> int:
    from baton_serve.loadtests.emulated_routing import (
        emulated_routing_benchmark,
        format_report,
        scaled,
    )
    from baton_serve.loadtests.plots import emulated_plots
    from baton_serve.loadtests.sim_bench import PROFILES
    from baton_serve.loadtests.sim_workload import ClusterWorkload

    workload = scaled(ClusterWorkload(), sessions_per_replica=args.sessions_per_replica)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"emulated-{args.replicas}.json"
    with bench_progress(args, "routing") as progress:
        result = emulated_routing_benchmark(
            str(resolve_model(args.model)),
            replicas=args.replicas,
            profile=PROFILES[args.profile],
            policies=args.policies or tuple(RouterPolicy),
            workload=workload,
            index=args.index,
            progress=progress,
            # Written again after each policy: a crash later loses none finished.
            save=lambda so_far: path.write_text(json.dumps(so_far, indent=1)),
            slowdown=args.slowdown,
        )
    path.write_text(json.dumps(result, indent=1))
    print_report(args, result, format_report(result), [path, *emulated_plots(result, out)])
    return 0
