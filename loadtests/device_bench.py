"""`baton bench device`: one process, two engines on the device (every layer offloaded).

Engine A (one slot) serves, per context length, a few times each: a cold prompt (prefill
tok/s and TTFT), then a cached follow-up (the same prompt plus `NEW_TOKENS`) while the slot
still holds the prompt: resident, nothing copied (a partial state loaded to rewind the slot
would be counted apart; no attention KV ever is). Once A is idle it stores that conversation's full state (save GB/s, device → host,
timed with the device idle); a short other prompt then takes the slot, and the
conversation's next turn restores the stored state whole (restore GB/s, host → device, and
its TTFT). Then A exports that checkpoint as the signed wire blob, exactly what a peer pull
sends, and engine B imports it (every check: length, checksum, fingerprint, HMAC) and
continues from it: B's greedy continuation must equal A's. The network is not included
(`bench ship` measures that). An engine of its own (as many slots as the most streams)
measures decode tok/s first: each count of streams (`streams`: 1, 4, 16, ...) timed alike,
from the first token to the last stream's end, after a warm-up run, with where a decode
step's time goes (the llama_decode call with its logits read back, sampling, the rest).
With `peer`, llama.cpp's own tools follow on the same model and device: llama-batched-bench
(the same stream counts and prompts) and llama-server on `bench peer`'s multi-turn workload
against the engine alone (`engine_peer`).

Nothing here imports Ray, Redis or locust: the bench runs where only llama.cpp does.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import Completion, GenerationRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.loadtests.batched_bench import BatchedBenchSettings, batched_bench
from baton_serve.loadtests.engine_bench import ALL_CORES, BENCH_HMAC_KEY
from baton_serve.loadtests.engine_peer import engine_peer_benchmark
from baton_serve.loadtests.peer_workload import PeerWorkload
from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.replicas.engine import ggml_backends
from baton_serve.replicas.engine.checkpoint_policy import MIN_PIECE
from baton_serve.replicas.engine.device_memory import device_memory as engine_device_memory
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.engine_face import EngineFace

NEW_TOKENS = 64  # what a follow-up adds to the cold prompt
CONTINUATION_TOKENS = 16  # greedy tokens compared after the ship
NEXT_TURN_TOKENS = 4  # what the conversation's turn restored from host memory adds
OTHER_TOKENS = 16  # the prompt run between a cold prompt and its follow-up
DECODE_TOKENS = 64
DECODE_RUNS = 3
STREAMS = (1, 4)  # decoding streams timed together, the default
ONE_TOKEN = SamplingParams(max_tokens=1)
# Stored once idle: replayed where reuse is exact; else the decode's state, which holds all
# but the last token and is stored from two tokens on.
SHORT_REPLY = SamplingParams(max_tokens=3, ignore_eos=True)


@dataclass(frozen=True)
class DeviceSettings:
    """What `device_benchmark` runs: the model, where, and at which context lengths."""

    model: Path
    contexts: tuple[int, ...] = (2048, 8192)
    n_gpu_layers: int = -1
    repeats: int = 5
    threads: int = ALL_CORES
    n_ctx: int | None = None  # default: the longest context
    prefill_chunk: int = 256
    store_bytes: int = 4 << 30
    decode_tokens: int = DECODE_TOKENS  # per stream, in the decode figures
    streams: tuple[int, ...] = STREAMS  # streams decoding together, each count timed
    peer: bool = False  # also llama.cpp's llama-batched-bench and llama-server, same device
    chat: PeerWorkload = PeerWorkload()  # the peer's multi-turn workload (`bench peer`'s)

    def __post_init__(self) -> None:
        if not self.streams or min(self.streams) < 1:
            raise ValueError(f"streams must each be at least 1, got {self.streams}")
        if not self.contexts or min(self.contexts) < 2 * (NEW_TOKENS + CONTINUATION_TOKENS):
            least = 2 * (NEW_TOKENS + CONTINUATION_TOKENS)
            raise ValueError(f"contexts must each be at least {least} tokens, got {self.contexts}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}")
        if self.n_ctx is not None and self.n_ctx < max(self.contexts):
            raise ValueError(
                f"n_ctx {self.n_ctx} is below the longest context {max(self.contexts)}"
            )


def device_memory() -> list[dict]:
    """Free and total bytes of each device llama.cpp offloads to (as ggml reports them)."""
    found = []
    for device in ggml_backends.offload_devices():
        name = device.split(": ", 1)[0]
        free, total = engine_device_memory(name)
        found.append({"device": name, "free_bytes": free, "total_bytes": total})
    return found


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p95 and p99 of `values` (linear interpolation between samples)."""
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}


def _tokens(rng: random.Random, n_vocab: int, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, n_vocab) for _ in range(n))


def _rate(n_bytes: float, seconds: float) -> float | None:
    return n_bytes / seconds / 1e9 if seconds > 0 else None


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def decode_speeds(
    model: Path, config: EngineConfig, streams: tuple[int, ...], tokens: int = DECODE_TOKENS
) -> dict:
    """Decode tok/s of each count of `streams`, on an engine of its own with a slot for each
    of the most (A and B have one slot each: a blob is for engines of one config)."""
    config = config.model_copy(update={"n_slots": max(streams), "n_ctx": 256})
    with Engine(str(model), config, hmac_key=BENCH_HMAC_KEY) as engine:
        return _decode_speeds(engine, streams, tokens)


def _decode_speeds(engine: EngineFace, streams: tuple[int, ...], tokens: int) -> dict:
    """Every count of streams timed alike: the tokens decoded after each first token, over
    the time from the first stream's first token to the last stream's end (no prompt, save
    or restore in it), medians of `DECODE_RUNS` after a warm-up run; and per decode step,
    the llama_decode call (logits read back included) and the sampling, in ms."""
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    rng = random.Random(1)
    n_vocab = engine.model.n_vocab
    stats = engine.stats

    def decode_rate(count: int) -> tuple[float, dict]:
        steps, call, sample = (
            stats.decode_only_steps,
            stats.decode_call_seconds,
            stats.sample_seconds,
        )
        prompts = [Prompt(tokens=_tokens(rng, n_vocab, 32)) for _ in range(count)]
        handles = [engine.submit(GenerationRequest(prompt=p, sampling=sampling)) for p in prompts]
        rate = _decode_rate([h.result() for h in handles])
        engine.wait_idle()  # replays and stores done: none in the next run's decode
        done = max(1, stats.decode_only_steps - steps)
        step = {
            "decode_call_ms": (stats.decode_call_seconds - call) / done * 1e3,
            "sample_ms": (stats.sample_seconds - sample) / done * 1e3,
        }
        return rate, step

    decode_rate(max(streams))  # warm-up: every slot's graph built once
    rates, steps = {}, {}
    for count in streams:
        runs = sorted((decode_rate(count) for _ in range(DECODE_RUNS)), key=lambda r: r[0])
        rates[count], steps[count] = runs[len(runs) // 2]  # the median run
    single = rates.get(1)
    return {
        "streams": list(streams),
        "tokens_per_s": {str(n): rate for n, rate in rates.items()},
        "speedup": {str(n): rate / single for n, rate in rates.items() if single},
        "step": {str(n): step for n, step in steps.items()},
    }


def _decode_rate(results: list[Completion]) -> float:
    """Tokens a second decoded by requests submitted together, between the first one's
    first token and the last one's end (each request's times count from its submission:
    `queued_s` plus its own phases)."""
    first = min(r.timings.queued_s + (r.ttft_s or 0.0) for r in results)
    end = max(r.timings.queued_s + r.total_s for r in results)
    decoded = sum(max(0, r.usage.completion_tokens - 1) for r in results)
    return decoded / (end - first) if end > first else 0.0


def context_figures(
    a: EngineFace, b: EngineFace, context: int, repeats: int, progress: Progress = SILENT
) -> dict:
    """Cold vs cached TTFT (resident, and restored from host memory), prefill tok/s, save
    and restore GB/s of full states on A, then A → B ship."""
    rng = random.Random(context)
    n_vocab = a.model.n_vocab
    # the context holds the whole conversation: prompt, follow-up, reply, next turn, continuation
    n_cold = context - NEW_TOKENS - SHORT_REPLY.max_tokens - NEXT_TURN_TOKENS - CONTINUATION_TOKENS
    cold_ttft, cached_ttft, restored_ttft, prefill, saves, restores = [], [], [], [], [], []
    state_bytes = cached = rewound = 0
    for run in range(1, repeats + 1):
        cold, new = _tokens(rng, n_vocab, n_cold), _tokens(rng, n_vocab, NEW_TOKENS)
        done = a.generate(Prompt(tokens=cold), ONE_TOKEN)
        if done.usage.cached_tokens:
            raise RuntimeError(f"a cold prompt found {done.usage.cached_tokens} tokens cached")
        cold_ttft.append(done.ttft_s or 0.0)
        prefill.append(n_cold / done.timings.prefill_s)
        # Resident: the slot still holds the cold prompt; nothing is copied.
        follow = a.generate(Prompt(tokens=cold + new), SHORT_REPLY)
        cached, rewound = follow.usage.cached_tokens, follow.timings.rewound_bytes
        cached_ttft.append(follow.ttft_s or 0.0)
        history = cold + new + tuple(follow.tokens)
        saves.append(_stored_once_idle(a))
        a.generate(Prompt(tokens=_tokens(rng, n_vocab, OTHER_TOKENS)), ONE_TOKEN)  # takes A's slot
        # From host memory: the conversation stored once A was idle, restored whole.
        restore_s = a.stats.restore_seconds
        back = a.generate(Prompt(tokens=history + new[:NEXT_TURN_TOKENS]), ONE_TOKEN)
        restored_ttft.append(back.ttft_s or 0.0)
        stored = len(history) - (0 if a.config.exact_reuse else 1)
        if back.usage.cached_tokens == stored:
            state_bytes = back.timings.restored_bytes
            restores.append(_rate(state_bytes, a.stats.restore_seconds - restore_s))
        progress.step(
            f"{context} tokens: TTFT {cold_ttft[-1]:.3f} s cold, {cached_ttft[-1]:.3f} s"
            f" cached (resident), {restored_ttft[-1]:.3f} s cached (from host memory)",
            done=run,
        )
    progress.step(f"{context} tokens: shipping A -> B")
    return {
        "context": context,
        "cold_prompt_tokens": n_cold,
        "follow_prompt_tokens": n_cold + NEW_TOKENS,
        "cached_tokens": cached,
        "rewound_bytes": rewound,
        "prefill_tokens_per_s": statistics.median(prefill),
        "ttft_cold_s": percentiles(cold_ttft),
        "ttft_cached_s": percentiles(cached_ttft),
        "ttft_restored_s": percentiles(restored_ttft),
        "checkpoint_bytes": state_bytes,
        "save_gb_per_s": _median(saves),
        "restore_gb_per_s": _median(restores),
        "ship": ship(a, b, history + new[:NEXT_TURN_TOKENS]),
    }


def _stored_once_idle(engine: EngineFace) -> float | None:
    """GB/s of the full state A stores of a finished conversation once it is idle (None if
    it stored another number of them)."""
    stats = engine.stats
    saved, seconds, count = stats.saved_bytes, stats.save_seconds, stats.written_back
    engine.wait_idle()
    if stats.written_back - count != 1:
        return None
    return _rate(stats.saved_bytes - saved, stats.save_seconds - seconds)


def ship(a: EngineFace, b: EngineFace, tokens: tuple[int, ...]) -> dict:
    """A's checkpoint of `tokens` as the signed wire blob into B, and B continuing from it;
    B's greedy continuation must equal A's."""
    started = time.perf_counter()
    found = a.export_best(tokens[:-MIN_PIECE])  # the engine computes at least the last two
    export_s = time.perf_counter() - started
    if found is None:
        raise RuntimeError(f"engine A holds no checkpoint of the {len(tokens)}-token follow-up")
    (head, state), _shared = found
    started = time.perf_counter()
    wire = b"".join((head, state))  # what the network would deliver, in one piece
    copy_s = time.perf_counter() - started
    started = time.perf_counter()
    checkpoint = b.import_checkpoint(wire)
    import_s = time.perf_counter() - started
    restore_before = b.stats.restore_seconds
    greedy = SamplingParams(max_tokens=CONTINUATION_TOKENS)
    on_b = b.generate(Prompt(tokens=tokens), greedy)
    restore_s = b.stats.restore_seconds - restore_before
    if on_b.usage.cached_tokens != checkpoint.n_tokens:
        raise RuntimeError(
            f"engine B reused {on_b.usage.cached_tokens} tokens, not the shipped "
            f"{checkpoint.n_tokens}"
        )
    on_a = a.generate(Prompt(tokens=tokens), greedy)
    if on_b.tokens != on_a.tokens:
        raise RuntimeError(f"B continued {on_b.tokens} after the ship, A {on_a.tokens}")
    end_to_end = export_s + import_s + restore_s
    return {
        "tokens": checkpoint.n_tokens,
        "blob_bytes": len(wire),
        "state_bytes": len(checkpoint.state),
        "export_s": export_s,
        "copy_s": copy_s,
        "import_s": import_s,
        "restore_s": restore_s,
        "end_to_end_s": end_to_end,
        "gb_per_s": _rate(len(checkpoint.state), end_to_end),
        "ttft_on_b_s": on_b.ttft_s,
        "continuation": on_b.tokens,
        "continuation_matches": True,
    }


def device_benchmark(settings: DeviceSettings, progress: Progress = SILENT) -> dict:
    """Every figure of `baton bench device`, as one JSON-ready object."""
    backend = ggml_backends.ensure_loaded()
    memory = {"before": device_memory()}
    n_ctx = settings.n_ctx or max(settings.contexts)
    config = EngineConfig(
        n_ctx=n_ctx,
        n_slots=1,
        n_threads=settings.threads,
        n_gpu_layers=settings.n_gpu_layers,
        prefill_chunk=settings.prefill_chunk,
        n_batch=max(settings.prefill_chunk, EngineConfig.model_fields["n_batch"].default),
        checkpoint_interval=0,  # one checkpoint per prompt, two tokens before its end
        store_budget_bytes=settings.store_bytes,
    )
    counts = ", ".join(map(str, settings.streams))
    progress.step(f"decode: {counts} streams ({settings.model.name})")
    decode = decode_speeds(settings.model, config, settings.streams, settings.decode_tokens)
    progress.step(f"loading two engines (n_ctx {n_ctx})")
    with (
        Engine(str(settings.model), config, hmac_key=BENCH_HMAC_KEY) as a,
        Engine(str(settings.model), config, hmac_key=BENCH_HMAC_KEY) as b,
    ):
        if a.n_ctx < max(settings.contexts):
            raise ValueError(
                f"the engine's context is {a.n_ctx} tokens (the model's training context is "
                f"{a.model.n_ctx_train}): below the longest context {max(settings.contexts)}"
            )
        for engine in (a, b):  # the device's first run compiles its kernels
            engine.generate(Prompt(tokens=(a.model.any_token,) * 8), ONE_TOKEN)
        memory["loaded"] = device_memory()
        rows = []
        for context in settings.contexts:
            progress.start(settings.repeats)
            rows.append(context_figures(a, b, context, settings.repeats, progress))
        memory["end"] = device_memory()
        result = {
            "model": str(settings.model),
            "model_kind": a.model.kind.value,
            "device": a.model.device,
            "devices": list(a.model.devices),
            "n_gpu_layers": settings.n_gpu_layers,
            "exact_reuse": a.config.exact_reuse,
            "flash_attn": a.config.flash_attn,
            "threads": settings.threads,
            "n_ctx": a.n_ctx,
            "prefill_chunk": settings.prefill_chunk,
            "repeats": settings.repeats,
            "cpu_backend": backend.name,
            "device_memory": memory,
            "decode": decode,
            "contexts": rows,
            "network_included": False,
        }
    if settings.peer:  # once the engines have given the device back
        progress.step("llama-batched-bench on the same model and device")
        attention = result["flash_attn"]
        result["peer"] = batched_bench(
            settings.model,
            BatchedBenchSettings(settings.threads, settings.n_gpu_layers, attention),
            streams=settings.streams,
            decode_tokens=settings.decode_tokens,
            prompts=tuple(row["cold_prompt_tokens"] for row in result["contexts"]),
        )
        n = settings.chat.requests()
        progress.step(f"the multi-turn workload ({n} requests): the engine, then llama-server")
        chat = EngineConfig(  # as `baton serve` configures an engine, on this device
            n_slots=settings.chat.concurrency,
            n_threads=settings.threads,
            n_gpu_layers=settings.n_gpu_layers,
        )
        result["peer_chat"] = engine_peer_benchmark(
            settings.model,
            chat,
            settings.chat,
            lambda side, k: progress.step(f"multi-turn, {side}: request {k}/{n}"),
        )
    return result
