"""The embedded index actor, started on the head node before any replica could start it.

Whoever first connects to the embedded index creates its actor, and Ray places an actor on
or near its creator's node; left to the replicas, the index would live on a worker and die
with it (to restart empty elsewhere). The head runs Ray's GCS and the Serve controller: if
it dies, so does the application, so the index there adds no failure of its own.
"""

from __future__ import annotations

from baton_serve.cache_store.index.embedded_index import ACTOR_NAME, ACTOR_NAMESPACE, IndexActor

# A resource only the head node has (ray._common.constants.HEAD_NODE_RESOURCE_NAME). Asking
# for a sliver of it, not for the head's node id, lets the actor restart on a new head
# (KubeRay's GCS fault tolerance) instead of waiting forever for the old one.
HEAD_NODE_RESOURCE = "node:__internal_head__"


def start_embedded_index_on_head() -> None:
    """Create the detached index actor on the head node, unless it exists (then nothing
    changes). Replicas and routers connect to it by name as before. Needs Ray initialised."""
    IndexActor.options(  # type: ignore[attr-defined]
        name=ACTOR_NAME,
        namespace=ACTOR_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        resources={HEAD_NODE_RESOURCE: 0.001},
    ).remote()
