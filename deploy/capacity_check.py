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

GPUs likewise (`check_gpus_fit`): replicas asking for more GPUs than a cluster that cannot
grow has are refused by name, before Serve would wait forever to place the last one.
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


class TooFewGpus(ConfigError):
    """The replicas ask for more GPUs than the cluster has."""


def gpu_room(gpus: float, ask: float) -> int:
    """How many replicas asking `ask` GPUs each a node with `gpus` GPUs holds: Ray puts a
    share below one GPU on a single GPU, never across two (3 x 0.4 on 2 GPUs: 2 fit)."""
    if ask < 1:
        return math.floor(gpus + _ROUNDING) * math.floor(1 / ask + _ROUNDING)
    return math.floor(gpus / ask + _ROUNDING)


def replicas_on_node(config: BatonConfig, resources: dict[str, float]) -> int:
    """The most replicas of `config` Serve may place on a node with `resources` (totals)."""
    room = config.replicas
    if config.max_replicas_per_node is not None:
        room = min(room, config.max_replicas_per_node)
    if config.num_gpus_per_replica > 0:
        room = min(room, gpu_room(resources.get("GPU", 0.0), config.num_gpus_per_replica))
    asks = {"CPU": config.num_cpus_per_replica, **config.replica_resources}
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


def check_gpus_fit(config: BatonConfig, nodes: list[dict] | None = None) -> None:
    """Raise `TooFewGpus` naming `num_gpus_per_replica`, the GPUs asked and those the live
    nodes have, if they cannot hold `replicas` replicas of `num_gpus_per_replica` GPUs each.
    Only for a cluster that cannot grow (the one `baton serve` starts): an autoscaler may
    add GPU nodes to others. `nodes`: `ray.nodes()` (read here when Ray is initialised)."""
    ask = config.num_gpus_per_replica
    live = _live_nodes(nodes)
    if ask == 0 or not live:
        return
    gpus = sum(node.get("Resources", {}).get("GPU", 0.0) for node in live)
    per_node = config.max_replicas_per_node
    room = sum(
        min(gpu_room(node.get("Resources", {}).get("GPU", 0.0), ask), per_node or config.replicas)
        for node in live
    )
    if room >= config.replicas:
        return
    limit = f", max_replicas_per_node={per_node}" if per_node is not None else ""
    raise TooFewGpus(
        f"num_gpus_per_replica (--gpus-per-replica) asks for more GPUs than this cluster has: "
        f"replicas={config.replicas} x num_gpus_per_replica={ask:g} = "
        f"{config.replicas * ask:g} GPU(s) asked, but its {len(live)} node(s) have {gpus:g} "
        f"GPU(s), room for {room} replica(s){limit} (a share below one GPU never spans two). "
        "Lower replicas or num_gpus_per_replica (0.5: two replicas share a GPU), or give Ray "
        "more GPUs (ray start --num-gpus)"
    )


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
