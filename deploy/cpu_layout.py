"""The CPUs `baton serve` may use on this machine, and how its local cluster shares them out:
every replica an equal share, its llama.cpp threads as many as its Ray CPUs."""

from __future__ import annotations

import math
import os
from pathlib import Path

from baton_serve.deploy.config import BatonConfig

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
SYS_CPUS = Path("/sys/devices/system/cpu")


def usable_cpus(cgroup_cpu_max: Path = CGROUP_CPU_MAX, sys_cpus: Path = SYS_CPUS) -> int:
    """The cores this process may compute on: the physical cores of its affinity mask (two
    hyperthreads of one core count once, as llama.cpp counts them for its own default),
    capped by a cgroup v2 CPU quota (a container limited to 2.5 CPUs gets 3); at least 1."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = _physical_cores(allowed, sys_cpus) or len(allowed) or os.cpu_count() or 1
    quota = cgroup_quota(cgroup_cpu_max)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def cgroup_quota(cpu_max: Path) -> float | None:
    """CPUs a cgroup v2 `cpu.max` allows ("QUOTA PERIOD"); None without a limit or file."""
    try:
        fields = cpu_max.read_text().split()
    except OSError:
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota = int(fields[0]) / int(fields[1])
    except (ValueError, ZeroDivisionError):
        return None
    return quota if quota > 0 else None


def _physical_cores(cpus: list[int], sys_cpus: Path) -> int:
    """Distinct cores among `cpus` by their hyperthread siblings; 0 where unreadable."""
    cores = set()
    for cpu in cpus:
        try:
            cores.add((sys_cpus / f"cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            return 0
    return len(cores)


def share_cpus(config: BatonConfig, cpus: int) -> BatonConfig:
    """`config` with its replicas sharing `cpus` equally: each asks Ray for `cpus // replicas`
    (at least 1) and `build_app` gives its engine as many threads, which compute on the cores
    the other replicas leave idle too (`engine.node_cores`). A layout the config sets
    (`num_cpus_per_replica`, `engine.n_threads` or `engine.node_cores`) is kept."""
    engine = config.engine
    chosen = {"n_threads", "node_cores"} & engine.model_fields_set
    if chosen or "num_cpus_per_replica" in config.model_fields_set:
        return config
    share = max(1, cpus // config.replicas)
    update: dict[str, object] = {"num_cpus_per_replica": float(share)}
    if share < cpus:
        update["engine"] = engine.model_copy(update={"node_cores": cpus})
    return config.model_copy(update=update)
