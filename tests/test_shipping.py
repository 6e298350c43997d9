"""State shipping between replicas: real engines, a real Redis server, real Ray actors.

Two replica processes hold the same generated hybrid model. One computes a long prefix;
the other finds it through the index and pulls it through Ray's object store. Faults —
Redis down and back, a dead peer, a corrupted blob, a slow peer — cost a recompute, never a
failed request.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import numpy as np
import pytest
import ray

from baton_serve.cache_store.checkpoints.checkpoint import Checkpoint
from baton_serve.cache_store.checkpoints.state_blob import encode_parts
from baton_serve.cache_store.index.index_connect import connect_index
from baton_serve.cache_store.pull_cost import ShipCost
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import GenerationRequest, ReplicaRequest
from baton_serve.cache_store.wire.route_plan import RoutePlan
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.replica import Replica
from baton_serve.replicas.replica_actor import spawn_replica
from baton_serve.replicas.shipping import (
    ShipPolicy,
    received_blob,
    share_in_object_store,
    shipped_blob,
)

KEY = secrets.token_bytes(32)
CONFIG = EngineConfig(n_ctx=2048, n_slots=2, n_threads=1)
# The tiny models prefill thousands of tokens a second: tell the policy so, and ship any gain.
EAGER = ShipPolicy(ShipCost(min_gain_tokens=16, safety=1.0), prefill_tokens_per_s=50.0)
FOUR = SamplingParams(max_tokens=4, ignore_eos=True)


def _long_prompt(seed: int) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(t) for t in rng.integers(1000, 40000, size=700))


def _request(
    tokens: tuple[int, ...], sampling: SamplingParams = FOUR, logits: bool = False
) -> GenerationRequest:
    return GenerationRequest(prompt=Prompt(tokens=tokens), sampling=sampling, return_logits=logits)


async def _wait_for_entries(
    spec: str, fingerprint: bytes, chain: list[bytes], replica: str, timeout: float = 10.0
) -> None:
    index = await connect_index(spec, fingerprint)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if replica in await index.lookup(chain):
                    return
            except Exception:
                pass
            await asyncio.sleep(0.1)
        raise AssertionError(f"{replica} never appeared in the index")
    finally:
        await index.close()


@pytest.fixture(params=["redis", "embedded"])
def index_spec(request, ray_cluster) -> str:
    if request.param == "redis":
        return request.getfixturevalue("redis_server").url
    return "embedded"


def test_pull_through_index_and_object_store_is_exact(index_spec, tiny_model) -> None:
    path = str(tiny_model("qwen35"))
    suffix = f"-{index_spec[:5]}"
    holder = spawn_replica(
        "a" + suffix, path, CONFIG, hmac_key=KEY, index=index_spec, policy=EAGER, heartbeat_s=0.2
    )
    puller = spawn_replica(
        "b" + suffix, path, CONFIG, hmac_key=KEY, index=index_spec, policy=EAGER, heartbeat_s=0.2
    )
    cold = spawn_replica(
        "c" + suffix, path, CONFIG.model_copy(update={"prefix_cache": False}), hmac_key=KEY
    )
    try:
        ray.get([holder.start.remote(), puller.start.remote(), cold.start.remote()])
        prefix = _long_prompt(seed=1)
        first = ray.get(holder.generate.remote(_request(prefix)))
        assert ray.get(holder.wait_idle.remote())
        history = prefix + tuple(first.tokens)

        with Engine(path, EngineConfig(n_ctx=256, n_slots=1, n_threads=1), hmac_key=KEY) as local:
            chain = local.hash_chain(history)
            fingerprint = local.fingerprint
        asyncio.run(_wait_for_entries(index_spec, fingerprint, chain, "a" + suffix))

        follow_up = history + tuple(range(2000, 2040))
        pulled = ray.get(puller.generate.remote(_request(follow_up, logits=True)))
        scratch = ray.get(cold.generate.remote(_request(follow_up, logits=True)))

        stats, _ = ray.get(puller.stats.remote())
        assert stats.pulls == 1 and stats.pulled_bytes > 0
        assert pulled.usage.cached_tokens == len(history)
        assert pulled.usage.computed_tokens == len(follow_up) - len(history)
        assert pulled.tokens == scratch.tokens
        assert float(np.abs(pulled.logits - scratch.logits).max()) == 0.0
    finally:
        for actor in (holder, puller, cold):
            ray.kill(actor)


def test_dead_peer_costs_a_recompute_not_a_failure(redis_server, ray_cluster, tiny_model) -> None:
    path = str(tiny_model("qwen35"))
    holder = spawn_replica(
        "dead-a", path, CONFIG, hmac_key=KEY, index=redis_server.url, policy=EAGER, heartbeat_s=0.2
    )
    puller = spawn_replica(
        "dead-b", path, CONFIG, hmac_key=KEY, index=redis_server.url, policy=EAGER, heartbeat_s=0.2
    )
    try:
        ray.get([holder.start.remote(), puller.start.remote()])
        prefix = _long_prompt(seed=2)
        first = ray.get(holder.generate.remote(_request(prefix)))
        ray.get(holder.wait_idle.remote())
        history = prefix + tuple(first.tokens)
        with Engine(path, EngineConfig(n_ctx=256, n_slots=1, n_threads=1), hmac_key=KEY) as local:
            chain, fingerprint = local.hash_chain(history), local.fingerprint
        asyncio.run(_wait_for_entries(redis_server.url, fingerprint, chain, "dead-a"))
        ray.kill(holder)  # its index entries outlive it until its liveness expires

        done = ray.get(puller.generate.remote(_request(history + (5, 6, 7))))
        stats, _ = ray.get(puller.stats.remote())
        assert stats.pull_failures == 1 and stats.pulls == 0
        assert done.usage.cached_tokens == 0 and len(done.tokens) == 4
    finally:
        ray.kill(puller)


class _TamperingPeers:
    """Fault injection for what cannot be caused otherwise: a blob damaged in transit, cut
    short, signed by someone without the cluster's key, or a peer that answers late. It wraps
    a real peer's real export."""

    def __init__(
        self,
        peer: Replica,
        *,
        flip_bit: int | None = None,
        truncate: bool = False,
        forge: bool = False,
        delay_s: float = 0.0,
    ) -> None:
        self.peer, self.flip_bit, self.delay_s = peer, flip_bit, delay_s
        self.truncate, self.forge = truncate, forge

    async def fetch(self, replica_id, tokens, min_tokens, wait_s=0.0):
        await asyncio.sleep(self.delay_s)
        blob = await self.peer.export_when_ready(tokens, min_tokens, wait_s)
        if blob is None:
            return None
        head, state = blob  # (header + token ids, the state as a uint8 array)
        if self.flip_bit is not None:
            byte, mask = self.flip_bit // 8 % (len(head) + state.size), 1 << (self.flip_bit % 8)
            if byte < len(head):
                head = bytearray(head)
                head[byte] ^= mask
                head = bytes(head)
            else:
                state = state.copy()
                state[byte - len(head)] ^= mask
        if self.truncate:  # llama.cpp crashes on a short state: it must never see this one
            state = state[: state.size // 2]
        if self.forge:  # intact contents, signed with a key that is not the cluster's
            engine = self.peer.engine
            checkpoint = engine.checkpoint_prefixing(tokens)
            head, state = shipped_blob(
                *encode_parts(
                    fingerprint=engine.fingerprint,
                    prefix_hash=checkpoint.prefix_hash,
                    tokens=checkpoint.tokens,
                    state=checkpoint.state,
                    key=b"not-the-cluster-key",
                )
            )
        blob = head, state
        return blob


@pytest.mark.parametrize(
    "fault,expected",
    [
        ({"flip_bit": 8 * 4000 + 3}, "pulls_rejected"),
        ({"truncate": True}, "pulls_rejected"),
        ({"forge": True}, "pulls_rejected"),
        ({"delay_s": 5.0}, "pull_failures"),
    ],
    ids=["corrupted-in-transit", "truncated", "forged-hmac", "slower-than-the-deadline"],
)
def test_bad_transfer_is_rejected_and_recomputed(fault, expected, redis_server, tiny_model) -> None:
    path = str(tiny_model("qwen35"))

    async def scenario() -> None:
        policy = ShipPolicy(
            ShipCost(min_gain_tokens=16, safety=1.0), prefill_tokens_per_s=50.0, deadline_s=0.3
        )
        with (
            Engine(path, CONFIG, hmac_key=KEY) as a_engine,
            Engine(path, CONFIG, hmac_key=KEY) as b_engine,
        ):
            a_index = await connect_index(redis_server.url, a_engine.fingerprint)
            b_index = await connect_index(redis_server.url, b_engine.fingerprint)
            holder = Replica(
                f"tamper-a-{secrets.token_hex(3)}", a_engine, index=a_index, heartbeat_s=0.1
            )
            puller = Replica(
                f"tamper-b-{secrets.token_hex(3)}",
                b_engine,
                index=b_index,
                peers=_TamperingPeers(holder, **fault),
                policy=policy,
            )
            await holder.start()
            await puller.start()
            prefix = _long_prompt(seed=3)
            first = await holder.generate(ReplicaRequest(generation=_request(prefix)))
            await asyncio.to_thread(a_engine.wait_idle, 10)
            history = prefix + tuple(first.tokens)
            await _wait_for_entries(
                redis_server.url,
                a_engine.fingerprint,
                a_engine.hash_chain(history),
                holder.replica_id,
            )
            started = time.perf_counter()
            done = await puller.generate(ReplicaRequest(generation=_request(history + (9, 10, 11))))
            elapsed = time.perf_counter() - started
            assert getattr(puller.stats, expected) == 1 and puller.stats.pulls == 0
            assert done.usage.cached_tokens == 0 and len(done.tokens) == 4
            assert elapsed < 3.0  # the slow peer was abandoned at the deadline
            await holder.close()
            await puller.close()
            await a_index.close()
            await b_index.close()

    asyncio.run(scenario())


def test_redis_outage_never_fails_a_request_and_the_index_repopulates(
    private_redis_server, tiny_model
) -> None:
    path = str(tiny_model("qwen35"))
    server = private_redis_server

    async def scenario() -> None:
        with Engine(path, CONFIG, hmac_key=KEY) as engine:
            index = await connect_index(server.url, engine.fingerprint, liveness_ttl_s=2.0)
            replica = Replica("outage", engine, index=index, heartbeat_s=0.2)
            await replica.start()
            prefix = _long_prompt(seed=4)
            first = await replica.generate(ReplicaRequest(generation=_request(prefix)))
            await asyncio.to_thread(engine.wait_idle, 10)
            history = prefix + tuple(first.tokens)
            chain = engine.hash_chain(history)
            await _wait_for_entries(server.url, engine.fingerprint, chain, "outage")

            server.stop()
            for i in range(3):  # requests keep succeeding, reusing the local store
                done = await replica.generate(
                    ReplicaRequest(generation=_request(history + (100 + i, 7, 8)))
                )
                assert len(done.tokens) == 4 and done.usage.cached_tokens == len(history)
            deadline = time.monotonic() + 5
            while replica.stats.index_errors == 0:  # the heartbeat notices the outage
                assert time.monotonic() < deadline, "no index error while Redis was down"
                await asyncio.sleep(0.05)

            server.start()  # empty: Redis lost everything
            await _wait_for_entries(server.url, engine.fingerprint, chain, "outage")
            await replica.close()
            await index.close()

    asyncio.run(scenario())


def _index_state(spec: str, fingerprint: bytes, chain: list[bytes]) -> dict:
    async def lookup() -> dict:
        index = await connect_index(spec, fingerprint, timeout_s=1.0)
        try:
            return await index.lookup(chain)
        finally:
            await index.close()

    return asyncio.run(lookup())


def test_a_partial_prefix_of_an_attention_state_is_found_and_pulled(
    redis_server, ray_cluster, tiny_model
) -> None:
    """A 700-token attention state is published under each of its blocks: a prompt sharing
    only its first 512 tokens finds it in the index, pulls it, cuts it back — exact."""
    path = str(tiny_model("llama"))
    spec = redis_server.url
    holder = spawn_replica(
        "part-a", path, CONFIG, hmac_key=KEY, index=spec, policy=EAGER, heartbeat_s=0.2
    )
    puller = spawn_replica(
        "part-b", path, CONFIG, hmac_key=KEY, index=spec, policy=EAGER, heartbeat_s=0.2
    )
    cold = spawn_replica(
        "part-c", path, CONFIG.model_copy(update={"prefix_cache": False}), hmac_key=KEY
    )
    try:
        ray.get([holder.start.remote(), puller.start.remote(), cold.start.remote()])
        prompt = _long_prompt(seed=3)
        ray.get(holder.generate.remote(_request(prompt)))
        assert ray.get(holder.wait_idle.remote())
        other = prompt[:512] + tuple(range(3000, 3200))
        with Engine(path, EngineConfig(n_ctx=256, n_slots=1, n_threads=1), hmac_key=KEY) as local:
            chain, fingerprint = local.hash_chain(other), local.fingerprint
        asyncio.run(_wait_for_entries(spec, fingerprint, chain, "part-a"))
        assert _index_state(spec, fingerprint, chain)["part-a"].n_tokens == 512

        pulled = ray.get(puller.generate.remote(_request(other, logits=True)))
        scratch = ray.get(cold.generate.remote(_request(other, logits=True)))
        stats, _ = ray.get(puller.stats.remote())
        assert stats.pulls == 1
        assert pulled.usage.cached_tokens == 512
        assert pulled.tokens == scratch.tokens
        assert float(np.abs(pulled.logits - scratch.logits).max()) == 0.0
    finally:
        for actor in (holder, puller, cold):
            ray.kill(actor)


def test_a_prefix_being_computed_is_waited_for_and_pulled(
    redis_server, ray_cluster, tiny_model
) -> None:
    """The holder announces a prefix the moment its request is admitted (it queues behind
    two long generations here); the other replica sees it in flight, waits for the state
    instead of computing it, and pulls it — exact."""
    path = str(tiny_model("qwen35"))
    spec = redis_server.url
    holder = spawn_replica(
        "wait-a", path, CONFIG, hmac_key=KEY, index=spec, policy=EAGER, heartbeat_s=0.2
    )
    puller = spawn_replica(
        "wait-b", path, CONFIG, hmac_key=KEY, index=spec, policy=EAGER, heartbeat_s=0.2
    )
    cold = spawn_replica(
        "wait-c", path, CONFIG.model_copy(update={"prefix_cache": False}), hmac_key=KEY
    )
    try:
        ray.get([holder.start.remote(), puller.start.remote(), cold.start.remote()])
        prompt = _long_prompt(seed=4) + _long_prompt(seed=5)[:500]  # 1,200 tokens
        with Engine(path, EngineConfig(n_ctx=256, n_slots=1, n_threads=1), hmac_key=KEY) as local:
            chain, fingerprint = local.hash_chain(prompt), local.fingerprint
        # The holder measures its own prefill speed (its estimate of when the prefix is
        # ready); the puller, fresh, assumes EAGER's slow one, so waiting pays.
        ray.get(holder.generate.remote(_request(tuple(range(100, 400)))))
        busy = [  # both of the holder's slots
            holder.generate.remote(
                _request(
                    tuple(range(500 + i, 800)), SamplingParams(max_tokens=300, ignore_eos=True)
                )
            )
            for i in range(2)
        ]
        computing = holder.generate.remote(_request(prompt))
        deadline = time.monotonic() + 30
        while True:
            match = _index_state(spec, fingerprint, chain).get("wait-a")
            if match is not None and match.in_flight:
                break
            assert match is None, "the holder finished before its prefix was seen in flight"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert match.n_tokens == len(prompt) - 2

        follow_up = prompt + tuple(range(4000, 4040))
        pulled = ray.get(puller.generate.remote(_request(follow_up, logits=True)))
        scratch = ray.get(cold.generate.remote(_request(follow_up, logits=True)))
        ray.get([*busy, computing])
        stats, _ = ray.get(puller.stats.remote())
        assert stats.pulls == 1 and stats.pull_failures == 0
        # the holder's last checkpoint, or where the prompts part if asked before it passed
        assert pulled.usage.cached_tokens >= len(prompt) - 2
        assert pulled.tokens == scratch.tokens
        assert float(np.abs(pulled.logits - scratch.logits).max()) == 0.0
    finally:
        for actor in (holder, puller, cold):
            ray.kill(actor)


def test_a_request_planned_to_join_a_pull_under_way_waits_for_it(
    redis_server, ray_cluster, tiny_model
) -> None:
    """The router counts a pull it planned as a prefix in flight at the puller, and plans
    the next request of a burst to join it there: that request waits for the pull (one
    fetch for both) instead of computing the prefix a second time."""
    path = str(tiny_model("qwen35"))
    spec = redis_server.url
    holder = spawn_replica("join-a", path, CONFIG, hmac_key=KEY, index=spec, heartbeat_s=0.2)
    puller = spawn_replica(
        "join-b", path, CONFIG, hmac_key=KEY, index=spec, policy=EAGER, heartbeat_s=0.2
    )
    try:
        ray.get([holder.start.remote(), puller.start.remote()])
        prompt = _long_prompt(seed=8) + _long_prompt(seed=9)[:500]  # 1,200 tokens
        busy = [  # both of the holder's slots, so the prompt is computed a while from now
            holder.generate.remote(
                _request(
                    tuple(range(500 + i, 800)), SamplingParams(max_tokens=300, ignore_eos=True)
                )
            )
            for i in range(2)
        ]
        computing = holder.generate.remote(_request(prompt))
        held = len(prompt) - 2  # the holder's checkpoint two tokens before the prompt's end
        expected = time.time() + 5.0
        pull = RoutePlan(
            replica_id="join-b",
            kind="pull",
            reused_tokens=held,
            donor_id="join-a",
            donor_tokens=held,
            ready_at=expected,
        )
        join = RoutePlan(
            replica_id="join-b", kind="in_flight", reused_tokens=held, ready_at=expected
        )
        first = puller.generate.remote(
            ReplicaRequest(generation=_request(prompt + (7, 8, 9)), plan=pull)
        )
        time.sleep(0.2)  # the pull is under way (the holder is still busy)
        second = puller.generate.remote(
            ReplicaRequest(generation=_request(prompt + (4, 5, 6)), plan=join)
        )
        done = ray.get([first, second])
        ray.get([*busy, computing])
        stats, _ = ray.get(puller.stats.remote())
        assert stats.pulls == 1 and stats.replans == {}
        # at least the holder's own last checkpoint; asked, it also saves where they part
        first_cached, second_cached = (d.usage.cached_tokens for d in done)
        assert first_cached == second_cached >= held
    finally:
        for actor in (holder, puller):
            ray.kill(actor)


def test_a_shared_state_leaves_as_an_object_ref_and_arrives_as_its_bytes(ray_cluster) -> None:
    state = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    checkpoint = Checkpoint(prefix_hash=bytes(16), tokens=[1, 2, 3], state=state)
    share_in_object_store(checkpoint)
    # the store keeps the object store's copy, read-only, and not the private buffer
    assert checkpoint.state.readonly and bytes(checkpoint.state) == state.tobytes()
    assert np.frombuffer(checkpoint.state, np.uint8).ctypes.data != state.ctypes.data
    reply = shipped_blob(b"head", checkpoint.state, checkpoint.shared)
    assert isinstance(reply[1], ray.ObjectRef)
    head, arrived = asyncio.run(received_blob(reply))
    assert head == b"head" and not arrived.flags.writeable
    assert np.array_equal(arrived, state)
    # a state without a shared copy travels as itself; anything else is left to validation
    _, itself = asyncio.run(received_blob(shipped_blob(b"h", state.data)))
    assert np.array_equal(itself, state)
    assert asyncio.run(received_blob(None)) is None


def _pull_plan(puller: str, donor: str, donor_tokens: int) -> RoutePlan:
    return RoutePlan(
        replica_id=puller,
        kind="pull",
        reused_tokens=donor_tokens,
        donor_id=donor,
        donor_tokens=donor_tokens,
    )


def test_a_pull_plan_is_executed_without_an_index_lookup(
    redis_server, ray_cluster, tiny_model
) -> None:
    """The router's plan names the donor: the replica pulls from it straight away (the
    index is never asked) — exact."""
    path = str(tiny_model("qwen35"))
    spec = redis_server.url
    holder = spawn_replica("plan-a", path, CONFIG, hmac_key=KEY, index=spec, heartbeat_s=0.2)
    puller = spawn_replica("plan-b", path, CONFIG, hmac_key=KEY, index=spec, heartbeat_s=0.2)
    try:
        ray.get([holder.start.remote(), puller.start.remote()])
        prefix = _long_prompt(seed=6)
        first = ray.get(holder.generate.remote(_request(prefix)))
        assert ray.get(holder.wait_idle.remote())
        history = prefix + tuple(first.tokens)
        follow_up = history + tuple(range(2000, 2040))
        planned = ReplicaRequest(
            generation=_request(follow_up), plan=_pull_plan("plan-b", "plan-a", len(history))
        )
        done = ray.get(puller.generate.remote(planned))
        stats, _ = ray.get(puller.stats.remote())
        assert stats.pulls == 1 and stats.index_lookups == 0 and stats.replans == {}
        assert done.usage.cached_tokens == len(history)
    finally:
        for actor in (holder, puller):
            ray.kill(actor)


def test_a_dead_donor_in_the_plan_is_decided_again_and_counted(
    redis_server, ray_cluster, tiny_model
) -> None:
    """The planned donor died after the router decided: the replica decides again (one
    index lookup, the dead donor left out), counts why, and computes the prompt."""
    path = str(tiny_model("qwen35"))
    spec = redis_server.url
    holder = spawn_replica("gone-a", path, CONFIG, hmac_key=KEY, index=spec, heartbeat_s=0.2)
    puller = spawn_replica("gone-b", path, CONFIG, hmac_key=KEY, index=spec, heartbeat_s=0.2)
    try:
        ray.get([holder.start.remote(), puller.start.remote()])
        prefix = _long_prompt(seed=7)
        first = ray.get(holder.generate.remote(_request(prefix)))
        ray.get(holder.wait_idle.remote())
        history = prefix + tuple(first.tokens)
        with Engine(path, EngineConfig(n_ctx=256, n_slots=1, n_threads=1), hmac_key=KEY) as local:
            chain, fingerprint = local.hash_chain(history), local.fingerprint
        asyncio.run(_wait_for_entries(spec, fingerprint, chain, "gone-a"))
        ray.kill(holder)  # its index entries outlive it until its liveness expires

        planned = ReplicaRequest(
            generation=_request(history + (5, 6, 7)),
            plan=_pull_plan("gone-b", "gone-a", len(history)),
        )
        done = ray.get(puller.generate.remote(planned))
        stats, _ = ray.get(puller.stats.remote())
        assert stats.replans == {"donor_failed": 1} and stats.pull_failures == 1
        assert stats.index_lookups == 1 and stats.pulls == 0
        assert done.usage.cached_tokens == 0 and len(done.tokens) == 4
    finally:
        ray.kill(puller)
