"""`baton bench device`: its flags, registered into `baton bench` (the run: `device_bench`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from baton_serve.loadtests.bench_common import (
    MODEL_HELP,
    bench_progress,
    number_list,
    positive_int,
    print_report,
)
from baton_serve.loadtests.peer_cli import add_workload_flags, workload_from
from baton_serve.replicas.models.model_source import resolve_model


def add_device_command(benches: argparse._SubParsersAction) -> None:
    """Add `device` to the `baton bench` benchmarks."""
    device = benches.add_parser(
        "device", help="GPU figures in one process: prefill, decode, save/restore, ship, TTFT"
    )
    device.add_argument("--model", help=MODEL_HELP)
    device.add_argument("--n-gpu-layers", type=int, default=-1, help="-1: every layer")
    device.add_argument(
        "--contexts",
        type=number_list(int),
        default=(2048, 8192),
        help="prompt lengths, comma-separated (default 2048,8192)",
    )
    device.add_argument("--repeats", type=positive_int, default=5, help="runs per context")
    device.add_argument(
        "--n-ctx", type=positive_int, help="engine context (default: the longest context)"
    )
    device.add_argument(
        "--prefill-chunk", type=positive_int, default=256, help="prompt tokens per step"
    )
    device.add_argument(
        "--threads", type=positive_int, help="llama.cpp threads (default: every core)"
    )
    device.add_argument(
        "--streams",
        type=number_list(int),
        help="counts of streams decoding together, each timed, comma-separated (default 1,4)",
    )
    device.add_argument(
        "--peer",
        action="store_true",
        help="also run llama.cpp's llama-batched-bench on the same model and device, and "
        "llama-server against the engine on bench peer's multi-turn workload (its flags below)",
    )
    add_workload_flags(device.add_argument_group("--peer's multi-turn workload"), images=False)
    device.add_argument("--out", help="also write the JSON object to OUT/device.json")
    device.add_argument("--json", action="store_true", help="print one JSON object")
    device.set_defaults(run=_bench_device)


def _bench_device(args: argparse.Namespace) -> int:
    from baton_serve.loadtests.device_bench import DeviceSettings, device_benchmark
    from baton_serve.loadtests.device_report import format_report

    settings = DeviceSettings(
        model=resolve_model(args.model),
        contexts=args.contexts,
        n_gpu_layers=args.n_gpu_layers,
        repeats=args.repeats,
        n_ctx=args.n_ctx,
        prefill_chunk=args.prefill_chunk,
        peer=args.peer,
        chat=workload_from(args),
        **({"streams": args.streams} if args.streams else {}),
        **({"threads": args.threads} if args.threads else {}),
    )
    with bench_progress(args, "device") as progress:
        result = device_benchmark(settings, progress)
    written = []
    if args.out:
        written.append(Path(args.out) / "device.json")
        written[0].parent.mkdir(parents=True, exist_ok=True)
        written[0].write_text(json.dumps(result, indent=2) + "\n")
    print_report(args, result, format_report(result), written)
    return 0
