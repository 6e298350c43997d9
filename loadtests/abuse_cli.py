"""`baton bench abuse`'s command line (the benchmark: `loadtests/abuse_bench.py`)."""

from __future__ import annotations

import argparse
import contextlib

from baton_serve.loadtests.bench_common import (
    MODEL_HELP,
    bench_progress,
    needs_extra,
    positive_float,
    positive_int,
    print_report,
)
from baton_serve.replicas.models.model_source import resolve_model


def add_abuse_command(benches: argparse._SubParsersAction) -> None:
    """Add `abuse` to the `baton bench` subcommands."""
    abuse = benches.add_parser(
        "abuse", help="abusive bodies against a live server; a normal request's latency beside"
    )
    abuse.add_argument("--model", help=MODEL_HELP + "; not with --url")
    abuse.add_argument("--url", help="a running server (default: start a local one)")
    abuse.add_argument("--api-key", help="the --url server's API key")
    abuse.add_argument("--seconds", type=positive_float, default=5.0, help="per abusive body")
    abuse.add_argument("--abusers", type=positive_int, default=2, help="abusive clients at once")
    abuse.add_argument("--json", action="store_true", help="print one JSON object")
    abuse.set_defaults(run=_bench_abuse)


@needs_extra
def _bench_abuse(args: argparse.Namespace) -> int:
    from baton_serve.loadtests.abuse_bench import (
        abuse_benchmark,
        format_report,
        local_server,
        served_model,
    )

    if args.url and args.model:
        raise ValueError("--model starts a local server; --url targets a running one: not both")
    with bench_progress(args, "abuse") as progress, contextlib.ExitStack() as stack:
        if args.url:
            url, name = args.url, served_model(args.url, args.api_key)
        else:
            url, name = stack.enter_context(local_server(resolve_model(args.model), progress))
        result = abuse_benchmark(
            url,
            name,
            api_key=args.api_key,
            seconds=args.seconds,
            abusers=args.abusers,
            progress=progress,
        )
    print_report(args, result, format_report(result), [])
    return 0
