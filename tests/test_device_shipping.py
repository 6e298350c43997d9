"""A state shipped from a device replica to a CPU replica, and back, continues the
conversation.

Three real replica actors (real engines, Ray's object store, a real Redis index) hold one
generated hybrid (qwen35): `device-a` and `device-b` offload every layer to Mesa's software
Vulkan device (lavapipe, named by `GGML_VK_VISIBLE_DEVICES=0` in their process environment
only), `cpu` runs on the CPU. `device-a` computes a conversation's first turn; `cpu` pulls its
checkpoint, saved from device memory, and serves the second turn; `device-b` pulls the state
`cpu` saved and serves the third. Every pull must be accepted (validated, restored), cover the
whole conversation so far, and give the greedy tokens the CPU computes from scratch. Device and
CPU kernels round differently: logits are not compared, only greedy tokens, which on this model
agree (tests/test_vulkan_device.py checks that on its own).
"""

from __future__ import annotations

import asyncio
import secrets

import numpy as np
import pytest
import ray
from lavapipe import CHILD_TIMEOUT_S, DEVICE_ENV, require_vulkan_module, skip_unless_device

from baton_serve.cache_store.index.index_connect import connect_index
from baton_serve.cache_store.pull_cost import ShipCost
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import GenerationRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.replica_actor import spawn_replica
from baton_serve.replicas.shipping import ShipPolicy

KEY = secrets.token_bytes(32)
# Replays and plain attention pinned, as on the CPU (a device's own defaults keep the decode's
# state instead: test_vulkan_device), so both sides store the same checkpoints.
CPU = EngineConfig(n_ctx=2048, n_slots=1, n_threads=1, exact_reuse=True, flash_attn=False)
DEVICE = CPU.model_copy(update={"n_gpu_layers": -1})
EAGER = ShipPolicy(ShipCost(min_gain_tokens=16, safety=1.0), prefill_tokens_per_s=50.0)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)

pytestmark = pytest.mark.slow


def _tokens(seed: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(1000, 40000, size=n))


def _request(tokens: tuple[int, ...]) -> GenerationRequest:
    return GenerationRequest(prompt=Prompt(tokens=tokens), sampling=GREEDY)


async def _until_indexed(spec: str, engine: Engine, tokens: tuple[int, ...], replica: str) -> None:
    """Until `replica` holds `tokens`' whole chain in the index (its checkpoints publish
    shortly after the reply's replay)."""
    index = await connect_index(spec, engine.fingerprint)
    try:
        chain = engine.hash_chain(tokens)
        for _ in range(200):
            if replica in await index.lookup(chain):
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{replica} never published {len(tokens)} tokens to the index")
    finally:
        await index.close()


def test_a_state_goes_device_to_cpu_and_back(redis_server, ray_cluster, tiny_model) -> None:
    require_vulkan_module()
    path, spec = str(tiny_model("qwen35")), redis_server.url

    def replica(name: str, config: EngineConfig, env: dict[str, str] | None = None):
        return spawn_replica(
            name, path, config, hmac_key=KEY, index=spec, policy=EAGER, heartbeat_s=0.2, env=env
        )

    actors = {
        "device-a": replica("device-a", DEVICE, DEVICE_ENV),
        "cpu": replica("cpu", CPU),
        "device-b": replica("device-b", DEVICE, DEVICE_ENV),
    }
    try:
        ray.get([a.start.remote() for a in actors.values()], timeout=CHILD_TIMEOUT_S)
        devices = {name: ray.get(actor.device.remote()) for name, actor in actors.items()}
        assert devices["cpu"] == "CPU", devices
        skip_unless_device(devices["device-a"])
        assert devices["device-a"] == devices["device-b"] and "Vulkan0" in devices["device-a"]
        cold = CPU.model_copy(update={"prefix_cache": False})
        with Engine(path, cold, hmac_key=KEY) as scratch, Engine(path, CPU, hmac_key=KEY) as local:
            conversation, held = _tokens(1, 300), 0
            for turn, name in enumerate(actors):
                prompt = conversation
                done = ray.get(actors[name].generate.remote(_request(prompt)))
                expected = scratch.generate(Prompt(tokens=prompt), GREEDY)
                assert done.tokens == expected.tokens, (name, done.tokens, expected.tokens)
                stats, _ = ray.get(actors[name].stats.remote())
                if turn:  # served from the state the previous replica saved
                    assert (stats.pulls, stats.pulls_rejected) == (1, 0), (name, stats)
                    assert done.usage.cached_tokens == held, (name, done.usage)
                assert ray.get(actors[name].wait_idle.remote())
                held = len(prompt) + len(done.tokens)
                conversation = prompt + tuple(done.tokens)
                asyncio.run(_until_indexed(spec, local, conversation, name))
                conversation += _tokens(10 + turn, 40)
    finally:
        for actor in actors.values():
            ray.kill(actor)
