"""The disk tier with real llama.cpp (generated models), real files and real processes:
states restored from disk are bit-exact, a bad file never reaches llama.cpp, and a replica
restarted on the same directory serves the next turn from cache — an engine, a Replica
publishing to a real Redis, and `baton serve` itself."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fixtures_ray import wait_healthy

from baton_serve.cache_store.checkpoints.state_blob import encode_blob
from baton_serve.cache_store.index.index_connect import connect_index
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.deploy.ports import free_port
from baton_serve.replicas.engine.checkpoint_policy import MIN_PIECE
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.replica import Replica

KEY = b"disk-restart-test-key"
GREEDY = SamplingParams(max_tokens=8)
SYSTEM = "You are a careful assistant who answers in short sentences. " * 10


def engine(path: Path, folder: Path | None, key: bytes = KEY, **settings: object) -> Engine:
    directory = None if folder is None else str(folder)
    defaults = {"n_ctx": 1024, "n_slots": 2, "n_threads": 2, "checkpoint_dir": directory}
    config = EngineConfig(**{**defaults, **settings})
    return Engine(str(path), config, hmac_key=key)


def first_turn(e: Engine) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
    reply = e.generate(e.chat_prompt(messages), GREEDY)
    e.wait_idle()
    return [
        *messages,
        {"role": "assistant", "content": reply.text},
        {"role": "user", "content": "And?"},
    ]


def checkpoint_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.ckpt"))


@pytest.mark.parametrize("arch", ["qwen35", "llama"])
def test_states_kept_only_on_disk_restore_bit_exact(arch, tiny_model, tmp_path) -> None:
    """With no RAM budget every checkpoint lives on disk; the conversation resumed from
    there equals one computed from scratch, to the bit."""
    path = tiny_model(arch)
    with (
        engine(path, tmp_path, store_budget_bytes=0, n_slots=1) as disk_only,
        engine(path, None, prefix_cache=False) as scratch,
    ):
        messages = first_turn(disk_only)
        if arch == "llama":  # attention KV is saved when its slot goes to another prompt
            disk_only.generate(disk_only.text_prompt("An unrelated prompt."), GREEDY)
        assert disk_only.store_figures().used_bytes == 0  # nothing in RAM
    assert checkpoint_files(tmp_path)
    with (
        engine(path, tmp_path, store_budget_bytes=0, n_slots=1) as restarted,
        engine(path, None, prefix_cache=False) as scratch,
    ):
        prompt = restarted.chat_prompt(messages)
        resumed = restarted.generate(prompt, GREEDY, return_logits=True)
        fresh = scratch.generate(prompt, GREEDY, return_logits=True)
        assert resumed.usage.cached_tokens > len(prompt) // 2
        assert restarted.stats.checkpoints_restored == 1
        assert resumed.tokens == fresh.tokens
        assert float(np.abs(resumed.logits - fresh.logits).max()) == 0.0
        assert restarted.store_figures().disk_used_bytes <= restarted.config.disk_budget_bytes


def test_warm_restart_serves_the_next_turn_from_cache(tiny_model, tmp_path) -> None:
    path = tiny_model("qwen35")
    with engine(path, tmp_path) as first:
        messages = first_turn(first)
        first_prompt = len(first.chat_prompt(messages[:2]))
        assert not checkpoint_files(tmp_path)  # RAM held everything until the engine closed
    assert checkpoint_files(tmp_path)
    with engine(path, tmp_path) as restarted, engine(path, None, prefix_cache=False) as scratch:
        prompt = restarted.chat_prompt(messages)
        resumed = restarted.generate(prompt, GREEDY, return_logits=True)
        fresh = scratch.generate(prompt, GREEDY, return_logits=True)
        assert resumed.usage.cached_tokens >= first_prompt - MIN_PIECE
        assert resumed.tokens == fresh.tokens
        assert float(np.abs(resumed.logits - fresh.logits).max()) == 0.0


def test_files_of_another_key_or_model_or_a_malformed_state_are_deleted(
    tiny_model, tmp_path, caplog
) -> None:
    path = tiny_model("qwen35")
    with engine(path, tmp_path) as first:
        messages = first_turn(first)
        fingerprint, fixed_and_per_token = first.fingerprint, first.state_size
        # correctly signed, right model, right tokens: only the engine's exact-size check sees it
        tokens = list(range(100, 164))
        prefix_hash = first.prefix_hash(tokens)
    fixed, per_token = fixed_and_per_token
    (model_dir,) = tmp_path.iterdir()
    slot = model_dir / "0"
    good = len(checkpoint_files(tmp_path))
    malformed = encode_blob(
        fingerprint=fingerprint,
        prefix_hash=prefix_hash,
        tokens=tokens,
        state=bytes(fixed + per_token * len(tokens) - 8),
        key=KEY,
    )
    (slot / f"{prefix_hash.hex()}.ckpt").write_bytes(malformed)
    with caplog.at_level(logging.WARNING, logger="baton.disk"):
        with engine(path, tmp_path) as same_key:
            assert len(same_key.checkpoints(on_disk=True)) == good
        assert f"{prefix_hash.hex()}.ckpt" in caplog.text
        assert "state of this model is" in caplog.text  # the engine's exact-size check
        caplog.clear()
        with engine(path, tmp_path, key=b"another-cluster-key") as other_key:
            assert other_key.checkpoints(on_disk=True) == []
            prompt = other_key.chat_prompt(messages)
            assert other_key.generate(prompt, GREEDY).usage.cached_tokens == 0
        assert caplog.text.count("deleting checkpoint file") == good
    # the other-key engine left its own files (on close); another model deletes them too
    other_model = tiny_model("lfm2")
    copied = checkpoint_files(tmp_path)
    foreign_dir = tmp_path / engine_fingerprint_dir(other_model) / "0"
    foreign_dir.mkdir(parents=True)
    for file in copied:
        shutil.copy(file, foreign_dir / file.name)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="baton.disk"):
        with engine(other_model, tmp_path, key=b"another-cluster-key") as lfm2:
            assert lfm2.checkpoints(on_disk=True) == []
    assert "different model" in caplog.text
    assert not list(foreign_dir.glob("*.ckpt"))


def engine_fingerprint_dir(path: Path) -> str:
    from baton_serve.cache_store.fingerprint import file_fingerprint

    return file_fingerprint(path).hex()[:16]


def test_a_restarted_replica_republishes_its_adopted_checkpoints(
    tiny_model, tmp_path, redis_server
) -> None:
    path = tiny_model("qwen35")
    with engine(path, tmp_path) as first:
        messages = first_turn(first)

    async def restart() -> tuple[dict, int]:
        e = engine(path, tmp_path)
        index = await connect_index(redis_server.url, e.fingerprint, timeout_s=1.0)
        replica = Replica("restarted", e, index=index, heartbeat_s=0.2)
        try:
            await replica.start()
            tokens = e.chat_prompt(messages).tokens
            chain = e.hash_chain(tokens[: len(tokens) - MIN_PIECE])
            deadline = time.monotonic() + 10
            while "restarted" not in (found := await index.lookup(chain)):
                assert time.monotonic() < deadline, "the adopted checkpoints were never published"
                await asyncio.sleep(0.1)
            done = await asyncio.to_thread(e.generate, e.chat_prompt(messages), GREEDY)
            return found, done.usage.cached_tokens
        finally:
            await replica.close()
            await index.close()
            e.close()

    found, cached = asyncio.run(restart())
    assert found["restarted"].n_tokens > 0
    assert cached > 0


# ---- `baton serve`, stopped and started again ---------------------------------------------


def _serve(folder: Path, port: int, env: dict[str, str]) -> tuple[subprocess.Popen, list[str]]:
    command = [
        *(sys.executable, "-m", "baton_serve.deploy.cli", "serve", "--model", "tiny:qwen35"),
        *("--replicas", "1", "--cpus-per-replica", "0.5", "--n-ctx", "1024", "--slots", "1"),
        *("--port", str(port), "--checkpoint-dir", str(folder), "--disk-budget", "64M"),
    ]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(process.stdout), daemon=True).start()
    deadline = time.monotonic() + 120
    while "Press Ctrl-C" not in "".join(output):
        assert process.poll() is None and time.monotonic() < deadline, "".join(output)
        time.sleep(0.5)
    return process, output


def _stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


@pytest.mark.slow  # two starts of a local Ray cluster: about a minute on an idle 2-core machine
def test_baton_serve_restarted_on_the_same_directory_serves_from_cache(tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ray_dir = Path(tempfile.mkdtemp(prefix="bt", dir="/tmp"))  # short: Ray's socket paths
    env = {
        **os.environ,
        "BATON_CACHE_DIR": str(tmp_path / "cache"),
        "BATON_HMAC_KEY": "a-fixed-cluster-key-for-restarts",
        "RAY_TMPDIR": str(ray_dir),
    }
    folder = tmp_path / "checkpoints"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
    body = {"model": "tiny-qwen35", "max_tokens": 8, "ignore_eos": True}
    try:
        process, output = _serve(folder, port, env)
        try:
            wait_healthy(url)
            reply = httpx.post(f"{url}/v1/chat/completions", json={**body, "messages": messages})
            assert reply.status_code == 200, reply.text
        finally:
            _stop(process)
        assert checkpoint_files(folder), "".join(output)
        messages += [
            {"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Tell me more."},
        ]
        process, output = _serve(folder, port, env)
        try:
            wait_healthy(url)
            again = httpx.post(
                f"{url}/v1/chat/completions", json={**body, "messages": messages}, timeout=60
            )
            assert again.status_code == 200, again.text
            usage = again.json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] > 0, "".join(output)
        finally:
            _stop(process)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
