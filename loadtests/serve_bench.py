"""`baton bench serve`: what the Serve layer costs on top of the engine and the index.

Two figures:

- **routing overhead** — time in `BatonRouter.choose_replicas` and the staleness of the
  router's copy of the index (`routing_overhead`);
- **HTTP decode** — single-stream decode speed through the whole HTTP path (proxy, gateway,
  handle, replica, engine) against the same engine alone in this process: same model, engine
  settings, prompt and token count, greedy, `ignore_eos`.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import time
from pathlib import Path

import httpx

from baton_serve.cache_store.wire.protocol import GenerationRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.deploy.config import BatonConfig
from baton_serve.deploy.local_ray import local_ray
from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.loadtests.routing_overhead import BENCH_APP, format_routing, routing_overhead
from baton_serve.loadtests.serve_app import replica_stats, serve_app, wait_idle
from baton_serve.loadtests.sse import response_events
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig

# ---- HTTP decode ---------------------------------------------------------------------------

PROMPT = (
    "The lighthouse keeper kept a logbook of every ship that passed the point. "
    "Write the next entries of that logbook, one ship at a time, in plain sentences."
)
HTTP_TIMEOUT_S = 300.0
IDLE_TIMEOUT_S = 60.0
RATIO_TARGET = 0.9


def _engine_config(n_threads: int) -> EngineConfig:
    return EngineConfig(n_ctx=2048, n_slots=2, n_threads=n_threads)


def _rate(stamps: list[float]) -> float:
    """Content chunks per second, from the first chunk to the last."""
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return 0.0
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _run_row(started: float, stamps: list[float], completion_tokens: int) -> dict:
    return {
        "tokens_per_s": _rate(stamps),
        "content_chunks": len(stamps),
        "completion_tokens": completion_tokens,
        "first_chunk_s": stamps[0] - started if stamps else None,
        "decode_s": stamps[-1] - stamps[0] if stamps else 0.0,
    }


def _engine_runs(
    model: Path, config: EngineConfig, hmac_key: str, tokens: int, runs: int
) -> tuple[list[dict], int]:
    """The engine alone, in this process; each run iterates the handle's token events."""
    with Engine(str(model), config, hmac_key=hmac_key.encode()) as engine:
        prompt = engine.text_prompt(PROMPT)
        engine.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        engine.wait_idle(IDLE_TIMEOUT_S)
        sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        rows = []
        for _ in range(runs):
            started = time.perf_counter()
            handle = engine.submit(GenerationRequest(prompt=prompt, sampling=sampling))
            stamps = [time.perf_counter() for event in handle if event.text]
            done = handle.result()
            rows.append(_run_row(started, stamps, done.usage.completion_tokens))
            engine.wait_idle(IDLE_TIMEOUT_S)  # the reply's replay must not overlap the next run
    return rows, len(prompt)


def _stream_completion(client: httpx.Client, url: str, body: dict) -> tuple[dict, int]:
    """One streamed `POST /v1/completions`; the run's row and its prompt token count."""
    stamps: list[float] = []
    usage: dict = {}
    started = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"completion failed: HTTP {response.status_code}: {response.text}")
        for chunk in response_events(response):
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                usage = chunk["usage"]
    row = _run_row(started, stamps, usage.get("completion_tokens", 0))
    return row, usage.get("prompt_tokens", 0)


def _loop_stalls(stats: list[dict]) -> dict:
    """The replicas' event loops: the longest stall and the worst p99 of the last minute."""
    return {
        "max_ms": max(s["loop_stall_max_ms"] for s in stats),
        "p99_ms": max(s["loop_stall_p99_ms"] for s in stats),
    }


def _http_runs(
    model: Path, engine: EngineConfig, hmac_key: str, tokens: int, runs: int, http_port: int | None
) -> tuple[list[dict], int, dict]:
    config = BatonConfig(
        model=str(model),
        replicas=1,
        num_cpus_per_replica=1,
        engine=engine,
        hmac_key=hmac_key,
    )
    body = {
        "model": config.served_model_name,
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with (
        local_ray(num_cpus=2),
        serve_app(config, BENCH_APP, http_port) as url,
        httpx.Client(timeout=HTTP_TIMEOUT_S) as client,
    ):
        _stream_completion(client, url, {**body, "max_tokens": 4})  # warm-up
        asyncio.run(wait_idle(BENCH_APP))
        rows, prompt_tokens = [], 0
        for _ in range(runs):
            row, prompt_tokens = _stream_completion(client, url, body)
            rows.append(row)
            asyncio.run(wait_idle(BENCH_APP))
        stalls = _loop_stalls(asyncio.run(replica_stats(BENCH_APP)))
    return rows, prompt_tokens, stalls


def _summary(rows: list[dict]) -> dict:
    rates = [r["tokens_per_s"] for r in rows]
    return {
        "best_tokens_per_s": max(rates),
        "median_tokens_per_s": statistics.median(rates),
        "runs": rows,
    }


def http_decode(
    model: Path,
    *,
    tokens: int = 256,
    runs: int = 3,
    n_threads: int = 1,
    http_port: int | None = None,
    progress: Progress = SILENT,
) -> dict:
    """Single-stream decode tokens/s through HTTP vs the engine alone (best of `runs`),
    both with `EngineConfig(n_ctx=2048, n_slots=2, n_threads=n_threads)`.

    The engine is measured first, with no Serve app running (both share the CPUs). Serve is
    started on a free port and shut down at the end, unless `http_port` names the port of a
    Serve instance already running (then only the benchmark's app is added and deleted).
    """
    if tokens < 2 or runs < 1:
        raise ValueError("tokens must be >= 2 and runs >= 1")
    hmac_key = secrets.token_hex(16)
    config = _engine_config(n_threads)
    progress.step(f"decode: the engine alone, {runs} x {tokens} tokens")
    engine_rows, engine_prompt = _engine_runs(model, config, hmac_key, tokens, runs)
    progress.step(f"decode: through HTTP (starting the app), {runs} x {tokens} tokens")
    http_rows, http_prompt, stalls = _http_runs(model, config, hmac_key, tokens, runs, http_port)
    engine, http = _summary(engine_rows), _summary(http_rows)
    return {
        "model": str(model),
        "tokens": tokens,
        "runs": runs,
        "n_threads": n_threads,
        "prompt_tokens": {"engine": engine_prompt, "http": http_prompt},
        "engine": engine,
        "http": http,
        "ratio": http["best_tokens_per_s"] / engine["best_tokens_per_s"],
        "ratio_median": http["median_tokens_per_s"] / engine["median_tokens_per_s"],
        "target_ratio": RATIO_TARGET,
        "loop_stall": stalls,
    }


# ---- both ----------------------------------------------------------------------------------


def serve_benchmark(
    model: Path, redis_url: str | None, progress: Progress = SILENT, *, router_replicas: int = 8
) -> dict:
    """Routing overhead (Redis at `redis_url` or a private server, and embedded; decisions
    among `router_replicas` replicas) and HTTP decode speed of `model`, on one local Ray
    runtime (started here if none is running)."""
    with local_ray(num_cpus=2):
        routing = routing_overhead(redis_url, replicas=router_replicas, progress=progress)
        return {"routing": routing, "http_decode": http_decode(model, progress=progress)}


def format_http(result: dict) -> str:
    e, h = result["engine"], result["http"]
    verdict = "met" if result["ratio"] >= result["target_ratio"] else "NOT met"
    return "\n".join(
        [
            f"decode: {result['model']}, one stream, {result['tokens']} tokens (ignore_eos, greedy),"
            f" prompt {result['prompt_tokens']['engine']} tokens, {result['n_threads']} llama.cpp"
            f" thread(s), best of {result['runs']}",
            f"  engine alone:  {e['best_tokens_per_s']:7.1f} tok/s (median {e['median_tokens_per_s']:.1f})",
            f"  through HTTP:  {h['best_tokens_per_s']:7.1f} tok/s (median {h['median_tokens_per_s']:.1f})",
            f"  HTTP / engine: {result['ratio']:.3f} (median {result['ratio_median']:.3f});"
            f" target >= {result['target_ratio']:g}: {verdict}",
            f"  replica event loop: longest stall {result['loop_stall']['max_ms']:.1f} ms,"
            f" p99 {result['loop_stall']['p99_ms']:.1f} ms (last minute, this app's replica)",
        ]
    )


def format_report(result: dict) -> str:
    """A `serve_benchmark` result, or either part of one on its own."""
    parts = []
    if "routing" in result or "backends" in result:
        parts.append(format_routing(result.get("routing", result)))
    if "http_decode" in result or "engine" in result:
        parts.append(format_http(result.get("http_decode", result)))
    return "\n\n".join(parts)
