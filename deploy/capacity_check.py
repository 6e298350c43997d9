"""Before anything is deployed: do the replicas' checkpoint stores fit the object stores of
the nodes they may run on?

A replica that ships states to peers keeps each checkpoint it saves or pulls in Ray's object
store, up to its store budget (`engine.store_budget_bytes`), as a read-only view it holds:
Ray can neither evict nor spill such an object (`replicas/shipping.py`). Serve may place as
many replicas on one node as that node's resources hold (and `max_replicas_per_node`
allows), so that many budgets must fit the node's object store. A node with no room for a
replica is not counted; nor is one that does not exist yet (an autoscaled cluster).

A budget the user set is checked and, if it cannot fit, refused by name. The default budget
is a default, not a demand: `fit_store_budget` lowers it to what the smallest node holds (with
headroom for Ray's own objects), so `baton serve` starts on a small machine too.
"""

from __future__ import annotations

import math

import ray

from baton_serve.deploy.config import BatonConfig, ConfigError, RouterPolicy

_ROUNDING = 1e-9  # resources are floats: 1.0 / 0.1 must count 10 replicas, not 9
# Of a node's object store, the share a default budget may take: Ray's own objects (handles,
# replies, Serve's state) live there too.
DEFAULT_BUDGET_SHARE = 0.8


class ObjectStoreTooSmall(ConfigError):
    """The replicas' checkpoint budgets cannot fit a node's object store."""


def replicas_on_node(config: BatonConfig, resources: dict[str, float]) -> int:
    """The most replicas of `config` Serve may place on a node with `resources` (totals)."""
    room = config.replicas
    if config.max_replicas_per_node is not None:
        room = min(room, config.max_replicas_per_node)
    asks = {
        "CPU": config.num_cpus_per_replica,
        "GPU": config.num_gpus_per_replica,
        **config.replica_resources,
    }
    for name, amount in asks.items():
        if amount > 0:
            room = min(room, math.floor(resources.get(name, 0.0) / amount + _ROUNDING))
    return room


def _ships(config: BatonConfig) -> bool:
    return config.router is RouterPolicy.BATON and config.engine.prefix_cache


def _live_nodes(nodes: list[dict] | None) -> list[dict]:
    if nodes is None:
        if not ray.is_initialized():
            return []
        nodes = ray.nodes()
    return [node for node in nodes if node.get("Alive", False)]


def fit_store_budget(config: BatonConfig, nodes: list[dict] | None = None) -> BatonConfig:
    """`config`, with the default `engine.store_budget_bytes` lowered to what every live
    node's object store holds for the replicas it may run (`DEFAULT_BUDGET_SHARE` of it);
    a budget the user set is returned unchanged (`check_object_store_fits` judges it)."""
    budget = config.engine.store_budget_bytes
    if "store_budget_bytes" in config.engine.model_fields_set or not _ships(config):
        return config
    fitting = budget
    for node in _live_nodes(nodes):
        resources = node.get("Resources", {})
        replicas = replicas_on_node(config, resources)
        if replicas > 0:
            share = resources.get("object_store_memory", 0) * DEFAULT_BUDGET_SHARE
            fitting = min(fitting, int(share // replicas))
    if fitting >= budget:
        return config
    print(
        f"note: engine.store_budget_bytes lowered from its default {_size(budget)} to "
        f"{_size(fitting)} per replica, to fit this cluster's object store "
        "(set it, or BATON_ENGINE__STORE_BUDGET_BYTES, to choose)",
        flush=True,
    )
    engine = config.engine.model_copy(update={"store_budget_bytes": fitting})
    return config.model_copy(update={"engine": engine})


def check_object_store_fits(config: BatonConfig, nodes: list[dict] | None = None) -> None:
    """Raise `ObjectStoreTooSmall` naming the node, the replicas, the budget, the object
    store's size and the fields to change, if replicas × `engine.store_budget_bytes` cannot
    fit the object store of a live node they may run on. `nodes`: `ray.nodes()` (read here
    when Ray is initialised; without Ray there is nothing to check against)."""
    budget = config.engine.store_budget_bytes
    if not _ships(config) or budget == 0:
        return  # no checkpoint goes to the object store
    for node in _live_nodes(nodes):
        resources = node.get("Resources", {})
        replicas = replicas_on_node(config, resources)
        capacity = int(resources.get("object_store_memory", 0))
        if replicas > 0 and replicas * budget > capacity:
            raise ObjectStoreTooSmall(_refusal(config, node, replicas, capacity))


def _refusal(config: BatonConfig, node: dict, replicas: int, capacity: int) -> str:
    budget = config.engine.store_budget_bytes
    where = f"{node.get('NodeManagerAddress', '?')} (node {str(node.get('NodeID', '?'))[:8]})"
    per_node = config.max_replicas_per_node
    return (
        f"the replicas' checkpoint stores cannot fit the object store of {where}: up to "
        f"{replicas} replica(s) may run there (replicas={config.replicas}, "
        f"max_replicas_per_node={per_node if per_node is not None else 'unset'}, "
        f"num_cpus_per_replica={config.num_cpus_per_replica:g}) x "
        f"engine.store_budget_bytes={_size(budget)} = {_size(replicas * budget)}, but its "
        f"object store holds {_size(capacity)}. Lower engine.store_budget_bytes "
        f"(BATON_ENGINE__STORE_BUDGET_BYTES) to at most {capacity // replicas} bytes "
        f"({_size(capacity // replicas)}), set "
        "max_replicas_per_node, or give the node a larger object store "
        "(ray start --object-store-memory)"
    )


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
