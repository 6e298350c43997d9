"""`baton bench sampling`: what llama.cpp's sampler chain costs per token, against the numpy
sampler it replaced, and what a JSON-Schema grammar costs, on one engine (one stream, cache
off).

Decode tokens/s are measured on the engine with the chain. The numpy sampler is no longer in
the engine, so its decode rate is derived: the chain's measured time per decoded token, less
the chain's sampling time per token, plus the numpy sampler's — both sampling times measured
on the same real logits rows of the model.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.engine_face import EngineFace
from baton_serve.replicas.engine.sampling import TokenSampler
from baton_serve.router.gateway.structured_output import schema_grammar

BENCH_HMAC_KEY = b"baton-bench-only"
ROWS = 32  # real logits rows for the per-token sampling times
REPEATS = 20  # passes over the rows per sampler
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "temperature_c": {"type": "number"},
        "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
        "hourly": {"type": "array", "maxItems": 6, "items": {"type": "integer"}},
    },
    "required": ["city", "temperature_c", "conditions", "hourly"],
}
GREEDY = SamplingParams()
TEMPERATURE = SamplingParams(temperature=0.8, top_p=0.95, seed=7)


class NumpySampler:
    """The sampler Baton used before llama.cpp's chain, kept here only as this benchmark's
    baseline: greedy argmax, or temperature, top-p and a seeded draw over a numpy row."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / p.temperature
        if 0 < p.top_k < scaled.size:
            ids = np.argpartition(scaled, -p.top_k)[-p.top_k :]
        else:
            ids = np.arange(scaled.size)
        order = ids[np.argsort(scaled[ids])[::-1]]
        probs = np.exp(scaled[order] - scaled[order[0]])
        probs /= probs.sum()
        keep = probs.size
        if p.top_p < 1.0:
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
        probs = probs[:keep] / probs[:keep].sum()
        return int(self._rng.choice(order[:keep], p=probs))


def sampling_benchmark(
    model: Path, *, tokens: int = 128, runs: int = 5, progress: Progress = SILENT
) -> dict:
    config = EngineConfig(n_ctx=2048, n_slots=1, prefix_cache=False)
    with Engine(str(model), config, hmac_key=BENCH_HMAC_KEY) as engine:
        n_vocab = engine.model.n_vocab
        progress.start(3 * runs + 2)
        rows = _logits_rows(engine)
        progress.step("captured logits rows")
        sample_us = {
            name: {
                "chain": _per_token_us(functools.partial(_ChainRun, params, n_vocab), rows),
                "numpy": _per_token_us(functools.partial(NumpySampler, params), rows),
            }
            for name, params in (("greedy", GREEDY), ("temperature", TEMPERATURE))
        }
        progress.step("timed the samplers on them")
        prompt = engine.text_prompt("Report today's weather as JSON for a city you pick.")
        grammar = schema_grammar(SCHEMA)
        fixed = {"max_tokens": tokens, "ignore_eos": True}
        decode = {
            "greedy": _decode_rates(
                engine, prompt, GREEDY.model_copy(update=fixed), runs, progress
            ),
            "temperature": _decode_rates(
                engine, prompt, TEMPERATURE.model_copy(update=fixed), runs, progress
            ),
            "temperature_json_schema": _decode_rates(
                engine,
                prompt,
                TEMPERATURE.model_copy(update={"max_tokens": tokens, "grammar": grammar}),
                runs,
                progress,
            ),
        }
    derived = {
        name: 1.0
        / (
            1.0 / decode[name]["median"]
            - sample_us[name]["chain"]["mean"] / 1e6
            + sample_us[name]["numpy"]["mean"] / 1e6
        )
        for name in ("greedy", "temperature")
    }
    ratios = {
        "chain_over_numpy_greedy": decode["greedy"]["median"] / derived["greedy"],
        "chain_over_numpy_temperature": decode["temperature"]["median"] / derived["temperature"],
        "json_schema_over_none": decode["temperature_json_schema"]["median"]
        / decode["temperature"]["median"],
    }
    return {
        "model": model.name,
        "n_vocab": n_vocab,
        "sample_us_per_token": sample_us,
        "decode_tokens_per_s": decode,
        "numpy_decode_tokens_per_s_derived": derived,
        "ratios": ratios,
        "targets": {
            # to the percent: decode rates spread by ±10% from run to run
            "chain_over_numpy >= 1.0": round(
                min(ratios["chain_over_numpy_greedy"], ratios["chain_over_numpy_temperature"]), 2
            )
            >= 1.0,
            "json_schema_over_none >= 0.7": round(ratios["json_schema_over_none"], 2) >= 0.7,
        },
    }


class _ChainRun:
    """The engine's use of a `TokenSampler`: pick, then accept."""

    def __init__(self, params: SamplingParams, n_vocab: int) -> None:
        self._sampler = TokenSampler(params, n_vocab)

    def __call__(self, logits: np.ndarray) -> int:
        token = self._sampler(logits)
        assert token is not None
        self._sampler.accept(token)
        return token


def _logits_rows(engine: EngineFace) -> list[np.ndarray]:
    """The model's own next-token logits along a greedy reply to a chat prompt: the rows a
    sampler meets while decoding text (rows after random tokens are far flatter)."""
    prompt = engine.chat_prompt(
        [{"role": "user", "content": "Tell me a story about a lighthouse."}]
    )
    reply = engine.generate(prompt, SamplingParams(max_tokens=ROWS, ignore_eos=True)).tokens
    rows = []
    for k in range(ROWS):
        context = Prompt(tokens=prompt.tokens + tuple(reply[:k]))
        done = engine.generate(context, SamplingParams(max_tokens=1), return_logits=True)
        assert done.logits is not None
        rows.append(done.logits)
    return rows


def _per_token_us(
    make: Callable[[], Callable[[np.ndarray], int]], rows: list[np.ndarray]
) -> dict[str, float]:
    """Microseconds per sampled token over `REPEATS` passes (a fresh sampler each): the
    mean (what decode throughput pays) and the p50 / p95 / p99 of single tokens."""
    times = []
    for _ in range(REPEATS):
        sample = make()
        for row in rows:
            started = time.perf_counter()
            sample(row)
            times.append((time.perf_counter() - started) * 1e6)
    p50, p95, p99 = (float(p) for p in np.percentile(times, [50, 95, 99]))
    return {"mean": statistics.fmean(times), "p50": p50, "p95": p95, "p99": p99}


def _decode_rates(
    engine: EngineFace, prompt: Prompt, sampling: SamplingParams, runs: int, progress: Progress
) -> dict:
    rates, lengths = [], []
    for _ in range(runs):
        done = engine.generate(prompt, sampling)
        generated = done.usage.completion_tokens
        rates.append((generated - 1) / done.timings.decode_s)
        lengths.append(generated)
        progress.step(f"decode {rates[-1]:.1f} tok/s")
    return {
        "median": statistics.median(rates),
        "min": min(rates),
        "max": max(rates),
        "tokens": lengths,
    }


def format_report(result: dict) -> str:
    us = result["sample_us_per_token"]
    decode = result["decode_tokens_per_s"]
    derived = result["numpy_decode_tokens_per_s_derived"]
    lines = [
        f"model: {result['model']} ({result['n_vocab']}-token vocabulary), 1 stream, cache off",
        f"sampling time per token ({REPEATS} passes over {ROWS} real logits rows), µs:",
        *(
            f"  {name:<12} {sampler:<6} mean {t['mean']:8.1f}   p50 {t['p50']:8.1f}"
            f"   p95 {t['p95']:8.1f}   p99 {t['p99']:8.1f}"
            for name in ("greedy", "temperature")
            for sampler, t in us[name].items()
        ),
        "  (temperature: 0.8, top_p 0.95, seeded)",
        "decode tokens/s (median [min-max] of the runs):",
    ]
    for name, label in (
        ("greedy", "greedy, chain"),
        ("temperature", "temperature, chain"),
        ("temperature_json_schema", "temperature, chain + JSON-schema grammar"),
    ):
        d = decode[name]
        lines.append(f"  {label:<42} {d['median']:6.1f} [{d['min']:.1f}-{d['max']:.1f}]")
    for name in ("greedy", "temperature"):
        lines.append(f"  {name + ', numpy (derived)':<42} {derived[name]:6.1f}")
    lines.append("ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in result["ratios"].items()))
    lines.append("targets:")
    lines += [f"  {name}: {'met' if met else 'NOT met'}" for name, met in result["targets"].items()]
    return "\n".join(lines)
