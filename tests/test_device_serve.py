"""The device path over the Serve app, and the device named where it runs.

The device is Mesa's software Vulkan driver (lavapipe), which llama.cpp's Vulkan backend
uses only when named (`GGML_VK_VISIBLE_DEVICES=0`): child processes and the replicas get the
variable (the replicas through `replica_env`, their Ray runtime_env); this process does not,
so its llama.cpp stays CPU-only and shows the fallback.

What the app test compares, for generated hybrids (qwen35, granite-hybrid: Mamba2 layers
between attention layers; attention alone on the device is tests/test_vulkan_device.py's):
two replicas offload every layer to the device and serve a two-turn conversation of token-id
prompts. The second turn usually reaches the peer while the first replica still replays the
reply, and the peer pulls the first turn's checkpoint saved from device memory; the router
may instead pick the first replica, whose slot still holds the turn: the test accepts both
paths and checks the pull (in the replicas' own counters) where the cached count shows it.
Its greedy text must equal the device computing the whole prompt from scratch (a child
process, prefix cache off), and its cached token count what the same engine settings cache
on CPU on the same path. Device and CPU multiply with other rounding: their logits are not
compared; tests/test_vulkan_device.py shows their greedy tokens agree on these models.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from fixtures_ray import wait_healthy
from lavapipe import (
    CHILD_TIMEOUT_S,
    DEVICE_ENV,
    child_report,
    require_vulkan_module,
    skip_unless_device,
)
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.deploy.app import APP_NAME, build_app
from baton_serve.deploy.config import BatonConfig
from baton_serve.deploy.local_ray import metrics_export_port
from baton_serve.loadtests.serve_app import replica_stats
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.models.model_check import ModelCheckFailed, check_model

MAX_TOKENS = 8
SETTINGS = {"n_ctx": 512, "n_slots": 1, "n_threads": 1, "block_tokens": 16}
SETTINGS |= {"checkpoint_interval": 64, "prefill_chunk": 64}
# Replays and plain attention pinned, as on the CPU: the app's turns are checked against the
# CPU's replayed checkpoints (a device's own defaults keep the decode's state instead:
# test_vulkan_device).
SETTINGS |= {"exact_reuse": True, "flash_attn": False}
APP_ARCHS = ("qwen35", "granitehybrid")


def test_a_model_asked_on_a_gpu_without_one_runs_on_the_cpu_and_says_so(tiny_model, caplog) -> None:
    def fallbacks() -> list[str]:
        return [r.getMessage() for r in caplog.records if "runs on the CPU" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="baton.llama"):
        with LlamaModel(tiny_model("llama"), n_gpu_layers=0) as on_cpu:
            assert on_cpu.device == "CPU"
        assert not fallbacks()
        with LlamaModel(tiny_model("llama"), n_gpu_layers=-1) as asked:
            assert asked.devices == () and asked.device == "CPU"
    (line,) = fallbacks()
    assert line.startswith("n_gpu_layers is -1 but llama.cpp has no GPU device here")


def test_the_start_up_check_names_the_device_baton_serve_prints(tiny_model) -> None:
    require_vulkan_module()
    path = tiny_model("qwen35")
    try:
        report = check_model(path, n_gpu_layers=-1, env=DEVICE_ENV)
    except ModelCheckFailed as exc:
        pytest.skip(f"no Vulkan device {DEVICE_ENV} (no Vulkan driver installed?): {exc}")
    if report.device == "CPU":
        pytest.skip(f"{DEVICE_ENV} names no Vulkan device (Mesa's mesa-vulkan-drivers?)")
    assert report.device.startswith("Vulkan0: ")
    assert f"device {report.device}" in report.summary()
    assert check_model(path, n_gpu_layers=0, env=DEVICE_ENV).device == "CPU"
    assert check_model(path, n_gpu_layers=-1).device == "CPU"  # no device named


def _conversation(n_vocab: int) -> tuple[list[int], list[int]]:
    """The first turn's prompt, and the random tokens the second turn adds after the reply."""
    rng = random.Random(11)
    first = [rng.randrange(3, n_vocab) for _ in range(150)]
    return first, [rng.randrange(3, n_vocab) for _ in range(20)]


def scratch_child(path: str) -> None:
    """Runs in the child: both turns on the device, each from scratch; prints JSON."""
    config = EngineConfig(**SETTINGS, n_gpu_layers=-1, prefix_cache=False)
    with Engine(path, config, hmac_key=b"scratch") as engine:
        first, added = _conversation(engine.model.n_vocab)
        turns, tokens = [], first
        for _ in range(2):
            done = engine.generate(
                Prompt(tokens=tuple(tokens)), SamplingParams(max_tokens=MAX_TOKENS)
            )
            turns.append({"tokens": done.tokens, "text": done.text})
            tokens = tokens + list(done.tokens) + added
        print(json.dumps({"device": engine.model.device, "turns": turns}))


@pytest.fixture(scope="module", params=APP_ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def from_scratch(tiny_model, arch) -> dict:
    """The device's two turns, each computed from scratch, in a child process."""
    report = child_report(__file__, str(tiny_model(arch)))
    skip_unless_device(report["device"])
    return report


@pytest.fixture(scope="module")
def device_app(tiny_model, from_scratch, serve_port, arch) -> Iterator[tuple[str, BatonConfig]]:
    config = BatonConfig(
        model=str(tiny_model(arch)),
        replicas=2,
        num_cpus_per_replica=0.5,
        replica_env=DEVICE_ENV,
        engine=EngineConfig(**SETTINGS, n_gpu_layers=-1),
        heartbeat_s=0.2,
        hmac_key=secrets.token_hex(16),
    )
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    url = f"http://127.0.0.1:{serve_port}"
    wait_healthy(url, timeout_s=CHILD_TIMEOUT_S)
    yield url, config
    serve.delete(APP_NAME)


def _complete(url: str, config: BatonConfig, prompt: list[int]) -> dict:
    body = {"model": config.served_model_name, "prompt": prompt, "max_tokens": MAX_TOKENS}
    response = httpx.post(f"{url}/v1/completions", json=body | {"temperature": 0}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def _scrape(name: str, label: str) -> dict[str, float]:
    """Ray's samples of `name` on this node, summed over replicas by `label`."""
    text = httpx.get(f"http://127.0.0.1:{metrics_export_port()}/metrics", timeout=10).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                value = sample.labels[label]
                found[value] = found.get(value, 0.0) + sample.value
    return found


def _poll(check: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Whether `check()` holds within `timeout_s` (Ray exports metrics every second here)."""
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.5)
    return check()


@pytest.mark.slow
def test_two_device_replicas_serve_a_conversation_from_device_checkpoints(
    device_app, from_scratch, tiny_model, make_engine, arch
) -> None:
    url, config = device_app
    scratch = from_scratch["turns"]
    cpu = make_engine(tiny_model(arch), **SETTINGS, n_gpu_layers=0)
    first, added = _conversation(cpu.model.n_vocab)
    second = first + scratch[0]["tokens"] + added

    reply = _complete(url, config, first)
    assert reply["choices"][0]["text"] == scratch[0]["text"]
    reply = _complete(url, config, second)
    assert reply["choices"][0]["text"] == scratch[1]["text"]

    # The same turns on CPU: the second from the whole first turn (its reply replayed and
    # checkpointed), then a fork of the first turn's prompt, from that prompt's checkpoint
    # two tokens before its end. On the app the second turn gets the first if the replica
    # holding the conversation, or its peer pulling from it, finds the reply's checkpoint;
    # the second if the peer pulls while the holder is still replaying the reply.
    cpu.generate(Prompt(tokens=tuple(first)), SamplingParams(max_tokens=MAX_TOKENS))
    whole = cpu.generate(Prompt(tokens=tuple(second)), SamplingParams(max_tokens=MAX_TOKENS))
    fork = cpu.generate(Prompt(tokens=tuple(first + added)), SamplingParams(max_tokens=1))
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached in (whole.usage.cached_tokens, fork.usage.cached_tokens)
    # A hybrid restores the checkpoint two tokens before the first prompt's end.
    assert fork.usage.cached_tokens == len(first) - 2 < whole.usage.cached_tokens

    device = from_scratch["device"]
    assert _poll(lambda: _scrape("ray_baton_device", "device") == {device: 2})
    if cached == fork.usage.cached_tokens:  # pulled: shipped from one device to the other
        # The replicas' own counters: Ray's metrics export can lag a loaded machine by more
        # than any poll here (a CI run saw the pull's text and cached count, not its sample).
        stats = asyncio.run(replica_stats(APP_NAME))
        assert sum(s["pulls"] for s in stats) == 1, stats


if __name__ == "__main__":
    scratch_child(sys.argv[1])
