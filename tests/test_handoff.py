"""A replica that leaves hands its hottest checkpoints to the replicas that stay.

The ordering rules on plain checkpoints, then the real thing: a Baton app on the session's
Ray cluster (generated model, real llama.cpp, embedded index) scaled down from two replicas
to one by Ray Serve, with the next turn of every conversation sent after it.
"""

from __future__ import annotations

import secrets
import threading
import time

import httpx
import numpy as np
import pytest
from ray import serve

from baton_serve.cache_store.checkpoints.checkpoint import Checkpoint
from baton_serve.deploy.app import REPLICA_DEPLOYMENT, build_app
from baton_serve.deploy.config import BatonConfig
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.handoff import handoff_order
from baton_serve.router.gateway.gateway import REPLICA_HEADER

CONVERSATIONS = 4
DOWNSCALE_TIMEOUT_S = 120.0


def checkpoint(tokens: list[int], state_bytes: int) -> Checkpoint:
    return Checkpoint(
        prefix_hash=secrets.token_bytes(16),
        tokens=np.array(tokens, dtype=np.int32),
        state=memoryview(bytes(state_bytes)),
    )


def test_handoff_order_prefers_recent_states_that_save_more_per_byte() -> None:
    old_long = checkpoint(list(range(100)), 1000)
    recent_short = checkpoint(list(range(200, 210)), 1000)
    recent_dense = checkpoint(list(range(300, 400)), 1000)
    order = handoff_order([old_long, recent_short, recent_dense], nested=False)
    assert order == [recent_dense, old_long, recent_short]


def test_handoff_order_skips_an_attention_state_a_longer_one_serves() -> None:
    turn_1 = checkpoint(list(range(50)), 500)
    turn_2 = checkpoint(list(range(80)), 800)
    other = checkpoint(list(range(1000, 1040)), 400)
    assert handoff_order([turn_1, other, turn_2], nested=True) == [turn_2, other]
    # A hybrid state serves only its own tokens: every one is worth handing over.
    assert set(handoff_order([turn_1, other, turn_2], nested=False)) == {turn_1, turn_2, other}


def first_turn(base: str, model: str, i: int) -> tuple[list[dict], int, str]:
    # No system prompt: its stored state would make keeping the rest a cost-based choice.
    question = f"Hi, I am user number {i}. " + "Please answer briefly and politely. " * 10
    messages = [{"role": "user", "content": question}]
    body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    answer = reply.json()["choices"][0]["message"]["content"]
    history = [*messages, {"role": "assistant", "content": answer}]
    return history, reply.json()["usage"]["prompt_tokens"], reply.headers[REPLICA_HEADER]


def next_turn(base: str, model: str, history: list[dict]) -> tuple[int, str]:
    messages = [*history, {"role": "user", "content": "And then?"}]
    body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached, reply.headers[REPLICA_HEADER]


def replica_states(name: str) -> dict:
    deployment = serve.status().applications[name].deployments[REPLICA_DEPLOYMENT]
    return dict(deployment.replica_states)


@pytest.mark.parametrize(
    ("arch", "handoff_s"),
    [("llama", 10.0), ("llama", 0.0), ("qwen35", 10.0)],
    ids=["attention", "attention-none", "hybrid"],
)
def test_replaced_replicas_hand_their_conversations_over(
    arch, handoff_s, serve_port, tiny_model
) -> None:
    """Two replicas serve four conversations; the app is deployed again with one replica
    (from Python, Serve gives every deploy a new code version, so it replaces each replica:
    a rolling update and a scale-down at once). With the hand-off, every conversation's next
    turn finds its whole history cached on the new replica; without it (the control), none
    does."""
    config = BatonConfig(
        model=str(tiny_model(arch)),
        replicas=2,
        num_cpus_per_replica=0.5,
        engine=EngineConfig(n_ctx=1024, n_slots=1, n_threads=1),
        hmac_key=secrets.token_hex(16),
        handoff_s=handoff_s,
    )
    name = f"handoff-{arch}-{int(handoff_s)}"
    serve.run(build_app(config), name=name, route_prefix=f"/{name}")
    base, model = f"http://127.0.0.1:{serve_port}/{name}", config.served_model_name
    try:
        turns: list[tuple[list[dict], int, str] | None] = [None] * CONVERSATIONS

        def start(i: int) -> None:
            turns[i] = first_turn(base, model, i)

        threads = [threading.Thread(target=start, args=(i,)) for i in range(CONVERSATIONS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        first_replicas = {turn[2] for turn in turns if turn}
        assert len(first_replicas) == 2, f"the first turns all went to {first_replicas}"

        # New code version: each replica is replaced; the surge starts the new one first.
        smaller = config.model_copy(update={"replicas": 1, "rollout_surge_percent": 100})
        serve.run(build_app(smaller), name=name, route_prefix=f"/{name}")
        deadline = time.monotonic() + DOWNSCALE_TIMEOUT_S
        while replica_states(name) != {"RUNNING": 1}:
            assert time.monotonic() < deadline, replica_states(name)
            time.sleep(0.5)

        kept, counts, second_replicas = [], [], set()
        for history, prompt_tokens, _ in filter(None, turns):
            cached, replica = next_turn(base, model, history)
            kept.append(cached >= prompt_tokens)
            counts.append((cached, prompt_tokens))
            second_replicas.add(replica)
        assert len(second_replicas) == 1 and not second_replicas & first_replicas
        assert kept == [handoff_s > 0] * CONVERSATIONS, f"(cached, first prompt) {counts}"
    finally:
        serve.delete(name)
