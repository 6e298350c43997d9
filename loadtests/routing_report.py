"""The routing benchmark's figures: per-policy summaries, the issue's targets, the table,
and the CSV, JSON and PNG files."""

from __future__ import annotations

import csv
import itertools
import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from baton_serve.deploy.config import RouterPolicy
from baton_serve.loadtests.plots import figure
from baton_serve.loadtests.routing_workload import BLOCKERS, CHAT, MOVED, RequestRecord

BASELINE = RouterPolicy.POW2
ANCHOR = RouterPolicy.PREFIX_AFFINITY
TTFT_RATIO_TARGET = 0.3  # Baton's TTFT p50 over power-of-two's
COMPUTED_OVER_NEW_TARGET = 1.2


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[RequestRecord], scenarios: dict) -> dict:
    """A policy's figures: the chat scenario at the top level, the moved one under "moved"."""

    def figures(scenario: str) -> dict:
        rows = [r for r in records if r.scenario == scenario]
        ok = [r for r in rows if not r.error]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        prompt = sum(r.prompt_tokens for r in ok)
        cached = sum(r.cached_tokens for r in ok)
        computed = sum(r.computed_tokens for r in ok)
        new = sum(r.new_tokens for r in ok)
        return {
            "requests": len(rows),
            "errors": len(rows) - len(ok),
            "ttft_p50_s": _percentile(ttfts, 50),
            "ttft_p95_s": _percentile(ttfts, 95),
            "ttft_p99_s": _percentile(ttfts, 99),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "computed_prompt_tokens": computed,
            "new_prompt_tokens": new,
            "cached_ratio": cached / prompt if prompt else None,
            "computed_over_new": computed / new if new else None,
            **scenarios[scenario],
        }

    return figures(CHAT) | {MOVED: figures(MOVED)}


def policy_targets(policies: dict[str, dict]) -> dict[str, dict]:
    """The issue's targets, where the policies they compare were run."""
    baton = policies.get(RouterPolicy.BATON.value)
    if baton is None:
        return {}
    targets = {}
    if (baton_new := baton["computed_over_new"]) is not None:
        targets["computed_over_new"] = {
            "value": baton_new,
            "target": f"<= {COMPUTED_OVER_NEW_TARGET}",
            "met": baton_new <= COMPUTED_OVER_NEW_TARGET,
        }
    for other, name, bound in (
        (BASELINE, "ttft_p50_over_pow2", TTFT_RATIO_TARGET),
        (ANCHOR, "ttft_p50_over_prefix_affinity", 1.0),
    ):
        theirs = policies.get(other.value, {}).get("ttft_p50_s")
        if theirs and baton["ttft_p50_s"] is not None:
            ratio = baton["ttft_p50_s"] / theirs
            targets[name] = {"value": ratio, "target": f"<= {bound}", "met": ratio <= bound}
    return targets


# ---- output ---------------------------------------------------------------------------------

_COLUMNS = (  # title, key, format, scale
    ("reqs", "requests", "d", 1),
    ("errs", "errors", "d", 1),
    ("TTFT p50", "ttft_p50_s", ".3f", 1),
    ("p95", "ttft_p95_s", ".3f", 1),
    ("p99", "ttft_p99_s", ".3f", 1),
    ("total s", "total_s", ".1f", 1),
    ("prompt", "prompt_tokens", "d", 1),
    ("computed", "computed_prompt_tokens", "d", 1),
    ("new", "new_prompt_tokens", "d", 1),
    ("cached", "cached_ratio", ".1%", 1),
    ("comp/new", "computed_over_new", ".3f", 1),
    ("shipped", "checkpoints_shipped", "d", 1),
    ("MB shipped", "bytes_shipped", ".1f", 1e-6),
)


def _table(policies: dict[str, dict]) -> list[str]:
    widths = [max(len(title), 8) for title, *_ in _COLUMNS]
    lines = [f"{'policy':<16}" + "".join(f" {t:>{w}}" for (t, *_), w in zip(_COLUMNS, widths))]
    for name, figures in policies.items():
        cells = [f"{name:<16}"]
        for (_, key, fmt, scale), width in zip(_COLUMNS, widths):
            value = figures[key]
            text = "-" if value is None else format(value * scale if scale != 1 else value, fmt)
            cells.append(f" {text:>{width}}")
        lines.append("".join(cells))
    return lines


def _decisions(policies: dict[str, dict]) -> list[str]:
    """Per policy, Baton's routing decisions by reason and its replicas' pull outcomes."""
    lines = []
    for name, figures in policies.items():
        parts = [
            f"{title} " + ", ".join(f"{k} {v}" for k, v in counts.items())
            for title, counts in (
                ("decisions:", figures.get("routing_decisions")),
                ("pulls:", figures.get("pull_outcomes")),
            )
            if counts
        ]
        if parts:
            lines.append(f"  {name}: " + "; ".join(parts))
    return lines


def format_report(result: dict) -> str:
    w = result["workload"]
    policies = result["policies"]
    lines = [
        f"model: {result['model']}, {result['replicas']} replicas x {result['threads_per_replica']}"
        f" thread(s), {result['index']} index",
        f"chat: {w['sessions']} sessions x {w['turns']} turns, {w['concurrency']} at a time;"
        f" system {w['system_tokens']} + document {w['document_tokens']} tokens, then"
        f" {w['turn_tokens']}-token questions and {w['reply_tokens']}-token replies,"
        f" {w['think_s']:g} s mean pause between turns; seed {w['seed']}",
        *_table(policies),
        *_decisions(policies),
        "",
        f"moved: {w['moved_sessions']} sessions whose replica is kept busy by {BLOCKERS} long"
        " requests before their second turn",
        *_table(moved := {name: figures[MOVED] for name, figures in policies.items()}),
        *_decisions(moved),
    ]
    if result["targets"]:
        lines.append("")
        for name, target in result["targets"].items():
            verdict = "met" if target["met"] else "NOT met"
            lines.append(f"{name}: {target['value']:.3f} (target {target['target']}): {verdict}")
    return "\n".join(lines)


def write_outputs(result: dict, records: list[RequestRecord], out_dir: Path) -> list[Path]:
    """summary.json, policies.csv, requests.csv and two PNG plots in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / name for name in ("summary.json", "policies.csv", "requests.csv")]
    written[0].write_text(json.dumps(result, indent=2) + "\n")
    with written[1].open("w", newline="") as file:
        rows = [
            {
                "policy": name,
                "scenario": scenario,
                **_flat(figures if scenario == CHAT else figures[MOVED]),
            }
            for name, figures in result["policies"].items()
            for scenario in (CHAT, MOVED)
        ]
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with written[2].open("w", newline="") as file:
        rows = [
            {k: v for k, v in asdict(r).items() if k not in ("prompt", "reply")}
            | {"computed_tokens": r.computed_tokens}
            for r in records
        ]
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return written + _plots(records, out_dir)


def _flat(figures: dict) -> dict:
    return {k: v for k, v in figures.items() if not isinstance(v, dict)}


def _plots(records: list[RequestRecord], out_dir: Path) -> list[Path]:
    chat = [r for r in records if r.scenario == CHAT and not r.error]
    by_policy: dict[str, list[RequestRecord]] = defaultdict(list)
    for record in chat:
        by_policy[record.policy].append(record)

    cdf_path = out_dir / "ttft_cdf.png"
    with figure(cdf_path, "TTFT CDF (chat)") as (axes,):
        for policy, rows in by_policy.items():
            ttfts = sorted(r.ttft_s for r in rows if r.ttft_s is not None)
            axes.step(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), where="post", label=policy)
        axes.set(xlabel="time to first token (s)", ylabel="share of requests")

    turns_path = out_dir / "computed_per_turn.png"
    with figure(turns_path, "Prompt tokens computed per turn (chat)") as (axes,):
        for (policy, rows), marker in zip(by_policy.items(), itertools.cycle("osD^v")):
            turns = sorted({r.turn for r in rows})
            mean = [np.mean([r.computed_tokens for r in rows if r.turn == t]) for t in turns]
            # Distinct markers, open: policies that compute the same show on top of each other.
            axes.plot(turns, mean, marker=marker, fillstyle="none", markersize=8, label=policy)
        turns = sorted({r.turn for r in chat})
        new = [np.mean([r.new_tokens for r in chat if r.turn == t]) for t in turns]
        axes.plot(turns, new, linestyle="--", color="black", label="new tokens (ideal)")
        axes.set(xlabel="turn", ylabel="computed prompt tokens (mean per request)")
        axes.set_xticks(turns)
    return [cdf_path, turns_path]
