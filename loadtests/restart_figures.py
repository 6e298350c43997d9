"""`baton bench restart`'s figures, from the files locust writes with `--csv PREFIX`: failed
requests (`PREFIX_samples.csv`), and the cached share of follow-up turns and TTFT
(`PREFIX_turns.csv`), in the minute before an event, while it lasts, and in the minute after."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WINDOW_S = 60.0
# As `locust_tokens.KEPT_SHARE`; not imported from there: importing locust monkey-patches the
# whole process with gevent.
KEPT_SHARE = 0.9
DROP_TARGET_PP = 10.0  # the most the follow-ups' cached share may fall after an event
CHAT_CLASS = "MultiTurnChatUser"


@dataclass(frozen=True)
class Turn:
    """One answered chat request: when it ended, its tokens, its time to first token."""

    at: float
    previous_prompt: int  # prompt tokens of the request it continues; 0: a session's first
    prompt: int
    cached: int
    ttft_s: float | None

    @property
    def follow_up(self) -> bool:
        return self.previous_prompt > 0

    @property
    def lost(self) -> bool:
        """A follow-up that found less than `KEPT_SHARE` of the previous prompt cached."""
        return self.follow_up and self.cached < KEPT_SHARE * self.previous_prompt


def _rows(path: Path) -> list[dict[str, str]]:
    """The complete lines of a CSV that may still be written (a `.part` file)."""
    text = path.read_text() if path.exists() else ""
    return list(csv.DictReader(io.StringIO(text[: text.rfind("\n") + 1])))


def read_turns(path: Path, user_class: str = CHAT_CLASS) -> list[Turn]:
    """The `user_class` rows of a `PREFIX_turns.csv`."""
    return [
        Turn(
            at=float(r["time_s"]),
            previous_prompt=int(r["previous_prompt_tokens"]),
            prompt=int(r["prompt_tokens"]),
            cached=int(r["cached_tokens"]),
            ttft_s=float(r["ttft_ms"]) / 1000 if r["ttft_ms"] else None,
        )
        for r in _rows(path)
        if r["user_class"] == user_class
    ]


def read_requests(path: Path) -> list[tuple[float, bool]]:
    """(time, ok) of each request (locust's "POST" rows) in a `PREFIX_samples.csv`."""
    return [(float(r["time_s"]), r["ok"] == "True") for r in _rows(path) if r["type"] == "POST"]


def cached_ratio(turns: list[Turn]) -> float | None:
    """Cached tokens over prompt tokens of `turns` (None without any)."""
    prompt = sum(t.prompt for t in turns)
    return sum(t.cached for t in turns) / prompt if prompt else None


def window(turns: list[Turn], requests: list[tuple[float, bool]], start: float, end: float) -> dict:
    """Figures of what ended in [start, end): requests and failures, the follow-ups (how many,
    how many lost their cache, their cached share), and TTFT percentiles of every turn."""
    inside = [t for t in turns if start <= t.at < end]
    follow_ups = [t for t in inside if t.follow_up]
    oks = [ok for at, ok in requests if start <= at < end]
    ttfts = [t.ttft_s for t in inside if t.ttft_s is not None]
    figures = {
        "seconds": end - start,
        "requests": len(oks),
        "failures": oks.count(False),
        "follow_ups": len(follow_ups),
        "follow_ups_lost": sum(t.lost for t in follow_ups),
        "follow_up_cached_ratio": cached_ratio(follow_ups),
        "lost_cached_ratio": cached_ratio([t for t in follow_ups if t.lost]),
    }
    for q in (50, 95, 99):
        figures[f"ttft_p{q}_s"] = float(np.percentile(ttfts, q)) if ttfts else None
    return figures


def event_figures(
    turns: list[Turn],
    requests: list[tuple[float, bool]],
    event: str,
    started: float,
    done: float,
    run_started: float,
) -> dict:
    """An event that began at `started` and was complete at `done`: the minute before,
    the event itself, the minute after; the drop of the follow-ups' cached share (percentage
    points) and whether the target is met (no failed request, a drop of at most
    `DROP_TARGET_PP`)."""
    before = window(turns, requests, started - WINDOW_S, started)
    during = window(turns, requests, started, done)
    after = window(turns, requests, done, done + WINDOW_S)
    ratios = before["follow_up_cached_ratio"], after["follow_up_cached_ratio"]
    drop_pp = None if None in ratios else 100 * (ratios[0] - ratios[1])
    failures = before["failures"] + during["failures"] + after["failures"]
    lost = [t for t in turns if t.lost and started <= t.at < done + WINDOW_S]
    return {
        "event": event,
        "at_s": started - run_started,
        "duration_s": done - started,
        "before": before,
        "during": during,
        "after": after,
        "drop_pp": drop_pp,
        "lost_since_start": len(lost),
        "lost_since_start_cached_ratio": cached_ratio(lost),
        "failures": failures,
        "target_met": drop_pp is not None and drop_pp <= DROP_TARGET_PP and failures == 0,
    }


def cold_start(turns: list[Turn], run_started: float) -> dict:
    """The cold-start figures: the cached share of sessions' first turns (the shared system
    prompt at best), and of follow-ups in the run's first minute (a cold cluster)."""
    first_minute = [t for t in turns if t.follow_up and t.at < run_started + WINDOW_S]
    return {
        "first_turn_cached_ratio": cached_ratio([t for t in turns if not t.follow_up]),
        "first_minute_follow_up_cached_ratio": cached_ratio(first_minute),
    }


def format_report(result: dict) -> str:
    """The events' table and the cold-start figures."""
    handoff = "off" if not result["handoff_s"] else f"{result['handoff_s']:g} s"
    surge = result.get("surge_percent", 0)
    lines = [
        f"restart: {result['model']}, {result['replicas']} replicas, {result['users']} locust"
        f" users ({CHAT_CLASS}, {result['chat_turns']} turns a session), hand-off {handoff},"
        f" rollout surge {surge}%",
        f"requests {result['requests']}, failures {result['failures']} (whole run)",
        f"{'event':<10} {'at':>5} {'took':>5} {'failed':>6} {'cached before':>13}"
        f" {'during':>6} {'after':>6} {'drop':>8} {'lost b/d/a':>11} {'met':>4}"
        f"  TTFT p50/p95/p99 before -> after",
    ]
    for e in result["events"]:
        b, d, a = e["before"], e["during"], e["after"]
        lost = f"{b['follow_ups_lost']}/{d['follow_ups_lost']}/{a['follow_ups_lost']}"
        lines.append(
            f"{e['event']:<10} {e['at_s']:>4.0f}s {e['duration_s']:>4.0f}s {e['failures']:>6}"
            f" {_pct(b['follow_up_cached_ratio']):>13} {_pct(d['follow_up_cached_ratio']):>6}"
            f" {_pct(a['follow_up_cached_ratio']):>6} {_pp(e['drop_pp']):>8} {lost:>11}"
            f" {'yes' if e['target_met'] else 'NO':>4}  {_ttfts(b)} -> {_ttfts(a)}"
        )
    cold = result["cold_start"]
    lines += [
        f"{e['event']}: {e['lost_since_start']} follow-ups lost their cache from its start to"
        f" a minute after it, {_pct(e['lost_since_start_cached_ratio'])} of their prompts cached"
        for e in result["events"]
    ]
    lines += [
        f"cached share of follow-ups: before/during/after = the {WINDOW_S:.0f} s before the"
        f" event, the event, the {WINDOW_S:.0f} s after it; drop in percentage points"
        f" (target <= {DROP_TARGET_PP:.0f} pp, and no failed request); lost = follow-ups"
        f" with under {KEPT_SHARE:.0%} of the previous prompt cached",
        f"cold start: sessions' first turns {_pct(cold['first_turn_cached_ratio'])} cached,"
        f" follow-ups in the run's first minute {_pct(cold['first_minute_follow_up_cached_ratio'])}",
    ]
    return "\n".join(lines)


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.1f}%"


def _pp(drop: float | None) -> str:
    return "-" if drop is None else f"{drop:+.1f}pp"


def _ttfts(figures: dict) -> str:
    values = [figures[f"ttft_p{q}_s"] for q in (50, 95, 99)]
    return "/".join("-" if v is None else f"{v:.2f}" for v in values) + "s"
