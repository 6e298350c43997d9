"""A benchmark client of the vLLM project, unmodified, drives Baton: `guidellm benchmark`
streams chat completions at a fixed concurrency (a few seconds' worth of requests) against
the gateway serving the default model (SmolLM2-135M). Every request succeeds, and the token
counts it reports are Baton's: with no tokenizer at hand, guidellm counts what each stream's
usage chunk says (`stream_options.include_usage`), and asks for exactly `OUTPUT_TOKENS` with
`max_tokens` and `ignore_eos`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_harness import Served, serving

from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.models.default_model import default_model_path
from baton_serve.router.gateway.gateway import GatewaySettings

MODEL = "SmolLM2-135M-Instruct.Q4_1"
OUTPUT_TOKENS = 16
REQUESTS = 12  # a count, not a time limit: no request is cut off by the end of the run
PROMPTS = [
    "Tell me about the sea.",
    "Name three colours.",
    "What is a cat?",
    "Write a haiku about rain.",
    "Why is the sky blue?",
    "Describe a tree.",
]


@pytest.fixture
def served() -> Iterator[Served]:
    settings = GatewaySettings(MODEL, str(default_model_path()), n_ctx=2048)
    with serving(settings, EngineConfig(n_ctx=2048, n_slots=1, n_threads=2)) as served:
        yield served


def _guidellm(url: str, route: str, folder: Path) -> dict:
    """One `guidellm benchmark` run over `route` (its endpoint type); the JSON report's only
    benchmark."""
    data = folder / "prompts.jsonl"
    rows = [{"prompt": prompt, "output_tokens_count": OUTPUT_TOKENS} for prompt in PROMPTS]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = folder / "report.json"
    env = {
        **os.environ,
        "GUIDELLM__PREFERRED_ROUTE": route,
        "HF_HUB_OFFLINE": "1",  # the prompts are a local file: nothing to fetch
        "HF_DATASETS_OFFLINE": "1",
    }
    command = [
        sys.executable, "-m", "guidellm", "benchmark",
        "--target", url,
        "--model", MODEL,
        "--data", str(data),
        "--rate-type", "concurrent",
        "--rate", "2",
        "--max-requests", str(REQUESTS),
        "--output-path", str(report),
        "--disable-progress",
    ]  # fmt: skip
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    return benchmark


def test_guidellm_streamed_chat_run_has_no_errors(served: Served, tmp_path: Path) -> None:
    benchmark = _guidellm(served.url, "chat_completions", tmp_path)
    totals = benchmark["request_totals"]
    assert totals["errored"] == totals["incomplete"] == 0, totals
    assert totals["successful"] == REQUESTS
    metrics = benchmark["metrics"]
    output_tokens = metrics["output_token_count"]["successful"]
    assert output_tokens["min"] == output_tokens["max"] == OUTPUT_TOKENS
    assert metrics["prompt_token_count"]["successful"]["min"] > 0
    first_token = metrics["time_to_first_token_ms"]["successful"]
    assert 0 < first_token["median"] <= first_token["percentiles"]["p99"]
