"""`bench peer`'s multi-turn workload on Baton's engine in this process, beside llama-server on
the same model and device: `bench device --peer` on a machine without Ray (a lent GPU).

Baton's side is the engine alone (no Ray, no gateway, no HTTP): each request's chat is
rendered by the engine's template and submitted, and TTFT and the gaps between tokens are
timed at its token events. llama-server's side is the same sessions over HTTP, timed at
its streamed chunks (`peer_play.play_server`); on one machine the loopback HTTP between
them costs well under a millisecond a request. Both run `slots` slots on `threads`
threads with the same offload and attention.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from baton_serve.cache_store.wire.protocol import GenerationRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.loadtests.llama_server import ServerSettings, llama_server
from baton_serve.loadtests.peer_play import (
    BATON,
    LLAMA_SERVER,
    WARMUP_REQUESTS,
    PeerRecord,
    compare,
    play_server,
    summarize,
)
from baton_serve.loadtests.peer_workload import PeerWorkload, Session, make_sessions
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.engine_face import EngineFace
from baton_serve.replicas.engine.llama_model import LlamaModel

ENGINE_HMAC_KEY = b"engine-peer"  # nothing leaves the process


async def _engine_request(
    engine: EngineFace, messages: list[dict], max_tokens: int, record: PeerRecord
) -> str:
    """One chat request on the engine, filling `record` as `play_server` fills its own."""
    text, last = "", 0.0
    started = time.perf_counter()
    try:
        prompt = engine.chat_prompt(messages)
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        handle = engine.submit(GenerationRequest(prompt=prompt, sampling=sampling))
        async for event in handle.aiter():
            if event.text:
                now = time.perf_counter()
                if record.ttft_s is None:
                    record.ttft_s = now - started
                else:
                    record.gaps_s.append(now - last)
                last, text = now, text + event.text
        done = await handle.aresult()
        record.prompt_tokens = done.usage.prompt_tokens
        record.cached_tokens = done.usage.cached_tokens
        record.completion_tokens = done.usage.completion_tokens
    except Exception as exc:  # this request's fault, counted, not fatal
        record.error = f"{type(exc).__name__}: {exc}"
    record.total_s = time.perf_counter() - started
    return text


async def play_engine(
    engine: EngineFace,
    sessions: list[Session],
    workload: PeerWorkload,
    recorded: Callable[[int], None],
) -> tuple[list[PeerRecord], float]:
    """Every session on `engine`, `concurrency` at a time, as `play_server` plays a server:
    the records and the wall time of the whole run (warm-up requests not in it)."""
    if workload.image_px:
        raise ValueError("the engine-side workload sends no images (image_px must be 0)")
    records: list[PeerRecord] = []
    slots = asyncio.Semaphore(workload.concurrency)

    async def session(script: Session) -> None:
        messages = [{"role": "system", "content": script.system}]
        async with slots:
            for turn, text in enumerate(script.messages):
                messages.append({"role": "user", "content": text})
                record = PeerRecord(BATON, script.kind, script.index, turn, time.time_ns())
                reply = await _engine_request(engine, messages, workload.reply_tokens, record)
                records.append(record)
                recorded(len(records))
                messages.append({"role": "assistant", "content": reply})

    for i in range(WARMUP_REQUESTS):  # llama.cpp's first-call costs, on neither side
        warm = PeerRecord(BATON, "warm-up", i, 0, time.time_ns())
        hello = [{"role": "user", "content": f"Warm-up {i}: say hi."}]
        await _engine_request(engine, hello, 4, warm)
        if warm.error:
            raise RuntimeError(f"baton's engine: warm-up request failed: {warm.error}")
    started = time.perf_counter()
    await asyncio.gather(*(session(s) for s in sessions))
    return records, time.perf_counter() - started


def engine_peer_benchmark(
    model: Path,
    config: EngineConfig,
    workload: PeerWorkload,
    recorded: Callable[[str, int], None] = lambda _side, _k: None,
) -> dict:
    """The workload on the engine (`config`'s threads, slots and offload, its context sized
    for the workload), then on llama-server with the same, and attention as the engine
    resolved it on this device: both summaries and the comparison rows."""
    vocabulary = LlamaModel(model, vocab_only=True)
    try:
        sessions = make_sessions(workload, vocabulary)
    finally:
        vocabulary.close()
    config = config.model_copy(update={"n_ctx": workload.n_ctx()})
    with Engine(str(model), config, hmac_key=ENGINE_HMAC_KEY) as engine:
        ours, our_wall = asyncio.run(
            play_engine(engine, sessions, workload, lambda k: recorded(BATON, k))
        )
        resolved = engine.config
    settings = ServerSettings(
        threads=config.n_threads,
        slots=config.n_slots,
        n_ctx=workload.n_ctx(),
        flash_attn=resolved.flash_attn,
        n_gpu_layers=config.n_gpu_layers,
    )
    with llama_server(model, settings) as url:
        theirs, their_wall = asyncio.run(
            play_server(
                url,
                model.stem,
                LLAMA_SERVER,
                sessions,
                workload,
                lambda k: recorded(LLAMA_SERVER, k),
            )
        )
    result = {
        "workload": asdict(workload),
        "engine": resolved.model_dump(
            include={"n_ctx", "n_slots", "n_threads", "n_gpu_layers", "exact_reuse", "flash_attn"}
        ),
        BATON: summarize(ours, our_wall),
        LLAMA_SERVER: summarize(theirs, their_wall),
    }
    result["rows"] = compare(result[BATON], result[LLAMA_SERVER])
    return result
