"""llama.cpp's own `llama-batched-bench` on a model: the peer of `baton bench device --peer`.

Built from Baton's vendored llama.cpp beside llama-server (`deploy/llama_server_build.py`),
it runs on the backend modules Baton's engine loads (`llama_server.backend_dir`), with the
engine's threads, offload and flash-attention setting, so engine and tool compute with the
same kernels. Two runs: decode, `streams` sequences of a short prompt each generating
`decode_tokens` (aggregate S_TG: llama.cpp's own multi-sequence decode), and prefill, one
prompt of each length (S_PP).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from baton_serve.deploy.llama_server_build import BATCHED_BENCH_BINARY, cached_server
from baton_serve.loadtests.llama_server import backend_dir, flash_attn_flag, gpu_layers

DECODE_PROMPT_TOKENS = 32  # as `device_bench`'s decode streams
RUN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class BatchedBenchSettings:
    """What both runs share: the engine's threads, offload and attention."""

    threads: int
    n_gpu_layers: int  # Baton's: -1 every layer
    flash_attn: bool | None  # None: llama.cpp's auto, as the engine's


def batched_bench_command(
    binary: Path,
    model: Path,
    settings: BatchedBenchSettings,
    *,
    prompts: tuple[int, ...],
    generated: int,
    parallel: tuple[int, ...],
) -> list[str]:
    """`-npp` prompts × `-ntg` generated × `-npl` parallel sequences, one JSON line each."""
    n_kv = max(parallel) * (max(prompts) + generated)
    return [
        str(binary),
        *("-m", str(model.resolve()), "-c", str(n_kv), "-b", "2048", "-ub", "512"),
        *("-npp", ",".join(map(str, prompts)), "-ntg", str(generated)),
        *("-npl", ",".join(map(str, parallel))),
        *("-t", str(settings.threads), "-ngl", gpu_layers(settings.n_gpu_layers)),
        *("-fa", flash_attn_flag(settings.flash_attn)),
        *("--output-format", "jsonl"),
    ]


def parse_rows(output: str) -> list[dict]:
    """The JSON line of each (prompt, generated, parallel) combination."""
    rows = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    if not rows:
        raise RuntimeError(f"llama-batched-bench printed no results:\n{output[-2000:]}")
    return rows


def run(command: list[str]) -> list[dict]:
    """Run in a folder holding the engine's backend modules; its JSON lines."""
    with tempfile.TemporaryDirectory(prefix="baton-batched-bench-") as workdir:
        backend_dir(Path(workdir))
        done = subprocess.run(
            command,
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    if done.returncode != 0:
        raise RuntimeError(
            f"llama-batched-bench exited with {done.returncode}:\n{done.stderr[-2000:]}"
        )
    return parse_rows(done.stdout + done.stderr)


def batched_bench(
    model: Path,
    settings: BatchedBenchSettings,
    *,
    streams: tuple[int, ...],
    decode_tokens: int,
    prompts: tuple[int, ...],
) -> dict:
    """Aggregate decode tok/s at each count of streams and prefill tok/s of each prompt
    length."""
    binary = cached_server().parent / BATCHED_BENCH_BINARY
    decode = run(
        batched_bench_command(
            binary,
            model,
            settings,
            prompts=(DECODE_PROMPT_TOKENS,),
            generated=decode_tokens,
            parallel=streams,
        )
    )
    prefill = run(
        batched_bench_command(binary, model, settings, prompts=prompts, generated=1, parallel=(1,))
    )
    return {
        "tool": BATCHED_BENCH_BINARY,
        "decode_tokens_per_s": {str(row["pl"]): row["speed_tg"] for row in decode},
        "prefill_tokens_per_s": {str(row["pp"]): row["speed_pp"] for row in prefill},
        "flash_attn": decode[0]["flash_attn"],
    }
