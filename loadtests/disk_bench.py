"""`baton bench disk`: restoring a prefix state from the disk tier against recomputing it.

For each prefix length, an engine with a checkpoint directory computes the prefix and
closes (writing its checkpoints to disk); the page cache is told to drop the files, so
they are read from the device; a new engine on the same directory — a warm restart —
adopts them and serves the prefix plus two tokens (read, validate, restore, compute two
tokens). An engine with the cache off computes the same prompt from scratch.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from pathlib import Path

import numpy as np

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.loadtests.synthetic_text import filler_text
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_model import LlamaModel

PREFILL_ONLY = SamplingParams(max_tokens=0)
RATIO_TARGET = 0.1  # restore from disk over recompute, at 2,048 tokens


def _prompt(vocab: LlamaModel, n: int, seed: int) -> tuple[int, ...]:
    count = lambda text: len(vocab.tokenize(text))  # noqa: E731
    return tuple(vocab.tokenize(filler_text(n + 64, count, seed=seed)))[:n]


def _drop_page_cache(folder: Path) -> None:
    """Write the checkpoint files out and drop them from the page cache (Linux)."""
    for path in folder.rglob("*.ckpt"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _one_run(model: Path, config: EngineConfig, key: bytes, tokens: tuple[int, ...]) -> dict:
    with tempfile.TemporaryDirectory(prefix="baton-disk-bench-") as folder:
        disk_config = config.model_copy(update={"checkpoint_dir": folder})
        with Engine(str(model), disk_config, hmac_key=key) as first:
            # the engine holds exactly len(tokens): a prompt of n-2, two tokens, replayed
            done = first.generate(
                Prompt(tokens=tokens[:-2]), SamplingParams(max_tokens=2, ignore_eos=True)
            )
            first.wait_idle()
        prompt = tokens[:-2] + tuple(done.tokens) + tokens[:2]
        _drop_page_cache(Path(folder))
        started = time.perf_counter()
        with Engine(str(model), disk_config, hmac_key=key) as restarted:
            adopt_s = time.perf_counter() - started  # includes loading the model
            state_bytes = restarted.store_figures().disk_used_bytes
            assert state_bytes is not None
            _drop_page_cache(Path(folder))  # adopting read them: read them cold again
            started = time.perf_counter()
            from_disk = restarted.generate(Prompt(tokens=prompt), PREFILL_ONLY)
            disk_s = time.perf_counter() - started
            read_rate = restarted.store_figures().disk_read_bytes_per_s
    return {
        "disk_s": disk_s,
        "cached_tokens": from_disk.usage.cached_tokens,
        "file_bytes": state_bytes,
        "read_mb_per_s": read_rate / 1e6,
        "restart_s": adopt_s,
        "prompt": prompt,
    }


def disk_benchmark(
    model: Path,
    lengths: list[int] = [512, 2048],  # noqa: B006
    runs: int = 3,
    progress: Progress = SILENT,
) -> dict:
    key = secrets.token_bytes(32)
    config = EngineConfig(n_ctx=max(lengths) + 256, n_slots=2)
    no_cache = config.model_copy(update={"prefix_cache": False})
    rows = []
    progress.start(len(lengths) * runs)
    with LlamaModel(model, vocab_only=True) as vocab:
        prompts = {n: _prompt(vocab, n, seed=n) for n in lengths}
    with Engine(str(model), no_cache, hmac_key=key) as baseline:
        for n, tokens in prompts.items():
            disk_s, recompute_s, last = [], [], {}
            for run in range(runs):
                progress.step(f"{n}-token prefix, run {run + 1}: disk", done=len(rows) * runs + run)
                last = _one_run(model, config, key, tokens)
                disk_s.append(last["disk_s"])
                progress.step(f"{n}-token prefix, run {run + 1}: recompute")
                started = time.perf_counter()
                baseline.generate(Prompt(tokens=last["prompt"]), PREFILL_ONLY)
                recompute_s.append(time.perf_counter() - started)
            disk_med, recompute_med = float(np.median(disk_s)), float(np.median(recompute_s))
            rows.append(
                {
                    "prefix_tokens": n,
                    "file_bytes": last["file_bytes"],
                    "read_mb_per_s": last["read_mb_per_s"],
                    "restart_s": last["restart_s"],
                    "disk_s": disk_s,
                    "recompute_s": recompute_s,
                    "disk_s_median": disk_med,
                    "recompute_s_median": recompute_med,
                    "ratio": disk_med / recompute_med,
                    "cached_tokens": last["cached_tokens"],
                }
            )
    return {"model": str(model), "runs": runs, "target": RATIO_TARGET, "rows": rows}


def format_report(result: dict) -> str:
    lines = [
        f"model: {result['model']} ({result['runs']} runs each; median [min-max])",
        f"{'prefix':>7} {'file MB':>8} {'disk s':>22} {'recompute s':>22} {'ratio':>7}"
        f" {'reused':>7}",
    ]
    for r in result["rows"]:
        disk = f"{r['disk_s_median']:.3f} [{min(r['disk_s']):.3f}-{max(r['disk_s']):.3f}]"
        again = (
            f"{r['recompute_s_median']:.3f} "
            f"[{min(r['recompute_s']):.3f}-{max(r['recompute_s']):.3f}]"
        )
        lines.append(
            f"{r['prefix_tokens']:>7} {r['file_bytes'] / 1e6:>8.1f} {disk:>22} {again:>22}"
            f" {r['ratio']:>7.3f} {r['cached_tokens']:>7}"
        )
    lines.append(
        "disk = read (page cache dropped) + validate + restore + 2 new tokens, on an engine "
        f"restarted on the same directory; target ratio <= {result['target']} at 2,048 tokens"
    )
    speeds = ", ".join(f"{r['read_mb_per_s']:.0f}" for r in result["rows"])
    lines.append(f"measured read + validate speed, MB/s: {speeds}")
    return "\n".join(lines)
