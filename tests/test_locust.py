"""The locust workloads: SSE parsing, and a short headless run against a real Baton app."""

from __future__ import annotations

import csv
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures_ray import wait_healthy

from baton_serve.deploy.app import build_app
from baton_serve.deploy.config import BatonConfig
from baton_serve.replicas.engine.engine_config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = ROOT / "loadtests" / "locustfile.py"


# ---- SSE parsing (no server) ------------------------------------------------------------------
# Importing locust monkey-patches the process with gevent, which breaks pytest's own imports, so
# the parser is checked in a child interpreter.

PARSER_CHECK = r"""
import time
from baton_serve.loadtests.locustfile import read_stream
from baton_serve.loadtests.sse import StreamError

def lines(*events):
    return [f"data: {e}".encode() for e in events]

chunk = '{"choices":[{"index":0,"delta":{"content":"%s"}}]}'
usage = ('{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":2,'
         '"prompt_tokens_details":{"cached_tokens":4}}}')
result = read_stream(lines(chunk % "Hel", chunk % "lo", usage, "[DONE]"), time.perf_counter())
assert result.text == "Hello", result
assert result.ttft_s is not None and len(result.gaps_s) == 1, result
assert result.usage["prompt_tokens_details"]["cached_tokens"] == 4, result
broken = [
    lines('{"choices":[]}'),  # no [DONE]
    lines("{not json", "[DONE]"),
    lines('{"error":{"message":"boom"}}', "[DONE]"),
    [b"event: nope", b"data: [DONE]"],
    lines("[DONE]", '{"choices":[]}'),
]
for case in broken:
    try:
        read_stream(case, time.perf_counter())
    except StreamError:
        continue
    raise AssertionError(f"accepted {case}")
print("parser ok")
"""


def test_sse_parser_accepts_openai_streams_and_rejects_broken_ones() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", PARSER_CHECK],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "parser ok" in done.stdout, done.stdout + done.stderr


# ---- a short headless run ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def baton_url(serve_port, tiny_model) -> Iterator[str]:
    from ray import serve

    name = f"locust-{secrets.token_hex(3)}"
    config = BatonConfig(
        model=str(tiny_model("llama")),
        replicas=1,
        num_cpus_per_replica=0.5,
        engine=EngineConfig(n_ctx=4096, n_slots=2, n_threads=1),
        hmac_key=secrets.token_hex(16),
    )
    serve.run(build_app(config), name=name, route_prefix=f"/{name}")
    url = f"http://127.0.0.1:{serve_port}/{name}"
    try:
        wait_healthy(url)
        yield url
    finally:
        serve.delete(name)


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_headless_run_of_all_user_classes(baton_url: str, tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "-u",
        "3",
        "-r",
        "3",
        "--run-time",
        "20s",
        "--stop-timeout",
        "10",
        "--host",
        baton_url,
        "--csv",
        str(tmp_path / "run"),
        "--html",
        str(tmp_path / "report.html"),
        "--system-tokens",
        "300",
        "--max-tokens",
        "8",
        "--seed",
        "1",
        "--only-summary",
        "--exit-code-on-error",
        "1",
        "MultiTurnChatUser",
        "AgentLoopUser",
        "NoSharingUser",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    output = done.stdout + done.stderr
    print(output[-6000:])  # the summary tables, shown with `pytest -rP`
    assert done.returncode == 0, output[-4000:]

    stats = _read_csv(tmp_path / "run_stats.csv")
    total = next(row for row in stats if row["Name"] == "Aggregated")
    assert int(total["Request Count"]) > 0, output[-4000:]
    assert int(total["Failure Count"]) == 0, (tmp_path / "run_failures.csv").read_text()
    kinds = {row["Type"] for row in stats}
    assert {"TTFT", "ITL"} <= kinds, kinds
    chats = {row["Name"]: int(row["Request Count"]) for row in stats if row["Type"] == "POST"}
    for user_class in ("MultiTurnChatUser", "AgentLoopUser", "NoSharingUser"):
        assert chats.get(f"chat {user_class}", 0) > 0, chats
    assert (tmp_path / "report.html").stat().st_size > 0

    tokens = {row["user_class"]: row for row in _read_csv(tmp_path / "run_tokens.csv")}
    assert int(tokens["MultiTurnChatUser"]["cached_tokens"]) > 0, tokens
    assert int(tokens["MultiTurnChatUser"]["prompt_tokens"]) > 0, tokens
    assert "Baton token usage" in output
