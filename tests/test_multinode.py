"""Baton on a Ray cluster of three nodes on this machine, each with its own raylet and object
store: a head (GCS, Serve's controller and proxy, the gateway) and two workers holding one
replica each (a custom resource only workers have). `baton serve --address` deploys the app
onto it, with the embedded index and with Redis; the tests ship a conversation's state
across nodes and kill a worker node under load."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from fixtures_ray import session_ray_paused, wait_healthy
from ray import serve
from ray.cluster_utils import Cluster

from baton_serve.cache_store.fingerprint import file_fingerprint
from baton_serve.cache_store.index.embedded_index import ACTOR_NAME
from baton_serve.cache_store.index.index_connect import connect_index
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.deploy.app import APP_NAME, GATEWAY_DEPLOYMENT, REPLICA_DEPLOYMENT
from baton_serve.deploy.local_ray import NAMESPACE
from baton_serve.deploy.ports import free_port
from baton_serve.loadtests.serve_app import replica_stats, wait_idle
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig

REPLICA_RESOURCE = "baton_replica"  # only workers have it: replicas run there
ROOM_PER_WORKER = 2  # room for two replicas: only max_replicas_per_node keeps them apart
GATEWAY_RESOURCE = "baton_gateway"  # only the head has it: the gateway runs there
NODE_CPUS = 1
OBJECT_STORE_BYTES = 80 << 20  # each node's own store (Ray's minimum is 75 MiB)
# A store budget that fits each node's object store (`baton serve` refuses one that does not).
STORE_BUDGET_BYTES = 32 << 20
ENGINE = {
    "n_ctx": 2048,
    "n_slots": 1,
    "n_threads": 1,
    "prefill_chunk": 128,
    "store_budget_bytes": STORE_BUDGET_BYTES,
}
HEARTBEAT_S = 0.25
LIVENESS_TTL_S = 2.0
SYSTEM = "You answer in short sentences about nodes, object stores and state. " * 12
# The drained-node test's own end of the system prompt: with the user message and the
# template around it, well over OWN_TOKENS tokens that no other test's prompt shares.
OWN_SUFFIX = "this conversation was computed on the node that is drained, and nowhere else."
OWN_TOKENS = 16
LOAD_WORKERS = 3
START_TIMEOUT_S = 180.0


@dataclass
class ThreeNodes:
    """The cluster, the node id of its head and of each live worker, and Serve's port."""

    cluster: Cluster
    head_id: str
    serve_port: int
    workers: dict[str, object] = field(default_factory=dict)  # node id -> ray node

    def add_worker(self) -> str:
        node = self.cluster.add_node(
            num_cpus=NODE_CPUS,
            resources={REPLICA_RESOURCE: ROOM_PER_WORKER},
            object_store_memory=OBJECT_STORE_BYTES,
        )
        self.cluster.wait_for_nodes()
        self.workers[node.node_id] = node
        return node.node_id

    def kill_worker(self, node_id: str) -> None:
        """SIGKILL the node's processes (raylet, object store, workers): a crashed machine."""
        self.cluster.remove_node(self.workers.pop(node_id), allow_graceful=False)


@pytest.fixture(scope="module")
def nodes() -> Iterator[ThreeNodes]:
    # Ray's files go under a folder of this module's (short: Ray's socket paths): the
    # cluster records its address in $RAY_TMPDIR/ray/ray_current_cluster, where any
    # `ray.init()` on this machine would otherwise find it, and join it.
    ray_dir = tempfile.mkdtemp(prefix="btmn", dir="/tmp")
    with session_ray_paused(), pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_TMPDIR", ray_dir)
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": NODE_CPUS,
                "resources": {GATEWAY_RESOURCE: 1},
                "object_store_memory": OBJECT_STORE_BYTES,
                "include_dashboard": False,
            },
        )
        try:
            three = ThreeNodes(cluster, cluster.head_node.node_id, free_port())
            for _ in range(2):
                three.add_worker()
            ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
            # Proxies on the head only: on one machine every node has the same address, and
            # proxies on the workers would compete for the port.
            serve.start(
                proxy_location="HeadOnly",
                http_options={"host": "127.0.0.1", "port": three.serve_port},
            )
            try:
                yield three
            finally:
                serve.shutdown()
                ray.shutdown()
        finally:
            cluster.shutdown()
    shutil.rmtree(ray_dir, ignore_errors=True)


@dataclass
class App:
    url: str
    index: str
    model: Path
    output: list[str]

    @property
    def name(self) -> str:
        return self.model.stem


@pytest.fixture(scope="module", params=["embedded", "redis"])
def app(request, nodes: ThreeNodes, tiny_model, tmp_path_factory) -> Iterator[App]:
    """`baton serve --address` joined to the cluster, as an operator runs it on the head."""
    index = (
        "embedded" if request.param == "embedded" else request.getfixturevalue("redis_server").url
    )
    port = nodes.serve_port
    settings = {
        "model": str(tiny_model("qwen35")),
        "replicas": 2,
        "num_cpus_per_replica": 0.5,
        "replica_resources": {REPLICA_RESOURCE: 1},
        "max_replicas_per_node": 1,
        "gateway_resources": {GATEWAY_RESOURCE: 0.1},
        "engine": ENGINE,
        "index": index,
        "heartbeat_s": HEARTBEAT_S,
        "liveness_ttl_s": LIVENESS_TTL_S,
        "hmac_key": secrets.token_hex(16),
    }
    config_file = tmp_path_factory.mktemp("multinode") / "baton.yaml"
    config_file.write_text(yaml.safe_dump(settings))
    command = [
        *(sys.executable, "-m", "baton_serve.deploy.cli", "serve", "--config", str(config_file)),
        *("--address", nodes.cluster.address, "--port", str(port)),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(process.stdout), daemon=True).start()
    try:
        _wait_until(lambda: "Press Ctrl-C" in "".join(output), START_TIMEOUT_S, "baton serve")
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        yield App(url, index, tiny_model("qwen35"), output)
    finally:
        process.send_signal(signal.SIGTERM)  # baton serve deletes its app, leaves Serve
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
    assert process.returncode == 0, "".join(output)[-2000:]


# ---- where things run ------------------------------------------------------------------------


def _actor_nodes() -> dict[str, str]:
    """Node id of every live actor, by actor name (Serve names its replica actors)."""
    table = ray._private.state.state.actor_table(None)  # the GCS's table; no dashboard needed
    return {
        info["Name"]: info["Address"]["NodeID"]
        for info in table.values()
        if info["Name"] and info["State"] == "ALIVE"
    }


def _replica_nodes() -> dict[str, str]:
    """Node id of each running replica of the app, by replica id."""
    prefix = f"SERVE_REPLICA::{APP_NAME}#{REPLICA_DEPLOYMENT}#"
    return {
        name[len(prefix) :]: node
        for name, node in _actor_nodes().items()
        if name.startswith(prefix)
    }


def test_replicas_run_one_per_worker_and_the_gateway_on_the_head(app: App, nodes) -> None:
    replica_nodes = _replica_nodes()
    assert len(replica_nodes) == 2
    assert set(replica_nodes.values()) == set(nodes.workers), (replica_nodes, nodes.workers)
    gateways = [
        node
        for name, node in _actor_nodes().items()
        if name.startswith(f"SERVE_REPLICA::{APP_NAME}#{GATEWAY_DEPLOYMENT}#")
    ]
    assert gateways == [nodes.head_id]
    if app.index == "embedded":  # started by the app's builder, where `baton serve` runs
        assert _actor_nodes()[ACTOR_NAME] == nodes.head_id


# ---- a state shipped across nodes ------------------------------------------------------------


def _chat(url: str, model: str, messages: list[dict], max_tokens: int = 8) -> httpx.Response:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


def test_a_conversation_moved_to_the_other_node_pulls_its_state_across(app: App) -> None:
    # ~700 tokens: pulling them beats computing them again even at the tiny model's prefill
    # speed (10-26k tokens/s here; the router takes a replica that has not measured its own
    # at its peers' speed), by the rule router and replicas share (`pull_pays`)
    messages = [
        {"role": "system", "content": SYSTEM * 4 + f" ({app.index})"},
        {"role": "user", "content": "Start."},
    ]
    first = _chat(app.url, app.name, messages)
    holder = first.headers["x-baton-replica"]
    messages += [
        {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And now, from the other node?"},
    ]
    asyncio.run(wait_idle(APP_NAME))  # the holder's end-of-reply checkpoint is in the index
    time.sleep(4 * HEARTBEAT_S)
    before = {s["replica_id"]: s for s in asyncio.run(replica_stats(APP_NAME))}

    # Long generations of the holder's own conversation: the other replica takes some of
    # them by pulling the state from the holder's node rather than recomputing it.
    busy = [
        threading.Thread(target=_chat, args=(app.url, app.name, messages[:2], 600))
        for _ in range(3)
    ]
    for thread in busy:
        thread.start()
    time.sleep(1.0)  # routing stats (every 0.5 s) now show the holder's load
    moved = _chat(app.url, app.name, messages)
    for thread in busy:
        thread.join()

    after = {s["replica_id"]: s for s in asyncio.run(replica_stats(APP_NAME))}
    (other,) = (rid for rid in after if rid != holder)
    assert after[other]["pulls"] > before[other]["pulls"]
    assert after[other]["pulled_bytes"] > before[other]["pulled_bytes"]
    replica_nodes = _replica_nodes()
    assert replica_nodes[other] != replica_nodes[holder]  # the state crossed nodes
    # straight from the holder to the puller's own stream, not through the object stores
    assert after[holder]["streamed_exports"] > before[holder]["streamed_exports"]
    print(f"{app.index}: pulled {after[other]['pulled_bytes'] - before[other]['pulled_bytes']} B")
    usage = moved.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # pulled or held, not computed
    config = EngineConfig(**ENGINE, prefix_cache=False)
    with Engine(str(app.model), config, hmac_key=b"unused-key") as cold:
        reference = cold.generate(cold.chat_prompt(messages), SamplingParams(max_tokens=8))
    assert moved.json()["choices"][0]["message"]["content"] == reference.text
    assert usage["prompt_tokens"] == reference.usage.prompt_tokens


# ---- a worker node killed under load ---------------------------------------------------------


@dataclass
class Load:
    """`LOAD_WORKERS` threads of multi-turn conversations until stopped; every request's
    (seconds since start, HTTP status or None, replica) is kept."""

    app: App
    outcomes: list[tuple[float, int | None, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _started: float = field(default_factory=time.monotonic)

    def __enter__(self) -> Load:
        self._threads = [
            threading.Thread(target=self._worker, args=(w,), daemon=True)
            for w in range(LOAD_WORKERS)
        ]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)
            assert not thread.is_alive(), "a request hung"

    def elapsed_s(self) -> float:
        return time.monotonic() - self._started

    def failures(self) -> list[tuple[float, int | None, str]]:
        return [o for o in self.outcomes if o[1] != 200]

    def _worker(self, worker: int) -> None:
        with httpx.Client(timeout=60) as client:
            session = 0
            while not self._stop.is_set():
                session += 1
                messages = [{"role": "system", "content": SYSTEM}]
                for turn in range(4):
                    messages.append({"role": "user", "content": f"{worker}/{session}: {turn}?"})
                    body = {"model": self.app.name, "messages": messages, "max_tokens": 6}
                    at = self.elapsed_s()
                    try:
                        response = client.post(f"{self.app.url}/v1/chat/completions", json=body)
                    except httpx.HTTPError:
                        self.outcomes.append((at, None, ""))
                        break
                    replica = response.headers.get("x-baton-replica", "")
                    self.outcomes.append((at, response.status_code, replica))
                    if response.status_code != 200 or self._stop.is_set():
                        break
                    reply = response.json()["choices"][0]["message"]["content"]
                    messages.append({"role": "assistant", "content": reply})


def _live_replicas(app: App) -> list[str]:
    async def ask() -> list[str]:
        index = await connect_index(app.index, file_fingerprint(app.model), timeout_s=1.0)
        try:
            return await index.live_replicas()
        finally:
            await index.close()

    return asyncio.run(ask())


def _wait_until(predicate: Callable[[], object], timeout_s: float, what: str) -> float:
    """Seconds until `predicate()` held (polled); fails after `timeout_s`."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.1)
    return time.monotonic() - started


def test_a_worker_node_killed_under_load(app: App, nodes: ThreeNodes) -> None:
    replica_nodes = _replica_nodes()
    assert sorted(_live_replicas(app)) == sorted(replica_nodes)
    victim, victim_node = sorted(replica_nodes.items())[0]
    with Load(app) as load:
        _wait_until(lambda: len(load.outcomes) >= 20, 60, "the load got going")
        nodes.kill_worker(victim_node)
        killed_at = load.elapsed_s()
        forgot_s = _wait_until(
            lambda: victim not in _live_replicas(app),
            LIVENESS_TTL_S + 2.0,
            "the index forgets the dead node's replica",
        )
        time.sleep(2.0)  # the survivor carries the load alone
        nodes.add_worker()  # Serve places the replacement replica on the new worker
        _wait_until(lambda: len(set(_replica_nodes()) - {victim}) == 2, 90, "a replacement replica")
        replaced_at = load.elapsed_s()
        time.sleep(2.0)

    failures = load.failures()
    print(
        f"{app.index}: {len(load.outcomes)} requests, {len(failures)} failed; "
        f"the index forgot the replica {forgot_s:.2f} s after its node died"
    )
    assert len(failures) <= 0.01 * len(load.outcomes), (len(failures), failures[:5])
    assert [o for o in load.outcomes if o[0] > killed_at + 1.0 and o[2] == victim] == []
    assert {o[2] for o in load.outcomes if o[0] > replaced_at} - {victim}
    deployment = serve.status().applications[APP_NAME].deployments[REPLICA_DEPLOYMENT]
    assert deployment.status == "HEALTHY"


# ---- a worker node drained (a pod deleted: the chart's preStop) -------------------------------


def test_a_drained_worker_node_hands_its_conversation_over(app: App, nodes: ThreeNodes) -> None:
    """What the chart's preStop does before a worker pod goes: drain its Ray node. Serve
    starts a replacement on another node and stops the drained node's replica gracefully;
    the replica hands its checkpoints over, and its conversation goes on from cache."""
    spare = nodes.add_worker()  # room for the replacement: one replica per node
    messages = [
        {"role": "system", "content": SYSTEM + f" (drained, {app.index}): {OWN_SUFFIX}"},
        {"role": "user", "content": "Start."},
    ]
    first = _chat(app.url, app.name, messages)
    holder = first.headers["x-baton-replica"]
    drained = _replica_nodes()[holder]
    messages += [
        {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And after the drain?"},
    ]
    try:
        ray_cli = Path(sys.executable).with_name("ray")
        subprocess.run(
            [
                *(str(ray_cli), "drain-node", "--address", nodes.cluster.address),
                *("--node-id", drained, "--reason", "DRAIN_NODE_REASON_PREEMPTION"),
                *("--reason-message", "pod terminating", "--deadline-remaining-seconds", "120"),
            ],
            check=True,
        )
        _wait_until(lambda: holder not in _replica_nodes(), 120, "the drained node's replica left")
        _wait_until(lambda: len(_replica_nodes()) == 2, 120, "a replacement replica")
        assert spare in _replica_nodes().values() and drained not in _replica_nodes().values()

        reply = _chat(app.url, app.name, messages)
        assert reply.headers["x-baton-replica"] != holder
        cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        # Only the drained replica computed this conversation past SYSTEM (shared with the
        # other tests): a state within its last OWN_TOKENS tokens came by the hand-off.
        # Which one serves it depends on where the peers took the states and on routing
        # (this hybrid model's checkpoints: two tokens before the prompt's end, the start of
        # the last user message; the one after the reply prefixes the next prompt only if
        # the reply tokenizes the same once rendered, and the tiny model's reply is noise).
        assert cached >= first.json()["usage"]["prompt_tokens"] - OWN_TOKENS
    finally:  # the drained node goes, whatever happened
        nodes.cluster.remove_node(nodes.workers.pop(drained))
