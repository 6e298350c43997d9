"""`baton bench restart`'s figures from the per-request files the locustfile writes: the files
are written by the locustfile's own code (its sample logs, driven through locust's events in a
child interpreter: importing locust monkey-patches the process), then read back and cut into
the minute before an event, the event, and the minute after. The benchmark itself runs for
minutes and is not run here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from baton_serve.loadtests.restart_figures import (
    cold_start,
    event_figures,
    format_report,
    read_requests,
    read_turns,
    window,
)

ROOT = Path(__file__).resolve().parents[1]

# Turns at `base + offset` (base: the child's clock when it starts), requests fired at once:
# (user class, offset s, previous prompt tokens, prompt tokens, cached tokens, TTFT s)
TURNS = [
    ("MultiTurnChatUser", -90.0, 0, 600, 500, 2.0),  # first turns: the cold start
    ("MultiTurnChatUser", -80.0, 0, 600, 0, 4.0),
    ("MultiTurnChatUser", -50.0, 600, 700, 600, 1.0),  # the minute before the event
    ("MultiTurnChatUser", -20.0, 700, 800, 700, 1.0),
    ("AgentLoopUser", -10.0, 700, 800, 0, 9.0),  # another class: left out
    ("MultiTurnChatUser", 0.5, 800, 900, 500, 3.0),  # during it: lost its cache
    ("MultiTurnChatUser", 10.0, 900, 1000, 500, 3.0),  # the minute after: one lost, one kept
    ("MultiTurnChatUser", 20.0, 1000, 1000, 990, None),
    ("MultiTurnChatUser", 80.0, 1000, 1100, 0, 1.0),  # past the minute after
]
REQUESTS_OK = [True, True, False, True]

WRITER = r"""
import json, sys, time, types
from locust import events
from locust.env import Environment
from baton_serve.loadtests import locustfile  # its sample log and request listener
from baton_serve.loadtests.locust_tokens import record_turn

turns, oks = json.loads(sys.argv[2]), json.loads(sys.argv[3])
env = Environment(events=events, parsed_options=types.SimpleNamespace(csv_prefix=sys.argv[1]))
base = time.time()
events.test_start.fire(environment=env)
for user_class, offset, previous, prompt, cached, ttft in turns:
    usage = {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}
    record_turn(user_class, previous, usage, ttft, base + offset)
for ok in oks:
    events.request.fire(request_type="POST", name="chat MultiTurnChatUser", response_time=5.0,
                        response_length=1, exception=None if ok else RuntimeError("boom"),
                        context={})
events.quitting.fire(environment=env)
print(base)
"""


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """The files the locustfile writes for TURNS and REQUESTS_OK, and their base time."""
    prefix = tmp_path_factory.mktemp("restart") / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", WRITER, str(prefix), json.dumps(TURNS)]
    done = subprocess.run(
        [*command, json.dumps(REQUESTS_OK)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return prefix, float(done.stdout.strip().splitlines()[-1])


def test_the_locustfile_writes_each_turn_and_request(written: tuple[Path, float]) -> None:
    prefix, base = written
    assert not list(prefix.parent.glob("*.part"))  # renamed when locust quits
    turns = read_turns(prefix.parent / "run_turns.csv")
    assert len(turns) == len(TURNS) - 1  # the AgentLoopUser turn is not a chat's
    assert [t.at - base for t in turns] == pytest.approx([t[1] for t in TURNS if t[0][0] == "M"])
    assert [t.follow_up for t in turns[:3]] == [False, False, True]
    assert turns[-2].ttft_s is None and turns[0].ttft_s == pytest.approx(2.0)
    requests = read_requests(prefix.parent / "run_samples.csv")
    assert [ok for _, ok in requests] == REQUESTS_OK
    assert all(base <= at < base + 30 for at, _ in requests)


def test_the_minutes_around_an_event(written: tuple[Path, float]) -> None:
    prefix, base = written
    turns = read_turns(prefix.parent / "run_turns.csv")
    requests = read_requests(prefix.parent / "run_samples.csv")
    # The event began as the requests were fired and was complete 5 s later.
    event = event_figures(turns, requests, "rolling", base, base + 5.0, base - 100.0)
    before, during, after = event["before"], event["during"], event["after"]
    assert before["follow_ups"] == 2 and before["follow_ups_lost"] == 0
    assert before["follow_up_cached_ratio"] == pytest.approx(1300 / 1500)
    assert during["follow_ups"] == 1 and during["follow_ups_lost"] == 1
    assert (during["requests"], during["failures"]) == (4, 1)
    assert after["follow_ups"] == 2 and after["follow_ups_lost"] == 1
    assert after["follow_up_cached_ratio"] == pytest.approx(1490 / 2000)
    assert event["drop_pp"] == pytest.approx(100 * (1300 / 1500 - 1490 / 2000))
    assert event["failures"] == 1 and not event["target_met"]
    assert event["lost_since_start"] == 2
    assert event["lost_since_start_cached_ratio"] == pytest.approx(1000 / 1900)
    assert event["at_s"] == pytest.approx(100.0) and event["duration_s"] == pytest.approx(5.0)
    assert after["ttft_p50_s"] == pytest.approx(3.0)  # the turn without a TTFT is left out
    assert window(turns, requests, base + 200, base + 260)["follow_up_cached_ratio"] is None

    cold = cold_start(turns, base - 100.0)
    assert cold["first_turn_cached_ratio"] == pytest.approx(500 / 1200)
    assert cold["first_minute_follow_up_cached_ratio"] == pytest.approx(600 / 700)

    result = {
        "model": "m.gguf",
        "replicas": 3,
        "users": 6,
        "chat_turns": 24,
        "handoff_s": 0.0,
        "requests": 4,
        "failures": 1,
        "events": [event],
        "cold_start": cold,
    }
    report = format_report(result)
    row = next(line for line in report.splitlines() if line.startswith("rolling"))
    assert "86.7%" in row and "74.5%" in row and "+12.2pp" in row and "0/1/1" in row
    assert row.split()[3] == "1" and "NO" in row
    assert "hand-off off" in report and "first turns 41.7% cached" in report
    assert "rolling: 2 follow-ups lost their cache" in report and "52.6% of their" in report
