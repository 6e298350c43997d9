"""`baton bench restart`'s command line (the benchmark: `loadtests/restart_bench.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from baton_serve.loadtests.bench_common import (
    MODEL_HELP,
    bench_progress,
    needs_extra,
    print_report,
)
from baton_serve.replicas.models.model_source import resolve_model


def add_restart_command(benches: argparse._SubParsersAction) -> None:
    """Add `restart` to the `baton bench` subcommands."""
    restart = benches.add_parser(
        "restart",
        help="a rolling restart and a downscale under a locust multi-turn load: failures,"
        " follow-ups' cached share before and after",
    )
    restart.add_argument("--model", help=MODEL_HELP)
    restart.add_argument(
        "--event",
        choices=("rolling", "downscale", "both"),
        default="both",
        help="both: a rolling restart, then (a minute later) a downscale",
    )
    restart.add_argument("--replicas", type=int, default=3)
    restart.add_argument("--users", type=int, default=6, help="locust MultiTurnChatUser users")
    restart.add_argument("--chat-turns", type=int, default=24, help="turns of a chat session")
    restart.add_argument("--system-tokens", type=int, default=500)
    restart.add_argument("--max-tokens", type=int, default=16)
    restart.add_argument("--warmup-s", type=float, default=90.0, help="load before the first event")
    restart.add_argument(
        "--handoff-s",
        type=float,
        help="seconds a leaving replica may hand its checkpoints off (0: off; default: the config's)",
    )
    restart.add_argument(
        "--surge-percent",
        type=int,
        default=0,
        help="rollout_surge_percent: replacements that start before old replicas stop",
    )
    restart.add_argument("--out", default="bench-out/restart", help="locust's files go here")
    restart.add_argument("--json", action="store_true", help="print one JSON object")
    restart.set_defaults(run=_bench_restart)


@needs_extra
def _bench_restart(args: argparse.Namespace) -> int:
    from baton_serve.loadtests.restart_bench import EVENTS, restart_benchmark
    from baton_serve.loadtests.restart_figures import format_report

    with bench_progress(args, "restart") as progress:
        result = restart_benchmark(
            resolve_model(args.model),
            out_dir=Path(args.out),
            events=EVENTS if args.event == "both" else (args.event,),
            users=args.users,
            replicas=args.replicas,
            system_tokens=args.system_tokens,
            max_tokens=args.max_tokens,
            chat_turns=args.chat_turns,
            warmup_s=args.warmup_s,
            handoff_s=args.handoff_s,
            surge_percent=args.surge_percent,
            progress=progress,
        )
    print_report(args, result, format_report(result), [Path(p) for p in result["reports"]])
    return 0
