"""`baton bench …`: the benchmark commands, registered into the `baton` command line.

`baton_serve.deploy.cli` finds this through the `baton_serve.commands` entry point, so the
command line never imports the benchmarks that import it. Benchmarks need the `bench`
extra (locust, matplotlib, httpx-sse); without it, each says how to install it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from baton_serve.deploy.config import RouterPolicy
from baton_serve.loadtests.abuse_cli import add_abuse_command
from baton_serve.loadtests.bench_common import (
    MODEL_HELP,
    positive_int,
)
from baton_serve.loadtests.bench_common import bench_progress as _progress
from baton_serve.loadtests.bench_common import needs_extra as _needs_extra
from baton_serve.loadtests.bench_common import print_report as _report
from baton_serve.loadtests.device_cli import add_device_command
from baton_serve.loadtests.emulated_cli import add_emulated_flags
from baton_serve.loadtests.gateway_cli import add_gateway_command
from baton_serve.loadtests.peer_cli import add_peer_command
from baton_serve.loadtests.restart_cli import add_restart_command
from baton_serve.loadtests.sim_cli import add_sim_command
from baton_serve.replicas.models.model_source import resolve_model


def add_bench_commands(commands: argparse._SubParsersAction) -> None:
    """Add `bench` and its benchmarks to the `baton` subcommands."""
    bench = commands.add_parser("bench", help="benchmarks that print figures")
    benches = bench.add_subparsers(required=True, metavar="BENCHMARK")
    engine = benches.add_parser("engine", help="multi-turn chat on one engine, cache on vs off")
    engine.add_argument("--model", help=MODEL_HELP)
    engine.add_argument("--turns", type=int, default=10)
    engine.add_argument("--system-tokens", type=int, default=2000)
    engine.add_argument("--turn-tokens", type=int, default=100)
    engine.add_argument("--reply-tokens", type=int, default=32)
    engine.add_argument(
        "--concurrency", type=int, default=0, help="also measure K concurrent streams"
    )
    engine.add_argument(
        "--threads", type=positive_int, help="llama.cpp threads (default: every core)"
    )
    engine.add_argument(
        "--cpu-repack",
        choices=("auto", "on", "off"),
        default="auto",
        help="weight repacking for the CPU kernels (auto: where this machine's test passed)",
    )
    engine.add_argument("--out", default="bench-out/engine", help="PNG plots go here")
    engine.add_argument("--json", action="store_true", help="print one JSON object")
    engine.set_defaults(run=_bench_engine)

    sampling = benches.add_parser(
        "sampling", help="llama.cpp's sampler chain vs the numpy sampler; grammar vs none"
    )
    sampling.add_argument("--model", help=MODEL_HELP)
    sampling.add_argument("--tokens", type=int, default=128, help="tokens decoded per run")
    sampling.add_argument("--runs", type=int, default=5)
    sampling.add_argument("--json", action="store_true", help="print one JSON object")
    sampling.set_defaults(run=_bench_sampling)

    index = benches.add_parser("index", help="index lookup latency, Redis and embedded backends")
    index.add_argument("--redis", help="redis:// URL (default: a private redis-server)")
    index.add_argument("--checkpoints", type=int, default=100_000)
    index.add_argument("--replicas", type=int, default=8)
    index.add_argument("--lookups", type=int, default=2_000)
    index.add_argument("--json", action="store_true", help="print one JSON object")
    index.set_defaults(run=_bench_index)

    ship = benches.add_parser("ship", help="pull a prefix state from a peer vs recompute it")
    ship.add_argument("--model", help=MODEL_HELP)
    ship.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 4096])
    ship.add_argument("--runs", type=positive_int, default=3, help="pulls per prefix length")
    ship.add_argument(
        "--cross-node",
        action="store_true",
        help="ship between two nodes of a local Ray cluster (each its own object store)",
    )
    ship.add_argument("--out", default="bench-out/ship", help="PNG plots go here")
    ship.add_argument("--json", action="store_true", help="print one JSON object")
    ship.set_defaults(run=_bench_ship)

    disk = benches.add_parser(
        "disk", help="restore a prefix state from the disk tier vs recompute it"
    )
    disk.add_argument("--model", help=MODEL_HELP)
    disk.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    disk.add_argument("--runs", type=int, default=3)
    disk.add_argument("--startup-gib", type=float, nargs="+", metavar="GIB", help=_STARTUP_HELP)
    disk.add_argument("--startup-dir", help="where --startup-gib writes (default: the temp dir)")
    disk.add_argument("--json", action="store_true", help="print one JSON object")
    disk.set_defaults(run=_bench_disk)

    served = benches.add_parser(
        "serve", help="routing overhead, and decode tokens/s over HTTP vs the engine"
    )
    served.add_argument("--model", help=MODEL_HELP)
    served.add_argument("--redis", help="redis:// URL (default: a private redis-server)")
    served.add_argument(
        "--router-replicas",
        type=positive_int,
        default=8,
        help="replicas each routing decision chooses among (the index's entries spread over them)",
    )
    served.add_argument("--json", action="store_true", help="print one JSON object")
    served.set_defaults(run=_bench_serve)
    routing = benches.add_parser(
        "routing", help="one seeded multi-turn workload against each routing policy"
    )
    routing.add_argument("--model", help=MODEL_HELP)
    routing.add_argument("--replicas", type=int, default=2)
    routing.add_argument(
        "--policies",
        nargs="+",
        type=RouterPolicy,
        choices=list(RouterPolicy),
        metavar="POLICY",
        help="routers to compare (default: all: baton pow2 prefix-affinity round-robin)",
    )
    routing.add_argument(
        "--index", help='a redis:// URL or "embedded" (default: a private redis-server)'
    )
    routing.add_argument(
        "--think-s",
        type=float,
        help="mean pause before each later chat turn; 0: the next turn at once (default 2.0)",
    )
    for name, what in _ROUTING_WORKLOAD_FLAGS.items():
        routing.add_argument(f"--{name}", type=int, help=what)
    routing.add_argument("--out", default="bench-out/routing", help="CSV, JSON and PNG go here")
    routing.add_argument("--json", action="store_true", help="print one JSON object")
    add_emulated_flags(routing, _bench_routing)

    add_sim_command(benches)

    soak = benches.add_parser(
        "soak", help="a mixed locust workload for N minutes: failures, TTFT and RSS over time"
    )
    soak.add_argument("--model", help=MODEL_HELP)
    soak.add_argument("--minutes", type=float, default=10.0)
    soak.add_argument("--users", type=int, default=6, help="locust users, spread over 3 classes")
    soak.add_argument("--replicas", type=int, default=2)
    soak.add_argument("--system-tokens", type=int, default=500)
    soak.add_argument("--max-tokens", type=int, default=32)
    soak.add_argument(
        "--out", default="bench-out/soak", help="locust's CSV and HTML, and PNG plots go here"
    )
    soak.add_argument("--json", action="store_true", help="print one JSON object")
    soak.set_defaults(run=_bench_soak)
    for add in (add_device_command, add_restart_command, add_peer_command, add_abuse_command):
        add(benches)
    add_gateway_command(benches)


_ROUTING_WORKLOAD_FLAGS = {  # flag → what it sets (defaults: `RoutingWorkload`)
    "sessions": "conversations in the chat scenario (default 8)",
    "turns": "turns per conversation (default 5)",
    "concurrency": "conversations at a time (default 4)",
    "system-tokens": "shared system prompt (default 1000)",
    "document-tokens": "each conversation's own document in its first message (default 800)",
    "turn-tokens": "each later user message (default 60)",
    "reply-tokens": "each reply (default 24)",
    "moved-sessions": "conversations in the moved scenario (default 2)",
    "burst-sessions": "sessions arriving at once in the burst scenario (default 4)",
    "agent-sessions": "concurrent agent loops in the agent scenario (default 4)",
    "agent-steps": "requests per agent loop (default 6)",
    "tool-tokens": "each tool result an agent appends (default 80)",
    "seed": "seed of every text (default 0)",
}


@_needs_extra
def _bench_engine(args: argparse.Namespace) -> int:
    from baton_serve.loadtests.engine_bench import engine_benchmark, format_report
    from baton_serve.loadtests.plots import engine_plots

    with _progress(args, "engine") as progress:
        result = engine_benchmark(
            resolve_model(args.model),
            turns=args.turns,
            system_tokens=args.system_tokens,
            turn_tokens=args.turn_tokens,
            reply_tokens=args.reply_tokens,
            concurrency=args.concurrency,
            cpu_repack={"auto": None, "on": True, "off": False}[args.cpu_repack],
            **({"threads": args.threads} if args.threads else {}),
            progress=progress,
        )
        progress.step("plotting")
        written = engine_plots(result, Path(args.out))
    _report(args, result, format_report(result), written)
    return 0


def _bench_sampling(args: argparse.Namespace) -> int:
    from baton_serve.loadtests.sampling_bench import format_report, sampling_benchmark

    with _progress(args, "sampling") as progress:
        result = sampling_benchmark(
            resolve_model(args.model), tokens=args.tokens, runs=args.runs, progress=progress
        )
    _report(args, result, format_report(result), [])
    return 0


@_needs_extra
def _bench_index(args: argparse.Namespace) -> int:
    from baton_serve.loadtests.index_bench import format_report, index_benchmark

    with _progress(args, "index") as progress:
        result = index_benchmark(
            args.redis,
            checkpoints=args.checkpoints,
            replicas=args.replicas,
            lookups=args.lookups,
            progress=progress,
        )
    _report(args, result, format_report(result), [])
    return 0


@_needs_extra
def _bench_ship(args: argparse.Namespace) -> int:
    from baton_serve.loadtests.plots import ship_plots
    from baton_serve.loadtests.ship_bench import format_report, ship_benchmark

    with _progress(args, "ship") as progress:
        result = ship_benchmark(
            resolve_model(args.model),
            args.tokens,
            progress,
            runs=args.runs,
            cross_node=args.cross_node,
        )
        progress.step("plotting")
        written = ship_plots(result, Path(args.out))
    _report(args, result, format_report(result), written)
    return 0


_STARTUP_HELP = "instead: a disk tier's start-up time on this many GiB of files, e.g. 1 16"


def _bench_disk(args: argparse.Namespace) -> int:
    from baton_serve.loadtests.disk_bench import disk_benchmark, format_report

    if args.startup_gib:
        from baton_serve.loadtests.disk_startup_bench import run_startup_bench

        return run_startup_bench(args)
    with _progress(args, "disk") as progress:
        result = disk_benchmark(resolve_model(args.model), args.tokens, args.runs, progress)
    _report(args, result, format_report(result), [])
    return 0


@_needs_extra
def _bench_serve(args: argparse.Namespace) -> int:
    from baton_serve.loadtests.serve_bench import format_report, serve_benchmark

    with _progress(args, "serve") as progress:
        result = serve_benchmark(
            resolve_model(args.model), args.redis, progress, router_replicas=args.router_replicas
        )
    _report(args, result, format_report(result), [])
    return 0


@_needs_extra
def _bench_routing(args: argparse.Namespace) -> int:
    from baton_serve.loadtests.routing_bench import POLICIES, routing_benchmark
    from baton_serve.loadtests.routing_report import format_report, write_outputs
    from baton_serve.loadtests.routing_workload import RoutingWorkload

    fields = [name.replace("-", "_") for name in _ROUTING_WORKLOAD_FLAGS] + ["think_s"]
    given = {field: getattr(args, field) for field in fields if getattr(args, field) is not None}
    with _progress(args, "routing") as progress:
        result, records = routing_benchmark(
            resolve_model(args.model),
            workload=RoutingWorkload(**given),
            policies=args.policies or POLICIES,
            replicas=args.replicas,
            index=args.index,
            progress=progress,
        )
        written = write_outputs(result, records, Path(args.out))
    _report(args, result, format_report(result), written)
    return 0


@_needs_extra
def _bench_soak(args: argparse.Namespace) -> int:
    from baton_serve.loadtests.soak_bench import format_report, soak_benchmark

    with _progress(args, "soak") as progress:
        result = soak_benchmark(
            resolve_model(args.model),
            minutes=args.minutes,
            out_dir=Path(args.out),
            users=args.users,
            replicas=args.replicas,
            system_tokens=args.system_tokens,
            max_tokens=args.max_tokens,
            progress=progress,
        )
    _report(args, result, format_report(result), [])
    return 0
