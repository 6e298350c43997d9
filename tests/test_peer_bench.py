"""`baton bench peer` end to end on a tiny model and a few requests: both servers really
served the same seeded workload — its chats opening with an image, read by the model's
generated projector on both sides — and every figure and breakdown part is measured.

The bench runs in its own process (`baton bench peer --json`): it starts and stops Ray
itself, twice (the traced run needs Ray's workers started with tracing on), which must not
meet the Ray this test session may hold. llama-server is built once by
`deploy/llama_server_build.py` and cached by flags; the first run on a machine builds it.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections import Counter

import pytest
from plot_files import assert_png

from baton_serve.deploy.llama_server_build import cached_server
from baton_serve.loadtests.llama_server import ServerSettings, server_command
from baton_serve.loadtests.peer_report import format_report
from baton_serve.loadtests.span_breakdown import TTFT_PARTS

BENCH_TIMEOUT_S = 600
FLAGS = {
    "chat-sessions": 2,
    "chat-turns": 2,
    "agent-sessions": 1,
    "agent-steps": 3,
    "concurrency": 2,
    "system-tokens": 120,
    "document-tokens": 100,
    "turn-tokens": 20,
    "tool-tokens": 40,
    "reply-tokens": 6,
    "image-px": 56,
}
REQUESTS = 2 * 2 + 1 * 3


@pytest.fixture(scope="module")
def llama_server_binary():
    return cached_server()  # builds it when this machine has none cached


def test_peer_bench_serves_one_workload_on_both_sides(
    tiny_model, tiny_projector, llama_server_binary, tmp_path
) -> None:
    flags = [arg for name, value in FLAGS.items() for arg in (f"--{name}", str(value))]
    command = [
        *(sys.executable, "-m", "baton_serve.deploy.cli", "bench", "peer"),
        *("--model", str(tiny_model("qwen35")), "--threads", "2", "--json"),
        *("--mmproj", str(tiny_projector("qwen35"))),
        "--no-exact-reuse",  # the flag reaches Baton's engines (the default: every other test)
        "--flash-attn",  # and this one both sides
        *("--out", str(tmp_path), *flags),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "peer.json").read_text())  # Ray may print to stdout too

    for side in ("llama-server", "baton"):
        summary = result[side]
        assert summary["requests"] == REQUESTS and summary["errors"] == 0, side
        assert summary["completion_tokens"] == REQUESTS * FLAGS["reply-tokens"], side
        assert summary["prompt_tokens"] > REQUESTS * FLAGS["system-tokens"], side
        assert 0 < summary["ttft_s"]["p50"] <= summary["ttft_s"]["p95"] <= summary["ttft_s"]["p99"]
        assert 0 < summary["itl_s"]["p50"] <= summary["itl_s"]["p99"], side
        assert summary["requests_per_s"] > 0, side
    setup = {"threads": 2, "slots": 2, "replicas": 2, "n_ctx": 1024}
    mmproj = str(tiny_projector("qwen35"))
    assert result["setup"] == setup | {"exact_reuse": False, "flash_attn": True, "mmproj": mmproj}
    engine = {"n_ctx": 1024, "n_slots": 1, "n_threads": 1, "node_cores": 2}
    assert result["engine"] == engine | {"exact_reuse": False, "flash_attn": True}
    assert "-fa on" in format_report(result) and "flash attention on" in format_report(result)
    rows = {row["figure"]: row for row in result["rows"]}
    assert set(rows) == {f"{m} p{q}" for m in ("ttft", "itl") for q in (50, 95, 99)} | {
        "requests/s",
        "follow-up ttft p50",
    }
    for side in ("llama-server", "baton"):  # the images' follow-ups come from cache
        assert result[side]["follow_up_cached"] > 0.5, side
    assert "cold first turns vs follow-up turns" in format_report(result)
    assert all(row["ratio"] > 0 and row["met"] in (True, False) for row in rows.values())

    breakdown = result["breakdown"]
    assert breakdown["requests"] == REQUESTS
    parts = breakdown["p50_s"]
    assert set(parts) == {*TTFT_PARTS, "decode_step"}
    assert parts["prefill"] > 0 and parts["decode_step"] > 0 and parts["router"] > 0

    # The same seeded requests on every side: each session's turns, with the same first
    # prompts (their texts hold no reply yet, so both servers count the same tokens).
    with (tmp_path / "peer_requests.csv").open() as f:
        records = list(csv.DictReader(f))
    by_server = Counter(r["server"] for r in records)
    assert by_server == {"llama-server": REQUESTS, "baton": REQUESTS, "baton-traced": REQUESTS}

    def first_prompts(server: str) -> list[tuple[str, str, str]]:
        return sorted(
            (r["kind"], r["session"], r["prompt_tokens"])
            for r in records
            if r["server"] == server and r["turn"] == "0"
        )

    assert first_prompts("llama-server") == first_prompts("baton") == first_prompts("baton-traced")
    assert_png(tmp_path / "peer_latency.png")


def test_llama_server_computes_attention_as_batons_engines(tmp_path) -> None:
    """llama-server's own default is `-fa auto` (on, on the CPU); the bench names the
    setting Baton's engines run with, so both sides compute the same kernels."""
    binary, model = tmp_path / "llama-server", tmp_path / "m.gguf"
    for flash_attn, value in ((False, "off"), (True, "on")):
        command = server_command(binary, model, ServerSettings(2, 2, 1024, flash_attn), 8080)
        assert command[command.index("-fa") + 1] == value
