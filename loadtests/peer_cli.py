"""`baton bench peer`: its flags, registered into `baton bench`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from baton_serve.loadtests.bench_common import (
    MODEL_HELP,
    bench_progress,
    needs_extra,
    positive_int,
    print_report,
)
from baton_serve.replicas.models.model_source import resolve_model, resolve_projector

if TYPE_CHECKING:
    from baton_serve.loadtests.peer_workload import PeerWorkload

_WORKLOAD_FLAGS = {  # flag → what it sets (defaults: `PeerWorkload`)
    "chat-sessions": "chat conversations (default 6)",
    "chat-turns": "turns per conversation (default 4)",
    "agent-sessions": "agent loops (default 4)",
    "agent-steps": "requests per agent loop (default 5)",
    "concurrency": "sessions at a time (default 2)",
    "system-tokens": "the shared system prompt (default 600)",
    "document-tokens": "each conversation's own document (default 400)",
    "turn-tokens": "each later question, and each agent's task (default 60)",
    "tool-tokens": "each tool result an agent appends (default 150)",
    "reply-tokens": "each reply, generated to the end (ignore_eos) (default 32)",
    "image-px": "each conversation opens with a random-pixel image this many pixels a side "
    "(default 0: none; needs --mmproj)",
    "seed": "seed of every text (default 0)",
}


def add_peer_command(benches: argparse._SubParsersAction) -> None:
    """Add `peer` to the `baton bench` benchmarks."""
    peer = benches.add_parser(
        "peer", help="Baton vs llama-server (same llama.cpp) on one node, one seeded workload"
    )
    peer.add_argument("--model", help=MODEL_HELP)
    peer.add_argument(
        "--mmproj", help="the model's image projector, for both sides (a path, hf://, tiny:ARCH)"
    )
    peer.add_argument(
        "--threads",
        type=positive_int,
        help="threads in total (default: the cores baton serve shares out)",
    )
    peer.add_argument("--slots", type=positive_int, help="slots in total (default: concurrency)")
    peer.add_argument(
        "--replicas", type=positive_int, help="Baton replicas (default: baton serve's, 2)"
    )
    peer.add_argument(
        "--no-exact-reuse",
        action="store_true",
        help="Baton's engines keep the states their decode built, as llama-server does, "
        "instead of replaying each reply (engine.exact_reuse false)",
    )
    peer.add_argument(
        "--flash-attn",
        action="store_true",
        help="both sides compute attention with flash attention (Baton's engine.flash_attn, "
        "llama-server's -fa on); without it both run -fa off, Baton's default",
    )
    add_workload_flags(peer)
    peer.add_argument(
        "--no-breakdown",
        action="store_true",
        help="skip the traced Baton run that measures where the time goes",
    )
    peer.add_argument("--out", default="bench-out/peer", help="JSON, CSV and PNG go here")
    peer.add_argument("--json", action="store_true", help="print one JSON object")
    peer.set_defaults(run=_bench_peer)


def add_workload_flags(parser: argparse.ArgumentParser, *, images: bool = True) -> None:
    """`bench peer`'s workload flags (`PeerWorkload`'s fields); `images`: `--image-px` too."""
    for name, what in _WORKLOAD_FLAGS.items():
        if name == "image-px" and not images:
            continue
        kind = (
            int if name in ("seed", "chat-sessions", "agent-sessions", "image-px") else positive_int
        )
        parser.add_argument(f"--{name}", type=kind, help=what)


def workload_from(args: argparse.Namespace) -> PeerWorkload:
    """The `PeerWorkload` the workload flags given describe (the rest its defaults)."""
    from baton_serve.loadtests.peer_workload import PeerWorkload

    fields = [name.replace("-", "_") for name in _WORKLOAD_FLAGS]
    given = {
        field: getattr(args, field) for field in fields if getattr(args, field, None) is not None
    }
    return PeerWorkload(**given)


@needs_extra
def _bench_peer(args: argparse.Namespace) -> int:
    from baton_serve.loadtests.peer_bench import peer_benchmark
    from baton_serve.loadtests.peer_report import format_report, write_outputs

    model = resolve_model(args.model)
    mmproj = resolve_projector(args.mmproj, model) if args.mmproj else None
    with bench_progress(args, "peer") as progress:
        result, records = peer_benchmark(
            model,
            mmproj=mmproj,
            workload=workload_from(args),
            threads=args.threads,
            slots=args.slots,
            replicas=args.replicas,
            exact_reuse=not args.no_exact_reuse,
            flash_attn=args.flash_attn,
            traced=not args.no_breakdown,
            progress=progress,
        )
        written = write_outputs(result, records, Path(args.out))
    print_report(args, result, format_report(result), written)
    return 0
