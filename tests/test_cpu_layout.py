"""How `baton serve`'s local cluster shares this machine's cores (`deploy/cpu_layout.py`):
the cores it may use (affinity, hyperthreads, a container's CPU quota) and an equal share
for each replica, as its Ray CPUs and its llama.cpp threads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from baton_serve.deploy.app import engine_threads
from baton_serve.deploy.config import BatonConfig
from baton_serve.deploy.cpu_layout import cgroup_quota, share_cpus, usable_cpus


def _cpu_max(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cpu.max"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "quota"),
    [
        ("max 100000\n", None),
        ("150000 100000\n", 1.5),
        ("200000 100000", 2.0),
        ("0 100000", None),
        ("nonsense", None),
        ("1 0", None),
    ],
)
def test_a_cgroup_quota_is_read_from_cpu_max(tmp_path: Path, text: str, quota) -> None:
    assert cgroup_quota(_cpu_max(tmp_path, text)) == quota


def test_this_machines_cores(tmp_path: Path) -> None:
    no_quota = tmp_path / "absent"
    cores = usable_cpus(no_quota)
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    assert usable_cpus(_cpu_max(tmp_path, "150000 100000")) == min(cores, 2)  # 1.5 rounds up
    assert usable_cpus(_cpu_max(tmp_path, "10000 100000")) == 1


def test_hyperthreads_of_one_core_count_once(tmp_path: Path) -> None:
    """A fake /sys topology (this machine's is what it is): CPUs 0 and 1 are one core's two
    hyperthreads, the others cores of their own."""
    allowed = sorted(os.sched_getaffinity(0))
    for cpu in allowed:
        siblings = "0-1" if cpu in (0, 1) else str(cpu)
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(siblings + "\n")
    paired = sum(cpu in (0, 1) for cpu in allowed)
    expected = len(allowed) - (1 if paired == 2 else 0)
    assert usable_cpus(tmp_path / "no-quota", tmp_path) == expected
    # an unreadable topology: every allowed CPU counts
    assert usable_cpus(tmp_path / "no-quota", tmp_path / "nowhere") == len(allowed)


@pytest.mark.parametrize(
    ("cpus", "replicas", "share"), [(16, 2, 8), (2, 2, 1), (3, 2, 1), (16, 4, 4), (1, 2, 1)]
)
def test_replicas_share_the_cores_equally(cpus: int, replicas: int, share: int) -> None:
    config = share_cpus(BatonConfig(replicas=replicas), cpus)
    assert config.num_cpus_per_replica == share
    assert engine_threads(config) == share


def test_a_layout_the_config_sets_is_kept() -> None:
    cpus = BatonConfig(replicas=2, num_cpus_per_replica=3)
    assert share_cpus(cpus, 16) == cpus and engine_threads(cpus) == 3
    threads = BatonConfig.model_validate({"replicas": 2, "engine": {"n_threads": 5}})
    kept = share_cpus(threads, 16)
    assert kept.num_cpus_per_replica == 1 and engine_threads(kept) == 5
