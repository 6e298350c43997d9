"""Ray places replicas on devices: each replica's llama.cpp sees exactly the GPU(s) Ray
assigned its actor (`replicas/device_assignment.py`), and replicas asking for more GPUs than
the cluster has are refused by name (`deploy/capacity_check.py`).

The cluster is a local Ray started with two declared GPUs; none is real here, so Ray's ids
reach llama.cpp's Vulkan module, whose only device is Mesa's lavapipe (index 0): the replica
given GPU 0 offloads to it, the one given GPU 1 finds no such Vulkan device and runs on the
CPU, saying so. Where lavapipe is missing both run on the CPU; the ids are checked alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
from fixtures_ray import session_ray_paused, wait_healthy
from ray import serve

from baton_serve.deploy.app import APP_NAME, build_app
from baton_serve.deploy.capacity_check import TooFewGpus, check_gpus_fit, gpu_room
from baton_serve.deploy.config import BatonConfig
from baton_serve.deploy.local_ray import NAMESPACE
from baton_serve.deploy.ports import free_port
from baton_serve.loadtests.serve_app import replica_stats
from baton_serve.replicas.device_assignment import (
    CUDA_DEVICES,
    VULKAN_DEVICES,
    apply_devices,
    visible_devices,
)
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.models.model_check import ModelCheckFailed, check_model

DECLARED_GPUS = 2
LAVAPIPE = {VULKAN_DEVICES: "0"}
ENGINE = {"n_ctx": 256, "n_slots": 1, "n_threads": 1, "n_gpu_layers": -1}
START_TIMEOUT_S = 600.0  # a fresh machine compiles lavapipe's shaders once


def test_the_visible_devices_are_rays_ids_for_cuda_and_vulkan() -> None:
    assert visible_devices([]) == {}  # no GPU asked: the environment stays as it is
    assert visible_devices(["1"]) == {CUDA_DEVICES: "1", VULKAN_DEVICES: "1"}
    assert visible_devices(["0", "3"]) == {CUDA_DEVICES: "0,3", VULKAN_DEVICES: "0,3"}
    # A node started with GPU UUIDs: Vulkan counts devices by index, so only CUDA is set.
    assert visible_devices(["GPU-5a1c"]) == {CUDA_DEVICES: "GPU-5a1c"}


def test_rays_assignment_wins_over_an_earlier_value_with_a_warning() -> None:
    env = {CUDA_DEVICES: "1", VULKAN_DEVICES: "0", "OTHER": "x"}
    (warning,) = apply_devices(visible_devices(["1"]), env)
    assert env == {CUDA_DEVICES: "1", VULKAN_DEVICES: "1", "OTHER": "x"}
    assert warning == f"{VULKAN_DEVICES} was '0'; Ray assigned GPU(s) 1, which this replica uses"
    assert apply_devices({}, env) == [] and env[VULKAN_DEVICES] == "1"


def test_a_share_below_one_gpu_never_spans_two() -> None:
    assert gpu_room(2, 1) == 2 and gpu_room(2, 0.5) == 4 and gpu_room(2, 0.4) == 4
    assert gpu_room(4, 2) == 2 and gpu_room(0, 0.5) == 0 and gpu_room(1, 0.1) == 10


def test_baton_serve_refuses_gpus_this_machine_lacks(tmp_path: Path) -> None:
    """`baton serve` on its own local Ray: a replica asking for more GPUs than the machine
    has is refused before anything is deployed, rather than waiting forever to be placed."""
    env = {**os.environ, "BATON_CACHE_DIR": str(tmp_path)}
    command = ["serve", "--model", "tiny:llama", "--replicas", "1", "--gpus-per-replica", "64"]
    done = subprocess.run(
        [sys.executable, "-m", "baton_serve.deploy.cli", *command],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("baton:")]
    assert "num_gpus_per_replica (--gpus-per-replica)" in line
    assert "replicas=1 x num_gpus_per_replica=64 = 64 GPU(s) asked" in line
    assert "room for 0 replica(s)" in line
    assert "starting 1 replica(s)" not in done.stdout


@contextlib.contextmanager
def gpu_cluster(num_gpus: int) -> Iterator[int]:
    """A local Ray declaring `num_gpus` GPUs, with Serve on a free port (yielded); the
    session's Ray is paused meanwhile."""
    with session_ray_paused():
        ray.init(
            address="local",
            num_cpus=2,
            num_gpus=num_gpus,
            include_dashboard=False,
            log_to_driver=False,
            namespace=NAMESPACE,
        )
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            yield port
        finally:
            serve.shutdown()
            ray.shutdown()


@pytest.fixture(scope="module")
def two_gpus() -> Iterator[int]:
    with gpu_cluster(DECLARED_GPUS) as port:
        yield port


@pytest.fixture(scope="module")
def lavapipe_device(tiny_model) -> str:
    """What llama.cpp names Vulkan device 0 in a process of its own ("CPU": none here)."""
    try:
        return check_model(tiny_model("llama"), n_gpu_layers=-1, env=LAVAPIPE).device
    except ModelCheckFailed:
        return "CPU"


def _config(model: Path, replicas: int, gpus: float, **extra: object) -> BatonConfig:
    return BatonConfig(
        model=str(model),
        replicas=replicas,
        num_gpus_per_replica=gpus,
        num_cpus_per_replica=0.5,
        engine=EngineConfig(**ENGINE),
        hmac_key=secrets.token_hex(16),
        **extra,
    )


def test_more_gpus_than_the_cluster_has_are_refused_by_name(two_gpus, tiny_model) -> None:
    model = tiny_model("llama")
    for replicas, gpus in ((2, 1), (4, 0.5), (1, 2), (2, 0)):
        check_gpus_fit(_config(model, replicas, gpus))
    with pytest.raises(TooFewGpus) as refused:
        check_gpus_fit(_config(model, 3, 1))
    message = str(refused.value)
    assert message.startswith("num_gpus_per_replica (--gpus-per-replica) asks for more GPUs")
    assert "replicas=3 x num_gpus_per_replica=1 = 3 GPU(s) asked" in message
    assert "1 node(s) have 2 GPU(s), room for 2 replica(s)" in message
    with pytest.raises(TooFewGpus, match=r"= 2 GPU\(s\) asked, .* room for 4 replica"):
        check_gpus_fit(_config(model, 5, 0.4))  # 2 GPUs' worth, but 0.4 fits twice per GPU
    with pytest.raises(TooFewGpus, match=r"room for 1 replica\(s\), max_replicas_per_node=1"):
        check_gpus_fit(_config(model, 2, 0.5, max_replicas_per_node=1))


def _deployed(port: int, config: BatonConfig) -> list[dict]:
    """Each replica's stats, once the app for `config` serves a completion."""
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, timeout_s=START_TIMEOUT_S)
    body = {"model": config.served_model_name, "prompt": [1, 2, 3], "max_tokens": 2}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return asyncio.run(replica_stats(APP_NAME))


@pytest.mark.slow
def test_two_replicas_with_a_gpu_each_see_two_devices(two_gpus, tiny_model, lavapipe_device):
    """Ray's ids win over `replica_env`'s Vulkan variable: the replica given GPU 1 does not
    take device 0 (lavapipe) that `replica_env` names for every replica."""
    config = _config(tiny_model("llama"), 2, 1, replica_env=LAVAPIPE)
    try:
        stats = _deployed(two_gpus, config)
    finally:
        serve.delete(APP_NAME)
    devices = {s["gpu_ids"]: s["device"] for s in stats}
    assert devices == {"0": lavapipe_device, "1": "CPU"}


@pytest.mark.slow
def test_replicas_sharing_one_gpu_both_use_it(two_gpus, tiny_model, lavapipe_device) -> None:
    """Half a GPU each: Ray packs both onto GPU 0, and both replicas' engines use it (no
    `replica_env`: Ray's assignment alone names lavapipe)."""
    config = _config(tiny_model("llama"), 2, 0.5)
    try:
        stats = _deployed(two_gpus, config)
    finally:
        serve.delete(APP_NAME)
    assert [(s["gpu_ids"], s["device"]) for s in stats] == [("0", lavapipe_device)] * 2
