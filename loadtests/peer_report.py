"""`baton bench peer`'s report: the side-by-side table, the time breakdown, and its files
(the summary as JSON, every request as CSV, TTFT and inter-token latency CDFs as a PNG)."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from baton_serve.loadtests.peer_play import BATON, LLAMA_SERVER, PeerRecord, comparison_lines
from baton_serve.loadtests.plots import figure
from baton_serve.loadtests.span_breakdown import TTFT_PARTS

PART_LABELS = {
    "proxy": "proxy (client -> HAProxy -> gateway)",
    "gateway": "gateway (auth, tokenise, hash)",
    "router": "router (index lookup, choice)",
    "to_replica": "gateway -> replica (Serve call, gRPC)",
    "replica": "replica before the engine (pull, hand-over)",
    "queue": "engine queue (waiting for a slot)",
    "restore": "restore (cached prefix into the slot)",
    "prefill": "prefill (prompt computed, first token)",
    "first_token_out": "first token out (engine -> client)",
}


def format_report(result: dict) -> str:
    setup, engine = result["setup"], result["engine"]
    peer, baton = result[LLAMA_SERVER], result[BATON]
    lines = [
        f"peer: {Path(result['model']).name}, {result['workload']['concurrency']} streams,"
        + _images(result["workload"])
        + f" {peer['requests']} requests each (seed {result['workload']['seed']},"
        f" script {result['script']})",
        f"  llama-server: -t {setup['threads']} -np {setup['slots']} --jinja"
        f" -fa {'on' if setup.get('flash_attn') else 'off'}",
        f"  baton: {setup['replicas']} replicas x {engine['n_threads']} thread(s)"
        + (
            f" (prompts on up to {engine['node_cores']} idle cores)"
            if engine.get("node_cores")
            else ""
        )
        + f" x {engine['n_slots']} slot(s)"
        + ("" if engine.get("exact_reuse", True) else ", exact_reuse off (no replays)")
        + (", flash attention on" if engine.get("flash_attn") else ""),
        "",
        *comparison_lines(result["rows"]),
    ]
    for side, summary in ((LLAMA_SERVER, peer), (BATON, baton)):
        lines.append(
            f"  {side}: {summary['prompt_tokens']} prompt tokens, {summary['cached_tokens']}"
            f" cached, {summary['completion_tokens']} generated, {summary['errors']} errors,"
            f" {summary['wall_s']:.1f} s"
        )
    lines += format_follow_ups(result)
    if "breakdown" in result:
        lines += ["", *format_breakdown(result["breakdown"], baton)]
    return "\n".join(lines)


FOLLOW_UP_TTFT = 0.3  # images: a follow-up's TTFT p50 at most this share of a cold turn's
FOLLOW_UP_CACHED = 0.9  # images: at least this share of follow-ups' prompt tokens cached


def format_follow_ups(result: dict) -> list[str]:
    """Cold turns against follow-ups, each side (with images, against #48's targets)."""
    images = bool(result["workload"].get("image_px"))
    lines = ["", "cold first turns vs follow-up turns (TTFT p50; prompt tokens cached):"]
    for side in (LLAMA_SERVER, BATON):
        summary = result[side]
        cold, follow = summary["cold_ttft_s"]["p50"], summary["follow_up_ttft_s"]["p50"]
        cached = summary["follow_up_cached"]
        if cold is None or follow is None or cached is None:
            continue
        ratio = follow / cold
        line = (
            f"  {side:<13}{cold * 1000:8.0f} ms -> {follow * 1000:6.0f} ms ({ratio:.2f}x),"
            f" {cached:.0%} cached"
        )
        if images:
            met = ratio <= FOLLOW_UP_TTFT and cached >= FOLLOW_UP_CACHED
            line += f"  target <= {FOLLOW_UP_TTFT}x, >= {FOLLOW_UP_CACHED:.0%}: "
            line += "met" if met else "NOT met"
        lines.append(line)
    return lines


def _images(workload: dict) -> str:
    px = workload.get("image_px")
    return f" chats opening with a {px}x{px} image," if px else ""


def format_breakdown(breakdown: dict, baton: dict) -> list[str]:
    p50 = breakdown["p50_s"]
    lines = [
        f"where Baton's time goes (p50 over {breakdown['requests']} traced requests, a separate"
        " run with tracing on):"
    ]
    for name in TTFT_PARTS:
        if name in p50:
            lines.append(f"  {PART_LABELS[name]:<46}{p50[name] * 1000:8.1f} ms")
    if "decode_step" in p50:
        itl = baton["itl_s"]["p50"]
        lines.append(
            f"  {'engine decode step (decode / tokens)':<46}{p50['decode_step'] * 1000:8.1f} ms"
        )
        if itl is not None:
            lines.append(f"  {'inter-token latency at the client (p50)':<46}{itl * 1000:8.1f} ms")
    return lines


def _cdf_plot(records: list[PeerRecord], path: Path, title: str) -> None:
    with figure(path, title, panels=2) as (ttft, itl):
        for side in (LLAMA_SERVER, BATON):
            rows = [r for r in records if r.server == side and r.ttft_s is not None]
            for ax, values in (
                (ttft, sorted(r.ttft_s for r in rows)),
                (itl, sorted(g * 1000 for r in rows for g in r.gaps_s)),
            ):
                if values:
                    ax.plot(values, np.linspace(0, 1, len(values)), label=side)
        ttft.set(xlabel="time to first token (s)", ylabel="share of requests", title="TTFT")
        itl.set(xlabel="inter-token latency (ms)", ylabel="share of gaps", title="ITL")


def write_outputs(result: dict, records: list[PeerRecord], out_dir: Path) -> list[Path]:
    """peer.json, peer_requests.csv and peer_latency.png under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary, table, plot = (
        out_dir / "peer.json",
        out_dir / "peer_requests.csv",
        out_dir / "peer_latency.png",
    )
    summary.write_text(json.dumps(result, indent=2) + "\n")
    with table.open("w", newline="") as f:
        names = [n for n in PeerRecord.__dataclass_fields__ if n not in ("gaps_s", "parts")]
        part_names = [*TTFT_PARTS, "decode_step"]  # the traced run's rows, seconds
        writer = csv.DictWriter(f, fieldnames=[*names, "gaps", "itl_mean_s", *part_names])
        writer.writeheader()
        for record in records:
            row = {k: v for k, v in asdict(record).items() if k in names}
            gaps = record.gaps_s
            row |= {"gaps": len(gaps), "itl_mean_s": np.mean(gaps) if gaps else ""}
            writer.writerow(row | (record.parts or {}))
    _cdf_plot(records, plot, f"Baton vs llama-server: {Path(result['model']).name}")
    return [summary, table, plot]
