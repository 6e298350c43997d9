"""Which GPU a replica's engine uses: exactly the one(s) Ray assigned to its actor.

A replica asks Ray for `num_gpus_per_replica` GPUs (fractions share one GPU). Ray sets
`CUDA_VISIBLE_DEVICES` in the actor's process to the ids it assigned, but not llama.cpp's
Vulkan variable, `GGML_VK_VISIBLE_DEVICES`, so without it every replica on a node would
take every Vulkan GPU. `assign_ray_devices` sets both from Ray's assignment before
llama.cpp's backends load in the process (they read the variables once, when loaded).

The rule: Ray's assignment wins over a value the process already had (`replica_env`, the
node's environment), with a warning naming both; a replica that asked for no GPU keeps its
environment as it is (lavapipe is named that way: `GGML_VK_VISIBLE_DEVICES=0`). Ray's ids
are the node's device numbers (CUDA's order, or the node's own `CUDA_VISIBLE_DEVICES`), and
the Vulkan variable gets the same numbers: this assumes Vulkan lists the node's GPUs in that
order with no other Vulkan device (a software one) before them. An id Vulkan does not have
leaves llama.cpp without its Vulkan module: the model runs on the CPU and says so.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping, Sequence

import ray

from baton_serve.replicas.engine import ggml_backends

logger = logging.getLogger("baton.devices")

CUDA_DEVICES = "CUDA_VISIBLE_DEVICES"
VULKAN_DEVICES = "GGML_VK_VISIBLE_DEVICES"


def visible_devices(gpu_ids: Sequence[str]) -> dict[str, str]:
    """The visible-devices variables of a process Ray gave `gpu_ids` (empty: none to set).
    Vulkan numbers devices by index, so ids that are not numbers (GPU UUIDs) set CUDA's only."""
    if not gpu_ids:
        return {}
    ids = ",".join(gpu_ids)
    wanted = {CUDA_DEVICES: ids}
    if all(gpu.isdigit() for gpu in gpu_ids):
        wanted[VULKAN_DEVICES] = ids
    return wanted


def apply_devices(
    wanted: Mapping[str, str], env: MutableMapping[str, str] | None = None
) -> list[str]:
    """Set `wanted` in `env` (this process's environment); returns a warning for each
    variable whose earlier value it replaced."""
    env = os.environ if env is None else env
    replaced = []
    for name, value in wanted.items():
        before = env.get(name)
        if before is not None and before != value:
            replaced.append(
                f"{name} was {before!r}; Ray assigned GPU(s) {value}, which this replica uses"
            )
        env[name] = value
    return replaced


def assign_ray_devices() -> str:
    """Make this Ray actor's llama.cpp use the GPUs Ray assigned to it; returns their ids
    ("" when it asked for none: the environment is left as it is). Call it before the
    engine loads llama.cpp's backends."""
    gpu_ids = [str(gpu) for gpu in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
    wanted = visible_devices(gpu_ids)
    if wanted and ggml_backends.libggml.ggml_backend_dev_count() > 0:
        logger.warning(
            "llama.cpp's backends were loaded in this process before Ray's GPU assignment "
            "(%s) was applied: they keep the devices they found",
            ",".join(gpu_ids),
        )
    for line in apply_devices(wanted):
        logger.warning("%s", line)
    if wanted:
        logger.info("Ray assigned GPU(s) %s: %s", ",".join(gpu_ids), wanted)
    return ",".join(gpu_ids)
