"""`baton bench engine`: multi-turn chat on one engine, prefix cache on against off.

Each turn sends the whole conversation so far (a long system prompt, earlier turns and
replies, a new user message). With the cache on, the engine should compute only the
tokens that are new in each turn; with it off, the whole prompt every turn.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from baton_serve.cache_store.prefix_hash import common_prefix_length
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import Completion, GenerationRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.loadtests.decode_beside_prompts import decode_beside_prompts, format_beside
from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.loadtests.synthetic_text import filler_text
from baton_serve.replicas.engine import ggml_backends
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.engine_face import EngineFace

BENCH_HMAC_KEY = b"baton-bench-only"


@dataclass
class TurnRow:
    turn: int
    prompt_tokens: int
    new_tokens: int
    cached_tokens: int
    computed_tokens: int
    ttft_s: float  # from admission: `restore_s` is part of it
    computed_tokens_no_cache: int
    ttft_s_no_cache: float
    restore_s: float = 0.0  # the cache-on request's slot readied (`Timings.restore_s`)
    restored_bytes: int = 0  # that request's own full-state copies (`Timings`)
    saved_bytes: int = 0
    partial_bytes: int = 0  # its partial states (no attention KV): anchors kept, rewinds
    # Everything the cache-on engine copied over the turn: the request's, plus the rewind
    # and the replay after its reply, and the conversation stored once idle.
    turn_restored_bytes: int = 0
    turn_saved_bytes: int = 0
    turn_partial_bytes: int = 0


SPEED_PROMPT_TOKENS = 1024
SPEED_DECODE_TOKENS = 64
SPEED_RUNS = 5
ALL_CORES = os.cpu_count() or 1  # the engine's default


def raw_speed(
    model: Path, *, cpu_repack: bool | None, threads: int = ALL_CORES, progress: Progress = SILENT
) -> dict:
    """Prefill and single-stream decode tokens/s with the cache off, over `SPEED_RUNS` runs."""
    config = EngineConfig(
        n_ctx=2048, n_slots=1, prefix_cache=False, cpu_repack=cpu_repack, n_threads=threads
    )
    with Engine(str(model), config, hmac_key=BENCH_HMAC_KEY) as engine:
        n_vocab = engine.model.n_vocab
        prompt = Prompt(
            tokens=tuple((i * 7919) % (n_vocab - 3) + 3 for i in range(SPEED_PROMPT_TOKENS))
        )
        sampling = SamplingParams(max_tokens=SPEED_DECODE_TOKENS, ignore_eos=True)
        engine.generate(Prompt(tokens=prompt.tokens[:64]), SamplingParams(max_tokens=4))
        prefill, decode = [], []
        progress.start(SPEED_RUNS)
        for run in range(1, SPEED_RUNS + 1):
            done = engine.generate(prompt, sampling)
            prefill.append(len(prompt) / done.timings.prefill_s)
            decode.append((done.usage.completion_tokens - 1) / done.timings.decode_s)
            progress.step(
                f"speed run: prefill {prefill[-1]:.0f} tok/s, decode {decode[-1]:.0f} tok/s",
                done=run,
            )
        return {
            "cpu_repack": engine.model.cpu_repack,
            "prefill_tokens_per_s": statistics.median(prefill),
            "prefill_tokens_per_s_range": [min(prefill), max(prefill)],
            "decode_tokens_per_s": statistics.median(decode),
            "decode_tokens_per_s_range": [min(decode), max(decode)],
        }


def run_chat(
    model: Path,
    *,
    turns: int,
    system_tokens: int,
    turn_tokens: int,
    reply_tokens: int,
    n_ctx: int,
    cpu_repack: bool | None = None,
    threads: int = ALL_CORES,
    progress: Progress = SILENT,
) -> list[TurnRow]:
    """The same conversation on two engines (cache on / off); one row per turn."""
    config = EngineConfig(n_ctx=n_ctx, n_slots=2, cpu_repack=cpu_repack, n_threads=threads)
    with (
        Engine(str(model), config, hmac_key=BENCH_HMAC_KEY) as cached,
        Engine(
            str(model), config.model_copy(update={"prefix_cache": False}), hmac_key=BENCH_HMAC_KEY
        ) as plain,
    ):
        count = lambda text: len(cached.model.tokenize(text))  # noqa: E731
        messages = [{"role": "system", "content": filler_text(system_tokens, count, seed=0)}]
        sampling = SamplingParams(max_tokens=reply_tokens, ignore_eos=True)
        history: list[int] = []
        rows = []
        progress.start(turns)
        for turn in range(1, turns + 1):
            question = filler_text(turn_tokens, count, seed=turn, topic=f"Question {turn}:")
            messages.append({"role": "user", "content": question})
            prompt = cached.chat_prompt(messages)
            saved, restored = cached.stats.saved_bytes, cached.stats.restored_bytes
            partial = _partial_bytes(cached)
            on = cached.generate(prompt, sampling)
            off = plain.generate(prompt, sampling)
            cached.wait_idle()  # its replay done, so the turn's copies are all counted
            rows.append(
                TurnRow(
                    turn=turn,
                    prompt_tokens=len(prompt),
                    new_tokens=len(prompt) - common_prefix_length(history, prompt.tokens),
                    cached_tokens=on.usage.cached_tokens,
                    computed_tokens=on.usage.computed_tokens,
                    ttft_s=on.ttft_s or 0.0,
                    computed_tokens_no_cache=off.usage.computed_tokens,
                    ttft_s_no_cache=off.ttft_s or 0.0,
                    restore_s=on.timings.restore_s,
                    restored_bytes=on.timings.restored_bytes,
                    saved_bytes=on.timings.saved_bytes,
                    partial_bytes=on.timings.anchor_bytes + on.timings.rewound_bytes,
                    turn_restored_bytes=cached.stats.restored_bytes - restored,
                    turn_saved_bytes=cached.stats.saved_bytes - saved,
                    turn_partial_bytes=_partial_bytes(cached) - partial,
                )
            )
            history = list(prompt.tokens) + on.tokens
            row = rows[-1]
            progress.step(
                f"turn {turn}: computed {row.computed_tokens} vs"
                f" {row.computed_tokens_no_cache} tokens, TTFT {row.ttft_s:.2f} vs"
                f" {row.ttft_s_no_cache:.2f} s (cache on vs off), restored"
                f" {_mb(row.restored_bytes)} MB + {_mb(row.partial_bytes)} MB partial in"
                f" {row.restore_s:.3f} s",
                done=turn,
            )
            messages.append({"role": "assistant", "content": on.text})
    return rows


def _partial_bytes(engine: EngineFace) -> int:
    return engine.stats.anchor_bytes + engine.stats.rewound_bytes


def decode_throughput(
    model: Path, *, streams: int, tokens: int, n_ctx: int, threads: int = ALL_CORES
) -> float:
    """Aggregate generated tokens per second with `streams` concurrent requests."""
    config = EngineConfig(n_ctx=n_ctx, n_slots=streams, n_threads=threads)
    with Engine(str(model), config, hmac_key=BENCH_HMAC_KEY) as engine:
        sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
        prompts = [
            engine.text_prompt(f"Stream {i} writes a story about number {i}.")
            for i in range(streams)
        ]
        engine.generate(prompts[0], SamplingParams(max_tokens=4))  # warm-up
        started = time.perf_counter()
        handles = [engine.submit(GenerationRequest(prompt=p, sampling=sampling)) for p in prompts]
        results: list[Completion] = [h.result() for h in handles]
        elapsed = time.perf_counter() - started
    return sum(r.usage.completion_tokens for r in results) / elapsed


def engine_benchmark(
    model: Path,
    *,
    turns: int = 10,
    system_tokens: int = 2000,
    turn_tokens: int = 100,
    reply_tokens: int = 32,
    concurrency: int = 0,
    cpu_repack: bool | None = None,
    threads: int = ALL_CORES,
    progress: Progress = SILENT,
) -> dict:
    n_ctx = system_tokens + turns * (turn_tokens + reply_tokens + 32) + 256
    backend = ggml_backends.ensure_loaded()
    progress.step("loading the model for the speed runs")
    speed = raw_speed(model, cpu_repack=cpu_repack, threads=threads, progress=progress)
    progress.step("multi-turn chat: loading two engines (cache on, cache off)")
    rows = run_chat(
        model,
        turns=turns,
        system_tokens=system_tokens,
        turn_tokens=turn_tokens,
        reply_tokens=reply_tokens,
        n_ctx=n_ctx,
        cpu_repack=cpu_repack,
        threads=threads,
        progress=progress,
    )
    result: dict = {
        "model": str(model),
        "threads": threads,
        "cpu_backend": backend.name,
        "system_info": ggml_backends.system_info(),
        "speed": speed,
    } | chat_figures(rows)
    if concurrency > 1:
        progress.step(f"decode throughput: 1 stream, then {concurrency}")
        one = decode_throughput(model, streams=1, tokens=64, n_ctx=512, threads=threads)
        many = decode_throughput(model, streams=concurrency, tokens=64, n_ctx=512, threads=threads)
        result["decode_tokens_per_s"] = {"1": one, str(concurrency): many, "speedup": many / one}
        progress.step("decoding streams beside long prompts: cache on, then off")
        result["decode_beside_prompts"] = decode_beside_prompts(
            model, system_tokens=system_tokens, threads=threads, hmac_key=BENCH_HMAC_KEY
        )
    return result


def chat_figures(rows: list[TurnRow]) -> dict:
    """The multi-turn chat's part of the result: each turn, and the totals."""
    new = sum(r.new_tokens for r in rows)
    return {
        "turns": [asdict(r) for r in rows],
        "new_tokens": new,
        "computed_tokens": sum(r.computed_tokens for r in rows),
        "computed_tokens_no_cache": sum(r.computed_tokens_no_cache for r in rows),
        "computed_over_new": sum(r.computed_tokens for r in rows) / new,
        "computed_over_new_no_cache": sum(r.computed_tokens_no_cache for r in rows) / new,
        "ttft_total_s": sum(r.ttft_s for r in rows),
        "ttft_total_s_no_cache": sum(r.ttft_s_no_cache for r in rows),
        "restore_total_s": sum(r.restore_s for r in rows),
        "restored_bytes": sum(r.restored_bytes for r in rows),
        "saved_bytes": sum(r.saved_bytes for r in rows),
        "turn_restored_bytes": sum(r.turn_restored_bytes for r in rows),
        "turn_saved_bytes": sum(r.turn_saved_bytes for r in rows),
        "partial_bytes": sum(r.partial_bytes for r in rows),
        "turn_partial_bytes": sum(r.turn_partial_bytes for r in rows),
    }


def _rate(speed: dict, key: str) -> str:
    low, high = speed[f"{key}_range"]
    return f"{speed[key]:.1f} [{low:.1f}-{high:.1f}]"


def _mb(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.1f}"


def format_report(result: dict) -> str:
    speed = result["speed"]
    lines = [
        f"model: {result['model']}",
        f"llama.cpp CPU backend: {result['cpu_backend']}, {result['threads']} thread(s), "
        "weight repacking "
        f"{'on' if speed['cpu_repack'] else 'off'}",
        f"  {result['system_info']}",
        f"speed (cache off, median [min-max] of {SPEED_RUNS}): prefill "
        f"{_rate(speed, 'prefill_tokens_per_s')} tok/s ({SPEED_PROMPT_TOKENS}-token prompt), "
        f"decode {_rate(speed, 'decode_tokens_per_s')} tok/s (1 stream)",
        "state copies (cache on), MB: the request's own full states restored (rest) and saved"
        " (save), and partial ones (part: no attention KV, anchors and rewinds); the turn's all"
        " told, with the rewind and replay after the reply and the store once idle (turn ...)",
        f"{'turn':>4} {'prompt':>7} {'new':>6} {'cached':>7} {'computed':>9} {'ttft_s':>8}"
        f" {'restore_s':>9} {'rest':>6} {'save':>6} {'part':>6} {'turn rest':>9}"
        f" {'turn save':>9} {'turn part':>9} | {'computed (no cache)':>19}"
        f" {'ttft_s (no cache)':>18}",
    ]
    for r in result["turns"]:
        lines.append(
            f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['new_tokens']:>6} {r['cached_tokens']:>7}"
            f" {r['computed_tokens']:>9} {r['ttft_s']:>8.3f} {r['restore_s']:>9.3f}"
            f" {_mb(r['restored_bytes']):>6} {_mb(r['saved_bytes']):>6}"
            f" {_mb(r['partial_bytes']):>6} {_mb(r['turn_restored_bytes']):>9}"
            f" {_mb(r['turn_saved_bytes']):>9} {_mb(r['turn_partial_bytes']):>9}"
            f" | {r['computed_tokens_no_cache']:>19} {r['ttft_s_no_cache']:>18.3f}"
        )
    lines += [
        f"new tokens: {result['new_tokens']}",
        f"computed / new: {result['computed_over_new']:.3f} with checkpoints, "
        f"{result['computed_over_new_no_cache']:.3f} without",
        f"total TTFT: {result['ttft_total_s']:.2f} s with checkpoints, "
        f"{result['ttft_total_s_no_cache']:.2f} s without; of it restores"
        f" {result['restore_total_s']:.2f} s",
        f"state copies (cache on): requests restored {_mb(result['restored_bytes'])} MB and"
        f" saved {_mb(result['saved_bytes'])} MB (partial {_mb(result['partial_bytes'])} MB);"
        f" with the rewinds and replays {_mb(result['turn_restored_bytes'])} MB and"
        f" {_mb(result['turn_saved_bytes'])} MB (partial {_mb(result['turn_partial_bytes'])} MB)",
    ]
    if "decode_tokens_per_s" in result:
        d = result["decode_tokens_per_s"]
        k = next(key for key in d if key not in ("1", "speedup"))
        lines.append(
            f"decode: {d['1']:.1f} tok/s with 1 stream, {d[k]:.1f} tok/s aggregate with {k}"
            f" streams ({d['speedup']:.2f}x)"
        )
    if "decode_beside_prompts" in result:
        lines += format_beside(result["decode_beside_prompts"])
    return "\n".join(lines)
