"""Locust token accounting for Baton's workloads: prompt and cached tokens per user class
(from each stream's usage chunk) and the follow-ups that kept their cache, merged from
locust workers, printed when locust quits and written to `PREFIX_tokens.csv` with `--csv`.
A local run with `--csv` also writes each request's tokens, timestamped, to
`PREFIX_turns.csv` (`baton bench restart` reads the cached share of follow-ups over time).
Importing this module registers its event listeners."""

from __future__ import annotations

import csv
from collections import defaultdict

from locust import events
from locust.runners import MasterRunner, WorkerRunner

from baton_serve.loadtests.sample_log import SampleLog

_TOKENS: dict[str, dict[str, int]] = defaultdict(
    lambda: {"requests": 0, "prompt": 0, "cached": 0, "follow_ups": 0, "kept": 0}
)
KEPT_SHARE = 0.9  # a follow-up keeps its cache when this much of the previous prompt is cached
# previous_prompt_tokens: of the request whose history this one continues (0: not a follow-up).
TURN_FIELDS = (
    "time_s",
    "user_class",
    "previous_prompt_tokens",
    "prompt_tokens",
    "cached_tokens",
    "ttft_ms",
)
_TURNS = SampleLog("turns", TURN_FIELDS)


def record_usage(user_class: str, usage: dict | None) -> None:
    if not usage:
        return
    totals = _TOKENS[user_class]
    totals["requests"] += 1
    totals["prompt"] += int(usage.get("prompt_tokens") or 0)
    totals["cached"] += _cached(usage)


def _cached(usage: dict) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def record_turn(
    user_class: str, previous_prompt: int, usage: dict, ttft_s: float | None, at: float
) -> None:
    """One answered request's tokens, in `PREFIX_turns.csv`; `at` is when it ended."""
    ttft_ms = "" if ttft_s is None else round(ttft_s * 1000, 3)
    prompt = int(usage.get("prompt_tokens") or 0)
    _TURNS.write((at, user_class, previous_prompt, prompt, _cached(usage), ttft_ms))


def record_follow_up(user_class: str, previous_prompt: int, usage: dict) -> None:
    totals = _TOKENS[user_class]
    totals["follow_ups"] += 1
    totals["kept"] += _cached(usage) >= KEPT_SHARE * previous_prompt


@events.test_start.add_listener
def _reset_tokens(environment, **_kwargs) -> None:
    if not isinstance(environment.runner, MasterRunner):
        _TOKENS.clear()


@events.report_to_master.add_listener
def _send_tokens(client_id, data, **_kwargs) -> None:
    data["baton_tokens"] = {name: dict(totals) for name, totals in _TOKENS.items()}
    _TOKENS.clear()


@events.worker_report.add_listener
def _merge_tokens(client_id, data, **_kwargs) -> None:
    for name, totals in data.get("baton_tokens", {}).items():
        for key, value in totals.items():
            _TOKENS[name][key] += value


@events.quitting.add_listener
def _print_tokens(environment, **_kwargs) -> None:
    if isinstance(environment.runner, WorkerRunner):
        return
    rows = [
        {
            "user_class": name,
            "requests": t["requests"],
            "prompt_tokens": t["prompt"],
            "cached_tokens": t["cached"],
            "cached_ratio": round(t["cached"] / t["prompt"], 4) if t["prompt"] else 0.0,
            "follow_ups": t["follow_ups"],
            "follow_ups_kept": t["kept"],
        }
        for name, t in sorted(_TOKENS.items())
    ]
    print("Baton token usage (from stream usage chunks)")
    print(
        f"{'user class':<22}{'requests':>10}{'prompt':>12}{'cached':>12}{'cached %':>10}"
        f"{'kept':>12}"
    )
    for r in rows:
        kept = f"{r['follow_ups_kept']}/{r['follow_ups']}" if r["follow_ups"] else "-"
        print(
            f"{r['user_class']:<22}{r['requests']:>10}{r['prompt_tokens']:>12}"
            f"{r['cached_tokens']:>12}{100 * r['cached_ratio']:>9.1f}%{kept:>12}"
        )
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if prefix:
        with open(f"{prefix}_tokens.csv", "w", newline="") as f:
            writer = csv.DictWriter(
                f,
                fieldnames=[
                    "user_class",
                    "requests",
                    "prompt_tokens",
                    "cached_tokens",
                    "cached_ratio",
                    "follow_ups",
                    "follow_ups_kept",
                ],
            )
            writer.writeheader()
            writer.writerows(rows)
