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

from baton_serve.cache_store.prefix_hash import common_prefix_length
from baton_serve.deploy.config import RouterPolicy
from baton_serve.loadtests.plots import cdf, figure
from baton_serve.loadtests.routing_workload import (
    AGENT,
    BLOCKERS,
    BURST,
    CHAT,
    KEPT_SHARE,
    MOVED,
    SCENARIOS,
    RequestRecord,
)

OTHERS = (RouterPolicy.POW2, RouterPolicy.PREFIX_AFFINITY, RouterPolicy.ROUND_ROBIN)
# Never behind a peer: Baton's TTFT p50, p95 and p99 each at most the best other policy's,
# and its computed prompt tokens at most 1.05 times the least any policy computed.
TTFT_OVER_BEST_TARGET = 1.0
COMPUTED_OVER_LEAST_TARGET = 1.05
COMPUTED_OVER_NEW_TARGET = 1.2
KEPT_TARGET = 0.95  # agent follow-ups that keep their cache
ALL = "all"


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def distinct_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens of distinct prefixes among `prompts`: the size of their prefix tree."""
    ordered = sorted(tuple(p) for p in prompts)
    shared = sum(common_prefix_length(a, b) for a, b in zip(ordered, ordered[1:]))
    return sum(len(p) for p in ordered) - shared


def _figures(rows: list[RequestRecord]) -> dict:
    ok = [r for r in rows if not r.error]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    computed = sum(r.computed_tokens for r in ok)
    new = sum(r.new_tokens for r in ok)
    distinct = distinct_tokens([r.prompt for r in ok])
    return {
        "requests": len(rows),
        "errors": len(rows) - len(ok),
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p95_s": _percentile(ttfts, 95),
        "ttft_p99_s": _percentile(ttfts, 99),
        "ttft_max_s": max(ttfts, default=None),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_prompt_tokens": computed,
        "new_prompt_tokens": new,
        "distinct_prompt_tokens": distinct,
        "cached_ratio": cached / prompt if prompt else None,
        "computed_over_new": computed / new if new else None,
        "computed_over_distinct": computed / distinct if distinct else None,
    }


def _burst_figures(rows: list[RequestRecord]) -> dict:
    """How many times the burst's shared prefix was computed."""
    ok = [r for r in rows if not r.error]
    if len(ok) < 2:
        return {}
    shared = min(common_prefix_length(ok[0].prompt, r.prompt) for r in ok[1:])
    own = sum(r.prompt_tokens - shared for r in ok)
    computed = sum(r.computed_tokens for r in ok)
    return {"shared_prefix_tokens": shared, "shared_computed_times": (computed - own) / shared}


def _agent_figures(rows: list[RequestRecord]) -> dict:
    """Follow-ups that kept their cache: at least `KEPT_SHARE` of the previous prompt."""
    by_session: dict[int, list[RequestRecord]] = defaultdict(list)
    for record in sorted(rows, key=lambda r: (r.session, r.turn)):
        by_session[record.session].append(record)
    pairs = [(a, b) for steps in by_session.values() for a, b in zip(steps, steps[1:])]
    kept = sum(not b.error and b.cached_tokens >= KEPT_SHARE * a.prompt_tokens for a, b in pairs)
    return {
        "follow_ups": len(pairs),
        "follow_ups_kept": kept,
        "kept_share": kept / len(pairs) if pairs else None,
    }


def summarize(records: list[RequestRecord], scenarios: dict) -> dict:
    """A policy's figures: the whole workload at the top level (`all`), each scenario under
    its name."""
    summary = {ALL: _figures(records)}
    for scenario in SCENARIOS:
        rows = [r for r in records if r.scenario == scenario]
        summary[scenario] = _figures(rows) | scenarios.get(scenario, {})
        if scenario == BURST:
            summary[scenario] |= _burst_figures(rows)
        if scenario == AGENT:
            summary[scenario] |= _agent_figures(rows)
    return summary


def _target(value: float | None, bound: float, *, at_least: bool = False) -> dict | None:
    if value is None:
        return None
    met = value >= bound if at_least else value <= bound
    return {"value": value, "target": f"{'>=' if at_least else '<='} {bound:g}", "met": met}


def policy_targets(policies: dict[str, dict], replicas: int = 2) -> dict[str, dict]:
    """The issue's targets, over the whole workload, where the policies they compare ran."""
    baton = policies.get(RouterPolicy.BATON.value)
    if baton is None:
        return {}
    mine = baton[ALL]
    targets = {
        "errors": _target(mine["errors"], 0),
        "computed_over_new": _target(mine["computed_over_new"], COMPUTED_OVER_NEW_TARGET),
        "burst_shared_prefix_computed_times": _target(
            baton[BURST].get("shared_computed_times"), replicas
        ),
        "agent_follow_ups_kept": _target(
            baton[AGENT].get("kept_share"), KEPT_TARGET, at_least=True
        ),
    }
    others = [policies[o.value][ALL] for o in OTHERS if o.value in policies]
    for ttft in ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s"):
        theirs = [other[ttft] for other in others if other[ttft]]
        if theirs and mine[ttft] is not None:
            name = f"{ttft.removesuffix('_s')}_over_best_other"
            targets[name] = _target(mine[ttft] / min(theirs), TTFT_OVER_BEST_TARGET)
    least = min((o["computed_prompt_tokens"] for o in others), default=0)
    if least:
        ratio = mine["computed_prompt_tokens"] / least
        targets["computed_over_least_other"] = _target(ratio, COMPUTED_OVER_LEAST_TARGET)
    return {name: target for name, target in targets.items() if target is not None}


# ---- output ---------------------------------------------------------------------------------

_COLUMNS = (  # title, key, format, scale
    ("reqs", "requests", "d", 1),
    ("errs", "errors", "d", 1),
    ("TTFT p50", "ttft_p50_s", ".3f", 1),
    ("p95", "ttft_p95_s", ".3f", 1),
    ("p99", "ttft_p99_s", ".3f", 1),
    ("max", "ttft_max_s", ".3f", 1),
    ("total s", "total_s", ".1f", 1),
    ("prompt", "prompt_tokens", "d", 1),
    ("computed", "computed_prompt_tokens", "d", 1),
    ("new", "new_prompt_tokens", "d", 1),
    ("cached", "cached_ratio", ".1%", 1),
    ("comp/new", "computed_over_new", ".3f", 1),
    ("comp/dist", "computed_over_distinct", ".3f", 1),
    ("shipped", "checkpoints_shipped", "d", 1),
    ("MB shipped", "bytes_shipped", ".1f", 1e-6),
)


def _table(policies: dict[str, dict]) -> list[str]:
    widths = [max(len(title), 8) for title, *_ in _COLUMNS]
    lines = [f"{'policy':<16}" + "".join(f" {t:>{w}}" for (t, *_), w in zip(_COLUMNS, widths))]
    for name, figures in policies.items():
        cells = [f"{name:<16}"]
        for (_, key, fmt, scale), width in zip(_COLUMNS, widths):
            value = figures.get(key)
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
    totals = {
        name: f[ALL] | {"total_s": sum(f[s].get("total_s", 0) for s in SCENARIOS)}
        for name, f in policies.items()
    }
    lines = [
        f"model: {result['model']}, {result['replicas']} replicas x {result['threads_per_replica']}"
        f" thread(s), {result['index']} index; seed {w['seed']}",
        "all scenarios:",
        *_table(totals),
    ]
    descriptions = {
        CHAT: f"chat: {w['sessions']} sessions x {w['turns']} turns, {w['concurrency']} at a time;"
        f" system {w['system_tokens']} + document {w['document_tokens']} tokens, then"
        f" {w['turn_tokens']}-token questions and {w['reply_tokens']}-token replies,"
        f" {w['think_s']:g} s mean pause between turns",
        BURST: f"burst: {w['burst_sessions']} sessions at once on a new {w['system_tokens']}-token"
        " system prompt",
        AGENT: f"agent: {w['agent_sessions']} loops x {w['agent_steps']} steps, no pause,"
        f" {w['tool_tokens']}-token tool results",
        MOVED: f"moved: {w['moved_sessions']} sessions whose replica is kept busy by {BLOCKERS}"
        " long requests before their second turn",
    }
    for scenario in SCENARIOS:
        rows = {name: figures[scenario] for name, figures in policies.items()}
        lines += ["", descriptions[scenario], *_table(rows), *_decisions(rows)]
        if scenario == BURST:
            lines += [
                f"  {name}: shared prefix ({f['shared_prefix_tokens']} tokens) computed"
                f" {f['shared_computed_times']:.2f} times"
                for name, f in rows.items()
                if "shared_computed_times" in f
            ]
        if scenario == AGENT:
            lines += [
                f"  {name}: {f['follow_ups_kept']}/{f['follow_ups']} follow-ups kept their cache"
                for name, f in rows.items()
                if f.get("follow_ups")
            ]
    if result["targets"]:
        lines += ["", "targets:"]
        for name, target in result["targets"].items():
            verdict = "met" if target["met"] else "NOT met"
            lines.append(f"  {name}: {target['value']:.3f} (target {target['target']}): {verdict}")
    return "\n".join(lines)


def write_outputs(result: dict, records: list[RequestRecord], out_dir: Path) -> list[Path]:
    """summary.json, policies.csv, requests.csv and two PNG plots in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / name for name in ("summary.json", "policies.csv", "requests.csv")]
    written[0].write_text(json.dumps(result, indent=2) + "\n")
    with written[1].open("w", newline="") as file:
        rows = [
            {"policy": name, "scenario": scenario, **_flat(figures[scenario])}
            for name, figures in result["policies"].items()
            for scenario in (ALL, *SCENARIOS)
        ]
        fields = list(dict.fromkeys(key for row in rows for key in row))
        writer = csv.DictWriter(file, fieldnames=fields)
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
    every: dict[str, list[RequestRecord]] = defaultdict(list)
    for record in records:
        if not record.error:
            every[record.policy].append(record)
    cdf_path = out_dir / "ttft_cdf.png"
    with figure(cdf_path, "TTFT CDF (every scenario)") as (axes,):
        for policy, rows in every.items():
            cdf(axes, [r.ttft_s for r in rows if r.ttft_s is not None], label=policy)
        axes.set_xscale("log")
        axes.set(xlabel="time to first token (s, log scale)", ylabel="share of requests")

    chat = [r for r in records if r.scenario == CHAT and not r.error]
    by_policy: dict[str, list[RequestRecord]] = defaultdict(list)
    for record in chat:
        by_policy[record.policy].append(record)

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
