"""Deploying is refused, by name, when the replicas' checkpoint budgets cannot fit the object
store of a node they may run on (`deploy/capacity_check.py`); real local Ray clusters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from baton_serve.deploy.capacity_check import (
    DEFAULT_BUDGET_SHARE,
    ObjectStoreTooSmall,
    check_object_store_fits,
    fit_store_budget,
)
from baton_serve.deploy.config import BatonConfig, RouterPolicy
from baton_serve.replicas.engine.engine_config import EngineConfig

# Of the memory available: a few hundred MiB here (Ray refuses less than 75 MiB).
SMALL_STORE_PROPORTION = "0.02"


def test_baton_serve_refuses_budgets_the_object_store_cannot_hold(tmp_path: Path) -> None:
    """`baton serve` on its own local Ray with a small object store: two replicas of a
    2 GiB store budget the user set are refused before anything is deployed."""
    env = {
        **os.environ,
        "BATON_CACHE_DIR": str(tmp_path),
        "BATON_ENGINE__STORE_BUDGET_BYTES": str(2 << 30),
        "RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION": SMALL_STORE_PROPORTION,
    }
    done = subprocess.run(
        [sys.executable, "-m", "baton_serve.deploy.cli", "serve", "--model", "tiny:llama"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("baton:")]
    assert line.startswith("baton: error: the replicas' checkpoint stores cannot fit"), line
    for named in ("up to 2 replica(s)", "replicas=2", "engine.store_budget_bytes=2.0 GiB"):
        assert named in line
    assert "MiB" in line.split("its object store holds")[1]
    assert "BATON_ENGINE__STORE_BUDGET_BYTES" in line and "max_replicas_per_node" in line
    assert "starting 2 replica(s)" not in done.stdout  # refused before anything deployed


def test_a_config_that_fits_the_node_passes(ray_cluster: None) -> None:
    """The session's local Ray: budgets up to the node's object store pass; one MiB more
    per replica is refused, unless fewer replicas may share the node."""
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    store = int(node["Resources"]["object_store_memory"])
    cpus = int(node["Resources"]["CPU"])

    def config(budget: int, **fields: object) -> BatonConfig:
        engine = EngineConfig(store_budget_bytes=budget)
        return BatonConfig(replicas=cpus, engine=engine, **fields)

    check_object_store_fits(config(store // cpus))
    too_big = config(store // cpus + (1 << 20))
    with pytest.raises(ObjectStoreTooSmall, match=f"up to {cpus} replica"):
        check_object_store_fits(too_big)
    check_object_store_fits(config(store // cpus + (1 << 20), max_replicas_per_node=cpus - 1))
    check_object_store_fits(config(store, router=RouterPolicy.POW2))  # ships nothing


def test_the_default_budget_is_lowered_to_fit_and_a_chosen_one_is_kept(
    ray_cluster: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default budget is a default: on a node whose object store cannot hold it for
    every replica it is lowered (with a note) to fit; a budget the user set is left for
    `check_object_store_fits` to judge."""
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    store = int(node["Resources"]["object_store_memory"])
    replicas = 4 * int(node["Resources"]["CPU"])  # a quarter CPU each: all fit the node
    shape = {"replicas": replicas, "num_cpus_per_replica": 0.25}
    default = BatonConfig(**shape)
    assert "store_budget_bytes" not in default.engine.model_fields_set
    assert default.engine.store_budget_bytes * replicas > store  # more than the node holds
    fitted = fit_store_budget(default)
    assert fitted.engine.store_budget_bytes == int(store * DEFAULT_BUDGET_SHARE // replicas)
    check_object_store_fits(fitted)
    assert "store_budget_bytes lowered from its default" in capsys.readouterr().out
    chosen = BatonConfig(**shape, engine=EngineConfig(store_budget_bytes=2 << 30))
    assert fit_store_budget(chosen) is chosen
    with pytest.raises(ObjectStoreTooSmall):
        check_object_store_fits(chosen)
