"""The replica as a Ray Serve deployment: one engine per replica, on a GPU or the CPU.

Peers are reached through a handle to this same deployment: a call carrying
`target_replica=<id>` is routed to exactly that replica by Baton's request router.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator

from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve.handle import DeploymentHandle

from baton_serve.cache_store.checkpoints.cluster_key import read_cluster_key
from baton_serve.cache_store.index.index import IndexUnavailable
from baton_serve.cache_store.index.index_connect import connect_cluster_index
from baton_serve.cache_store.pull_cost import ShipCost
from baton_serve.cache_store.telemetry.setup import configure_process
from baton_serve.cache_store.telemetry.startup import report_stage
from baton_serve.cache_store.wire.protocol import (
    TARGET_REPLICA_KWARG,
    Admitted,
    Completion,
    ReplicaRequest,
    TokenEvent,
)
from baton_serve.cache_store.wire.stream_batches import batches
from baton_serve.replicas.device_assignment import assign_ray_devices
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.replica import Replica
from baton_serve.replicas.shipping import (
    PeerReply,
    ShippedBlob,
    ShipPolicy,
    StillComputing,
    fetch_offering_stream,
    share_in_object_store,
)
from baton_serve.replicas.state_stream import StateReceiver, StreamOffer
from baton_serve.replicas.stream_limits import ReceiverBounds, StreamLimits


class ReplicaSettings(BaseModel):
    """Everything one replica needs (serialisable: it travels in the Serve config)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str
    mmproj: str | None = None  # a multimodal projector's GGUF (images, audio), beside the model
    engine: EngineConfig = EngineConfig()
    # The cluster key's file; None: the replica's environment (cache_store.cluster_key). The
    # key itself is never here: Serve stores and shows a deployment's arguments.
    hmac_key_file: str | None = None
    index: str | None = "embedded"
    ship: bool = True  # pull from peers (needs Baton's router to reach a given replica)
    routed_by_baton: bool = True  # each request should carry a plan: one without is counted
    # the pull rule's costs (its bandwidth: until this replica has measured its own)
    ship_cost: ShipCost = ShipCost()
    pull_deadline_s: float = ShipPolicy.deadline_s
    stream_bounds: ReceiverBounds = ReceiverBounds()  # what its state stream takes at once
    heartbeat_s: float = 5.0
    liveness_ttl_s: float = 15.0  # written with each heartbeat: the index's readers follow it
    handoff_s: float = 10.0  # leaving, hand the hottest checkpoints to peers for this long
    startup_dir: str | None = None  # where to report start-up stages (a local cluster)


class ServePeers:
    """Reaches a peer replica through a handle to this deployment, targeted by id."""

    def __init__(
        self, handle: DeploymentHandle, limits: StreamLimits, bounds: ReceiverBounds
    ) -> None:
        # By reference whatever Serve's default transport: a peer on this node answers with
        # an ObjectRef to its state in the object store, and blobs are too large for gRPC's
        # 4 MB replica messages.
        self._handle = handle.options(method_name="export_best", _by_reference=True)
        self._adopt = handle.options(method_name="adopt", _by_reference=True)
        self._limits = limits  # the largest blob this replica's model can have
        self._receiver: StateReceiver | None = None  # opened by the first pull
        self._bounds = bounds  # how much its receiver takes at once

    async def fetch(
        self, replica_id: str, tokens: tuple[int, ...], min_tokens: int, wait_s: float = 0.0
    ) -> ShippedBlob | StillComputing | None:
        if self._receiver is None:
            self._receiver = StateReceiver(self._limits, bounds=self._bounds)
        return await fetch_offering_stream(
            self._receiver,
            lambda offer: self._handle.remote(
                tokens, min_tokens, wait_s, offer, **{TARGET_REPLICA_KWARG: replica_id}
            ),
        )

    async def offer(self, replica_id: str, blob: PeerReply) -> bool:
        return await self._adopt.remote(blob, **{TARGET_REPLICA_KWARG: replica_id})


class ReplicaDeployment:
    """Serves generation requests from one engine; publishes its checkpoints to the index."""

    async def __init__(self, settings: ReplicaSettings) -> None:
        configure_process("replica")
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.handoff_s = settings.handoff_s
        self.gpu_ids = assign_ray_devices()  # before llama.cpp's backends load
        report_stage(settings.startup_dir, self.replica_id, "loading the model")
        engine = await asyncio.to_thread(
            Engine,
            settings.model_path,
            settings.engine,
            hmac_key=read_cluster_key(settings.hmac_key_file),
            mmproj=settings.mmproj,
        )
        index = None
        if settings.index:
            report_stage(settings.startup_dir, self.replica_id, "connecting to the index")
            with contextlib.suppress(IndexUnavailable):
                index = await connect_cluster_index(
                    settings.index, engine.fingerprint, liveness_ttl_s=settings.liveness_ttl_s
                )
        peers = None
        if settings.ship and index is not None:
            handle = serve.get_deployment_handle(context.deployment, context.app_name)
            limits = StreamLimits.for_model(engine.n_ctx, engine.largest_state_bytes)
            peers = ServePeers(handle, limits, settings.stream_bounds)
            engine.share_states(share_in_object_store)  # peers may pull its states
        self.replica = Replica(
            self.replica_id,
            engine,
            index=index,
            peers=peers,
            policy=ShipPolicy(cost=settings.ship_cost, deadline_s=settings.pull_deadline_s),
            heartbeat_s=settings.heartbeat_s,
            expects_plans=settings.routed_by_baton,
        )
        await self.replica.start()
        report_stage(settings.startup_dir, self.replica_id, "ready")

    async def generate(self, request: ReplicaRequest) -> Completion:
        return await self.replica.generate(request)

    async def stream(
        self, request: ReplicaRequest
    ) -> AsyncGenerator[list[Admitted | TokenEvent | Completion], None]:
        """`Replica.stream`'s items, those ready at once in one message (`stream_batches`)."""
        async for batch in batches(self.replica.stream(request)):
            yield batch

    async def export_best(
        self,
        tokens: tuple[int, ...],
        min_tokens: int,
        wait_s: float = 0.0,
        offer: StreamOffer | None = None,
        target_replica: str | None = None,
    ) -> PeerReply | StillComputing | str | None:
        """For a peer (the router already sent this call to `target_replica`)."""
        return await self.replica.export_when_ready(tuple(tokens), min_tokens, wait_s, offer)

    async def adopt(self, blob: PeerReply, target_replica: str | None = None) -> bool:
        """For a leaving peer handing over a checkpoint (sent to `target_replica`)."""
        return await self.replica.adopt(blob)

    def record_routing_stats(self) -> dict[str, int | float | str]:
        load = self.replica.engine.load()
        lag = self.replica.loop_lag.snapshot()
        return {
            "replica_id": self.replica_id,
            "sampled_at": time.time(),  # a router counts its own requests since then itself
            "queued": load.queued,
            "running": load.running,
            "free_slots": load.free_slots,
            "cache_bytes": self.replica.engine.store_figures().used_bytes,
            "pulls": self.replica.stats.pulls,
            "replans": dict(self.replica.stats.replans),  # router plans decided again, by reason
            "plans_missing": dict(self.replica.stats.plans_missing),  # requests without one
            "pulled_bytes": self.replica.stats.pulled_bytes,
            "streamed_exports": self.replica.stats.streamed_exports,
            "adopted": self.replica.stats.adopted,  # checkpoints leaving peers handed over
            "prefill_tokens_per_s": self.replica.engine.stats.prefill_tokens_per_s or 0.0,
            # the bandwidth it decides pulls by (measured once it has pulled): the router too
            "pull_bytes_per_s": self.replica.policy.cost.bandwidth_bytes_per_s,
            "loop_stall_max_ms": lag.max_ms,  # the event loop's longest stall, lately
            "loop_stall_p99_ms": lag.p99_ms,
            "gpu_ids": self.gpu_ids,  # Ray's assignment, visible to its llama.cpp
            "device": self.replica.engine.model.device,
        }

    def ready(self) -> bool:
        return True

    def check_health(self) -> None:
        """Serve's periodic probe: raising (a stuck engine loop) makes Serve replace it."""
        self.replica.check_health()

    async def __del__(self) -> None:
        """Serve stops this replica (scale-down, a rolling update) once its requests are
        done: hand the hottest checkpoints to the replicas that stay, then leave the index
        (and write what is left to the disk tier, if any). Nothing to do for a replica whose
        constructor failed (Serve still calls this; its own error is the one to report)."""
        replica = getattr(self, "replica", None)
        if replica is None:
            return
        await replica.leave(self.handoff_s)
        await asyncio.to_thread(replica.engine.close)
