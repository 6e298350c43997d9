"""`baton bench gateway`: its flags, registered into `baton bench` (the run: `gateway_rate`),
its table and its latency-against-rate plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from baton_serve.loadtests.bench_common import (
    MODEL_HELP,
    bench_progress,
    needs_extra,
    non_negative_float,
    number_list,
    positive_float,
    positive_int,
    print_report,
)
from baton_serve.replicas.models.model_source import resolve_model


def add_gateway_command(benches: argparse._SubParsersAction) -> None:
    """Add `gateway` to the `baton bench` benchmarks."""
    gateway = benches.add_parser(
        "gateway",
        help="the request rate one gateway replica sustains with instant engines "
        "(added latency p99 within 10 ms)",
    )
    gateway.add_argument("--model", help=MODEL_HELP + "; only its vocabulary is used")
    gateway.add_argument(
        "--replicas", type=positive_int, default=2, help="emulated replicas (default 2)"
    )
    gateway.add_argument(
        "--rates",
        type=number_list(float),
        help="offered rates in req/s, comma-separated (default 10,20,40,…,1280; the ramp "
        "stops after two steps past 50 ms p99, or one that answered under 95%% of what it sent)",
    )
    gateway.add_argument("--step-s", type=positive_float, default=10.0, help="seconds a rate")
    gateway.add_argument("--prompt-tokens", type=positive_int, default=32)
    gateway.add_argument("--seed", type=int, default=0)
    gateway.add_argument(
        "--breakdown-rate",
        type=non_negative_float,
        default=5.0,
        help="req/s of the traced run that cuts the latency into its parts (0: none)",
    )
    gateway.add_argument(
        "--breakdown-s", type=positive_float, default=10.0, help="seconds of the traced run"
    )
    gateway.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip the same ramp against Ray Serve's floor (a FastAPI ingress and one handle "
        "call, no Baton code)",
    )
    gateway.add_argument("--out", default="bench-out/gateway", help="JSON and PNG go here")
    gateway.add_argument("--json", action="store_true", help="print one JSON object")
    gateway.set_defaults(run=_bench_gateway)


@needs_extra
def _bench_gateway(args: argparse.Namespace) -> int:
    from baton_serve.loadtests.gateway_rate import GatewayRateSettings, gateway_rate_benchmark

    settings = GatewayRateSettings(
        replicas=args.replicas,
        step_s=args.step_s,
        prompt_tokens=args.prompt_tokens,
        seed=args.seed,
        breakdown_rate=args.breakdown_rate,
        breakdown_s=args.breakdown_s,
        floor=args.floor,
        **({"rates": args.rates} if args.rates else {}),
    )
    with bench_progress(args, "gateway") as progress:
        result = gateway_rate_benchmark(str(resolve_model(args.model)), settings, progress=progress)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "gateway.json"]
    written[0].write_text(json.dumps(result, indent=2) + "\n")
    written.append(latency_plot(result, out / "gateway_latency.png"))
    print_report(args, result, format_report(result), written)
    return 0


def format_report(result: dict) -> str:
    """One row a step, the sustained rates, the same for Ray Serve's floor with Baton's own
    part beside it, and the low-rate breakdown."""
    s = result["settings"]
    lines = [
        f"bench gateway: 1 gateway replica, {s['replicas']} {result['engine']} replicas, "
        f"{s['prompt_tokens']}-token prompts, max_tokens 1, streamed; {s['step_s']:g} s a "
        f"step, {result['cpu_count']} CPUs, load average {result['load_average'][0]:.1f}",
        "added latency = the client's time to first token (ms); CPU in cores: generator "
        "(this process) / proxy / gateway / replicas",
        *_step_rows(result["steps"]),
        *_sustained_lines(result["sustained_per_s"], ""),
    ]
    if floor := result.get("floor"):
        lines += [
            f"{floor['app']}; the same load on a fresh Ray (gateway: its ingress, replicas: "
            "its engines):",
            *_step_rows(floor["steps"]),
            *_sustained_lines(floor["sustained_per_s"], " (floor)"),
            "Baton's own part (Baton - floor), ms:",
            *_own_part(result["steps"], floor["steps"]),
        ]
    if breakdown := result.get("breakdown"):
        ttft = breakdown["ttft_ms"]
        lines.append(
            f"where the time goes at {breakdown['rate_per_s']:g} req/s ({breakdown['traced']} "
            f"of {breakdown['requests']} traced; TTFT p50 {_ms(ttft['p50'])} p99 "
            f"{_ms(ttft['p99'])} ms, tracing on):"
        )
        for part, q in breakdown["parts_ms"].items():
            lines.append(f"  {part:<16} p50 {_ms(q['p50']):>7} ms   p99 {_ms(q['p99']):>7} ms")
    return "\n".join(lines)


def _step_rows(steps: list[dict]) -> list[str]:
    rows = [
        f"{'offered':>8}{'achieved':>9}{'err':>5}{'p50':>8}{'p95':>8}{'p99':>8}"
        f"{'total p99':>10}{'send lag p99':>13}  cpu gen/proxy/gw/repl"
    ]
    for step in steps:
        ttft, cpu = step["ttft_ms"], step["cpu_cores"]
        cores = "/".join(
            f"{cpu.get(k, 0):.2f}" for k in ("generator", "proxy", "gateway", "replicas")
        )
        rows.append(
            f"{step['offered_per_s']:>8g}{step['achieved_per_s']:>9.1f}{step['errors']:>5}"
            f"{_ms(ttft.get('p50')):>8}{_ms(ttft.get('p95')):>8}{_ms(ttft.get('p99')):>8}"
            f"{_ms(step['total_ms'].get('p99')):>10}"
            f"{_ms(step['send_lag_ms'].get('p99')):>13}  {cores}"
        )
    return rows


def _sustained_lines(sustained: dict[str, float | None], label: str) -> list[str]:
    from baton_serve.loadtests.gateway_rate import LIMITS_MS

    lines = []
    for limit, (name, rate) in zip(LIMITS_MS, sustained.items(), strict=True):
        found = f"{rate:g} req/s" if rate is not None else "not met at any rate tried"
        lines.append(f"sustained rate{label}, added latency p99 <= {limit:g} ms: {found} ({name})")
    return lines


def _own_part(steps: list[dict], floor_steps: list[dict]) -> list[str]:
    """Per rate both ramps reached: Baton's p50/p95/p99 less the floor's."""
    floor_by_rate = {s["offered_per_s"]: s["ttft_ms"] for s in floor_steps}
    lines = []
    for step in steps:
        floor = floor_by_rate.get(step["offered_per_s"])
        if floor is None:
            continue
        parts = [
            f"{q} {step['ttft_ms'][q] - floor[q]:+.2f}"
            for q in ("p50", "p95", "p99")
            if q in step["ttft_ms"] and q in floor
        ]
        lines.append(f"{step['offered_per_s']:>8g} req/s  " + "  ".join(parts))
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def latency_plot(result: dict, path: Path) -> Path:
    """Added latency p50/p95/p99 against the offered rate, with the limits drawn."""
    from baton_serve.loadtests.gateway_rate import LIMITS_MS
    from baton_serve.loadtests.plots import figure

    steps = result["steps"]
    rates = [s["offered_per_s"] for s in steps]
    title = f"One gateway replica, {result['settings']['replicas']} instant replicas"
    with figure(path, title) as (ax,):
        for q, style in (("p50", "o-"), ("p95", "s-"), ("p99", "^-")):
            ax.plot(rates, [s["ttft_ms"].get(q) for s in steps], style, label=f"Baton {q}")
        if floor := result.get("floor"):
            floor_rates = [s["offered_per_s"] for s in floor["steps"]]
            for q, style in (("p50", "o:"), ("p99", "^:")):
                values = [s["ttft_ms"].get(q) for s in floor["steps"]]
                ax.plot(floor_rates, values, style, label=f"Ray Serve floor {q}")
        for limit in LIMITS_MS:
            ax.axhline(limit, color="grey", linestyle="--", linewidth=1, label=f"{limit:g} ms")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("added latency (ms)")
    return path
