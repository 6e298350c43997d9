"""A Ray cluster of several nodes on this machine, for benchmarks that must cross nodes.

Each node (`ray.cluster_utils.Cluster`) has its own raylet and object store, so an object
made on one node is copied to another by Ray's object manager, as between machines. Worker
`i` alone offers the custom resource `node_resource(i)`: an actor asking for it runs there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import ray
from ray.cluster_utils import Cluster

from baton_serve.deploy.local_ray import NAMESPACE, cluster_runtime_env

NODE_CPUS = 1
OBJECT_STORE_BYTES = 512 << 20  # each node's own store


def node_resource(worker: int) -> str:
    """The custom resource only worker `worker` (0-based) offers."""
    return f"baton_bench_node_{worker}"


@contextlib.contextmanager
def local_cluster(workers: int = 2) -> Iterator[Cluster]:
    """A head and `workers` worker nodes, with this process connected as a driver; all of
    it shut down at the end. Ray's files go under a private folder: the cluster records its
    address in $RAY_TMPDIR, where any other `ray.init()` on this machine would find it."""
    ray_dir = tempfile.mkdtemp(prefix="btbn", dir="/tmp")  # short: Ray's socket paths
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = ray_dir
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": NODE_CPUS,
                "object_store_memory": OBJECT_STORE_BYTES,
                "include_dashboard": False,
            },
        )
        try:
            for i in range(workers):
                cluster.add_node(
                    num_cpus=NODE_CPUS,
                    resources={node_resource(i): 1},
                    object_store_memory=OBJECT_STORE_BYTES,
                )
            cluster.wait_for_nodes()
            ray.init(
                address=cluster.address,
                namespace=NAMESPACE,
                log_to_driver=False,
                runtime_env=cluster_runtime_env(started_here=True),
            )
            try:
                yield cluster
            finally:
                ray.shutdown()
        finally:
            cluster.shutdown()
    finally:
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
        shutil.rmtree(ray_dir, ignore_errors=True)
