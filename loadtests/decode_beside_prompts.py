"""What computing a prompt costs the streams decoding beside it: their inter-token gaps while
long chat prompts are computed in another slot, with the prefix cache on (checkpoints and
anchors taken as the prompts are computed) and off (no state saved at all), on the same
engine settings, one prompt piece a step (`step_tokens` = `prefill_chunk` + the streams), so
a state saved after a piece shows in the gap it lengthens. `baton bench engine --concurrency K`
prints it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from baton_serve.cache_store.wire.protocol import GenerationRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.loadtests.synthetic_text import filler_text
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.engine_face import EngineFace

DECODING_STREAMS = 2
PROMPTS = 3  # long prompts computed one after another beside the decoding streams
START_TIMEOUT_S = 60.0  # for the decoding streams' first tokens


def decode_beside_prompts(
    model: Path, *, system_tokens: int, threads: int, hmac_key: bytes
) -> dict[str, dict]:
    """Inter-token gap percentiles (seconds) of `DECODING_STREAMS` streams while `PROMPTS`
    chat prompts of `system_tokens` are computed, cache on and off, and the state bytes the
    prompts saved (full) and anchored (partial)."""
    return {
        label: _gaps(model, prefix_cache, system_tokens, threads, hmac_key)
        for label, prefix_cache in (("cache_on", True), ("cache_off", False))
    }


def _gaps(
    model: Path, prefix_cache: bool, system_tokens: int, threads: int, hmac_key: bytes
) -> dict:
    config = EngineConfig(
        n_ctx=system_tokens + 512,
        n_slots=DECODING_STREAMS + 1,
        n_threads=threads,
        prefix_cache=prefix_cache,
        # one piece a step: each gap is one piece
        step_tokens=EngineConfig.model_fields["prefill_chunk"].default + DECODING_STREAMS,
    )
    with Engine(str(model), config, hmac_key=hmac_key) as engine:
        count = lambda text: len(engine.model.tokenize(text))  # noqa: E731
        prompts = [
            engine.chat_prompt(
                [
                    {"role": "system", "content": filler_text(system_tokens, count, seed=10 + i)},
                    {"role": "user", "content": f"Question {i}: what comes next?"},
                ]
            )
            for i in range(PROMPTS)
        ]
        engine.generate(engine.text_prompt("Warm up."), SamplingParams(max_tokens=4))
        # Long enough to outlast the prompts: they are cancelled once the prompts are done.
        decoding = SamplingParams(max_tokens=config.n_ctx - 64, ignore_eos=True)
        arrivals: list[list[float]] = [[] for _ in range(DECODING_STREAMS)]
        handles = [
            engine.submit(
                GenerationRequest(
                    prompt=engine.text_prompt(f"Stream {i} tells a story."), sampling=decoding
                )
            )
            for i in range(DECODING_STREAMS)
        ]
        readers = [
            threading.Thread(target=_record, args=(handle, times), daemon=True)
            for handle, times in zip(handles, arrivals, strict=True)
        ]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(arrivals):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the decoding streams gave no token in {START_TIMEOUT_S} s")
            time.sleep(0.01)
        before = _copies(engine)
        window = []
        for prompt in prompts:
            started = time.perf_counter()
            engine.generate(prompt, SamplingParams(max_tokens=1))
            window.append((started, time.perf_counter()))
        after = _copies(engine)
        saved, anchored, copy_s, full_saves = (a - b for a, b in zip(after, before, strict=True))
        for handle in handles:
            handle.cancel()
        for reader in readers:
            reader.join(timeout=30)
    gaps = [
        later - earlier
        for times in arrivals
        for earlier, later in zip(times, times[1:], strict=False)
        if any(start <= later <= end for start, end in window)
    ]
    p50, p95, p99 = np.percentile(gaps, [50, 95, 99]) if gaps else (0.0, 0.0, 0.0)
    return {
        "gaps": len(gaps),
        "p50_s": float(p50),
        "p95_s": float(p95),
        "p99_s": float(p99),
        "saved_bytes": saved,
        "anchor_bytes": anchored,
        "full_saves": full_saves,
        "copy_s": copy_s,  # the step path's state copies over the prompts, all told
    }


def _copies(engine: EngineFace) -> tuple[int, int, float, int]:
    """The engine's state copies so far: full and partial bytes, their seconds, full states."""
    stats = engine.stats
    seconds = stats.save_seconds + stats.anchor_seconds
    return stats.saved_bytes, stats.anchor_bytes, seconds, stats.checkpoints_saved


def _record(handle: object, times: list[float]) -> None:
    """When each of a stream's tokens arrived (until it is cancelled)."""
    for _ in handle:  # type: ignore[attr-defined]
        times.append(time.perf_counter())


def format_beside(figures: dict[str, dict]) -> list[str]:
    """Report lines: the decoding streams' gaps with the cache on against off."""
    on, off = figures["cache_on"], figures["cache_off"]
    lines = [
        f"decoding streams' inter-token gaps while {PROMPTS} long prompts are computed beside"
        " them (p50/p95/p99 ms):"
    ]
    for label, row in (("cache on ", on), ("cache off", off)):
        lines.append(
            f"  {label}: {row['p50_s'] * 1e3:.1f}/{row['p95_s'] * 1e3:.1f}/"
            f"{row['p99_s'] * 1e3:.1f} over {row['gaps']} gaps; the prompts saved"
            f" {row['saved_bytes'] / 1e6:.1f} MB full ({row['full_saves']} states) and"
            f" {row['anchor_bytes'] / 1e6:.1f} MB partial states in {row['copy_s'] * 1e3:.0f} ms"
        )
    if off["p99_s"] > 0:
        most = on["copy_s"] / max(1, on["full_saves"])
        lines.append(
            f"  p99 with the cache on / off: {on['p99_s'] / off['p99_s']:.2f}x (their pieces"
            f" are cut apart: at checkpoint positions with it on); a full save adds about"
            f" {most * 1e3:.0f} ms to the one gap it falls in, {most / on['p99_s']:.1%} of the"
            " p99 gap"
        )
    return lines
