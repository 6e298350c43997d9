"""A replica as a named Ray actor, and the peer directory that reaches such actors.

Each actor hosts one `Replica` (one engine) and is named ``baton-replica-<id>`` in the
``baton`` namespace, so peers find it by the replica id the index gives them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import ray
from ray.exceptions import RayActorError

from baton_serve.cache_store.index.index_connect import connect_index
from baton_serve.cache_store.wire.protocol import Completion, GenerationRequest, ReplicaRequest
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.loop_lag import LoopLag
from baton_serve.replicas.replica import Replica, ReplicaStats
from baton_serve.replicas.shipping import (
    PeerReply,
    ShippedBlob,
    ShipPolicy,
    StillComputing,
    fetch_offering_stream,
    share_in_object_store,
)
from baton_serve.replicas.state_stream import StateReceiver, StreamOffer
from baton_serve.replicas.stream_limits import StreamLimits

NAMESPACE = "baton"


def actor_name(replica_id: str) -> str:
    return f"baton-replica-{replica_id}"


class ActorPeers:
    """Reaches peers as named Ray actors; their blobs come back through the object store.

    A peer's handle is looked up once (a blocking call to Ray's GCS, made off the event
    loop) and kept until a call to it fails."""

    def __init__(self, limits: StreamLimits) -> None:
        self._handles: dict[str, ray.actor.ActorHandle] = {}
        self._limits = limits  # the largest blob this replica's model can have
        self._receiver: StateReceiver | None = None  # opened by the first pull

    async def fetch(
        self, replica_id: str, tokens: tuple[int, ...], min_tokens: int, wait_s: float = 0.0
    ) -> ShippedBlob | StillComputing | None:
        self._receiver = self._receiver or StateReceiver(self._limits)
        with self._forgotten_on_error(replica_id):
            peer = await self._peer(replica_id)
            return await fetch_offering_stream(
                self._receiver,
                lambda offer: peer.export_best.remote(tokens, min_tokens, wait_s, offer),
            )

    async def offer(self, replica_id: str, blob: PeerReply) -> bool:
        with self._forgotten_on_error(replica_id):
            return await (await self._peer(replica_id)).adopt.remote(blob)

    async def _peer(self, replica_id: str) -> ray.actor.ActorHandle:
        handle = self._handles.get(replica_id)
        if handle is None:
            try:
                handle = await asyncio.to_thread(
                    ray.get_actor, actor_name(replica_id), namespace=NAMESPACE
                )
            except ValueError as exc:  # no such actor: it died or never existed
                raise RayActorError(f"peer {replica_id} is gone") from exc
            self._handles[replica_id] = handle
        return handle

    @contextlib.contextmanager
    def _forgotten_on_error(self, replica_id: str) -> Iterator[None]:
        try:
            yield
        except Exception:  # a restarted peer of the same name gets a new handle
            self._handles.pop(replica_id, None)
            raise


class ReplicaHost:
    """The body of the replica actor (async: requests run concurrently on its event loop)."""

    def __init__(
        self,
        replica_id: str,
        model_path: str,
        config: EngineConfig,
        *,
        hmac_key: bytes,
        index: str | None = None,
        index_settings: dict | None = None,
        policy: ShipPolicy | None = None,
        heartbeat_s: float = 5.0,
    ) -> None:
        self.replica_id = replica_id
        self._engine_args = (model_path, config, hmac_key)
        self._index_spec = index
        self._index_settings = index_settings or {}
        self._policy = policy
        self._heartbeat_s = heartbeat_s
        self.replica: Replica | None = None

    async def start(self) -> str:
        """Load the model and join the index (slow, so not in the constructor)."""
        model_path, config, hmac_key = self._engine_args
        engine = await asyncio.to_thread(Engine, model_path, config, hmac_key=hmac_key)
        index = None
        if self._index_spec:
            engine.share_states(share_in_object_store)  # peers may pull its states
            index = await connect_index(
                self._index_spec, engine.fingerprint, **self._index_settings
            )
        self.replica = Replica(
            self.replica_id,
            engine,
            index=index,
            peers=ActorPeers(StreamLimits.for_model(engine.n_ctx, engine.largest_state_bytes)),
            policy=self._policy,
            heartbeat_s=self._heartbeat_s,
        )
        await self.replica.start()
        return self.replica_id

    async def generate(self, request: GenerationRequest | ReplicaRequest) -> Completion:
        if isinstance(request, GenerationRequest):
            request = ReplicaRequest(generation=request)
        return await self._replica.generate(request)

    async def export_best(
        self,
        tokens: tuple[int, ...],
        min_tokens: int,
        wait_s: float = 0.0,
        offer: StreamOffer | None = None,
    ) -> PeerReply | StillComputing | str | None:
        return await self._replica.export_when_ready(tuple(tokens), min_tokens, wait_s, offer)

    async def adopt(self, blob: PeerReply) -> bool:
        return await self._replica.adopt(blob)

    def stats(self) -> tuple[ReplicaStats, dict]:
        return self._replica.stats, dict(vars(self._replica.engine.stats))

    def device(self) -> str:
        """Where llama.cpp put the model's layers (e.g. "Vulkan0: ...", or "CPU")."""
        return self._replica.engine.model.device

    def loop_lag(self) -> LoopLag:
        """How late this actor's event loop ran lately."""
        return self._replica.loop_lag.snapshot()

    def ship_timings(self) -> dict[str, float]:
        """Seconds spent so far on each stage of shipping states (either way), and when the
        last pull began and the last restore ended (`time.perf_counter()` here)."""
        engine, policy = self._replica.engine.stats, self._replica.policy
        return {
            "export": engine.blob_export_seconds,
            "fetch": policy.fetch_seconds,
            "validate": engine.blob_validate_seconds,
            "restore": engine.restore_seconds,
            "pull_started": policy.last_pull_started,
            "restore_done": engine.last_restore_done,
        }

    async def wait_idle(self, timeout: float = 30.0) -> bool:
        return await asyncio.to_thread(self._replica.engine.wait_idle, timeout)

    async def close(self, handoff_s: float = 0.0) -> None:
        """Leave: hand the hottest checkpoints to peers for up to `handoff_s`, then stop."""
        if self.replica is not None:
            await self.replica.leave(handoff_s)
            await asyncio.to_thread(self.replica.engine.close)
            self.replica = None

    @property
    def _replica(self) -> Replica:
        if self.replica is None:
            raise RuntimeError("the replica is not started")
        return self.replica


ReplicaActor = ray.remote(num_cpus=0)(ReplicaHost)


def spawn_replica(
    replica_id: str,
    *args: object,
    resources: dict[str, float] | None = None,
    env: dict[str, str] | None = None,
    **kwargs: object,
) -> ray.actor.ActorHandle:
    """Start a named replica actor (asking for custom `resources`: a node that offers them;
    `env`: variables for its process, e.g. the device llama.cpp may use);
    `await handle.start.remote()` before using it."""
    return ReplicaActor.options(
        name=actor_name(replica_id),
        namespace=NAMESPACE,
        resources=resources or {},
        runtime_env={"env_vars": dict(env)} if env else None,
    ).remote(replica_id, *args, **kwargs)
