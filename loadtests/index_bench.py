"""`baton bench index`: publish throughput, lookup latency and memory of both index backends.

Each backend is filled with `checkpoints` entries spread over `replicas` replicas (random
depths of random documents, published in batches, several batches in flight at once), then
answers `lookups` sequential lookups of `chain`-hash prompts: most share a prefix of a known
document and then diverge, the rest are new. Memory per entry is Redis' `used_memory`, or
the embedded actor's resident set, before and after publishing. Runs against a fresh random
fingerprint and forgets its data at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import psutil
import ray

from baton_serve.cache_store.index.embedded_index import ACTOR_NAME, ACTOR_NAMESPACE
from baton_serve.cache_store.index.index import CheckpointIndex, IndexEntry
from baton_serve.cache_store.index.index_connect import connect_index
from baton_serve.cache_store.index.redis_index import RedisIndex
from baton_serve.deploy.local_ray import local_ray
from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.loadtests.redis_server import RedisServer

BATCH = 1_000
PUBLISH_WINDOW = 8  # batches in flight at once: pipelined, not a round trip each
BLOCK_TOKENS = 64
STATE_BYTES_PER_TOKEN = 23_000  # SmolLM2-135M, measured
ATTENTION_STATE_TOKENS = 2_048  # an attention checkpoint is findable by each of its blocks
DEFAULT_TIMEOUT_S = 0.05  # the lookup timeout replicas run with
WARMUP_LOOKUPS = 20


def _hash(doc: int, depth: int) -> bytes:
    return hashlib.blake2b(f"{doc}:{depth}".encode(), digest_size=16).digest()


@dataclass
class Workload:
    """Entries per replica and the hash chains to look up, reproducible from `seed`."""

    entries: dict[str, list[IndexEntry]]
    chains: list[list[bytes]]

    @classmethod
    def make(
        cls, checkpoints: int, replicas: int, lookups: int, chain: int, seed: int = 0
    ) -> Workload:
        if checkpoints < 1 or replicas < 1 or lookups < 1 or chain < 1:
            raise ValueError("checkpoints, replicas, lookups and chain must be >= 1")
        # ~16 checkpoints per document, and never more than half of all possible slots
        docs = max(checkpoints // 16, math.ceil(2 * checkpoints / (chain * replicas)), 1)
        rng = random.Random(seed)
        held: set[tuple[int, int, int]] = set()
        while len(held) < checkpoints:
            held.add((rng.randrange(docs), rng.randrange(chain), rng.randrange(replicas)))
        entries: dict[str, list[IndexEntry]] = {f"replica-{r}": [] for r in range(replicas)}
        for doc, depth, replica in sorted(held):
            n_tokens = (depth + 1) * BLOCK_TOKENS
            entries[f"replica-{replica}"].append(
                IndexEntry(_hash(doc, depth), n_tokens, n_tokens * STATE_BYTES_PER_TOKEN)
            )
        chains = []
        for i in range(lookups):
            new_doc = docs + i  # never published
            if rng.random() < 0.75:
                doc, shared = rng.randrange(docs), rng.randint(1, chain)
            else:
                doc, shared = new_doc, 0
            chains.append([_hash(doc if d < shared else new_doc, d) for d in range(chain)])
        return cls(entries, chains)

    async def publish(self, index: CheckpointIndex) -> float:
        """Publish every entry (in batches, `PUBLISH_WINDOW` of them in flight) and heartbeat
        every replica; seconds taken."""
        window = asyncio.Semaphore(PUBLISH_WINDOW)

        async def publish_batch(replica: str, batch: list[IndexEntry]) -> None:
            async with window:
                await index.publish(replica, batch)

        started = time.perf_counter()
        await asyncio.gather(
            *(
                publish_batch(replica, entries[i : i + BATCH])
                for replica, entries in self.entries.items()
                for i in range(0, len(entries), BATCH)
            )
        )
        await asyncio.gather(*(index.heartbeat(replica) for replica in self.entries))
        return time.perf_counter() - started


async def _run_backend(spec: str, workload: Workload, progress: Progress, name: str) -> dict:
    index: CheckpointIndex = await connect_index(
        spec, os.urandom(32), timeout_s=1.0, write_timeout_s=30.0, liveness_ttl_s=600.0
    )
    try:
        published = sum(len(e) for e in workload.entries.values())
        progress.step(f"{name}: publishing {published:,} checkpoints")
        memory_before = await _memory(index)
        publish_s = await workload.publish(index)
        memory_after = await _memory(index)
        progress.step(f"{name}: {len(workload.chains):,} lookups")
        for chain in workload.chains[:WARMUP_LOOKUPS]:
            await index.lookup(chain)
        latencies, hits = [], 0
        for chain in workload.chains:
            start = time.perf_counter()
            found = await index.lookup(chain)
            latencies.append(time.perf_counter() - start)
            hits += bool(found)
        for replica in workload.entries:
            await index.forget(replica)
    finally:
        await index.close()
    return {
        "publish_s": publish_s,
        "publish_entries_per_s": published / publish_s,
        "lookup_ms": latency_ms(latencies),
        "lookups_over_timeout": sum(s > DEFAULT_TIMEOUT_S for s in latencies),
        "hit_rate": hits / len(workload.chains),
        "bytes_per_entry": (memory_after - memory_before) / published,
    }


async def _memory(index: CheckpointIndex) -> int:
    """Redis' `used_memory`, or the resident set of the embedded index's actor process."""
    if isinstance(index, RedisIndex):
        info = await index.call(
            "memory", index.redis.info("memory"), index.settings.write_timeout_s
        )
        return int(info["used_memory"])
    actor = ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE)
    # No public API gives an actor's pid without the dashboard; the GCS' actor table does.
    pid = ray._private.state.actors(actor._actor_id.hex())["Pid"]
    return psutil.Process(pid).memory_info().rss


def latency_ms(seconds: list[float]) -> dict[str, float]:
    """p50, p95, p99, mean and max of latencies given in seconds, in milliseconds."""
    ms = np.array(seconds) * 1000
    return {
        "p50": float(np.percentile(ms, 50)),
        "p95": float(np.percentile(ms, 95)),
        "p99": float(np.percentile(ms, 99)),
        "mean": float(ms.mean()),
        "max": float(ms.max()),
    }


@contextlib.contextmanager
def redis_url_or_private_server(redis_url: str | None) -> Iterator[str]:
    """`redis_url` itself, or the URL of a private redis-server for the block."""
    if redis_url is not None:
        yield redis_url
        return
    with RedisServer() as server:
        yield server.url


def index_benchmark(
    redis_url: str | None,
    *,
    checkpoints: int = 100_000,
    replicas: int = 8,
    lookups: int = 2_000,
    chain: int = 64,
    progress: Progress = SILENT,
) -> dict:
    """Benchmark Redis (at `redis_url`, or a private redis-server) and the embedded index
    (in the running Ray cluster, or a local one started here)."""
    progress.step("generating the workload")
    workload = Workload.make(checkpoints, replicas, lookups, chain)
    backends = {}
    with redis_url_or_private_server(redis_url) as url:
        backends["redis"] = asyncio.run(_run_backend(url, workload, progress, "redis"))
    progress.step("embedded: starting Ray")
    with local_ray(num_cpus=2):
        backends["embedded"] = asyncio.run(_run_backend("embedded", workload, progress, "embedded"))
    return {
        "checkpoints": checkpoints,
        "replicas": replicas,
        "lookups": lookups,
        "chain": chain,
        "publish_batch": BATCH,
        "publish_window": PUBLISH_WINDOW,
        "lookup_timeout_ms": DEFAULT_TIMEOUT_S * 1000,
        "backends": backends,
    }


def format_report(result: dict) -> str:
    lines = [
        f"{result['checkpoints']:,} checkpoints on {result['replicas']} replicas"
        f" (published in batches of {result['publish_batch']:,},"
        f" {result['publish_window']} in flight);"
        f" {result['lookups']:,} lookups of {result['chain']}-hash chains",
        f"{'backend':<9} {'publish/s':>10} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7}"
        f" {'mean ms':>8}"
        f" {'max ms':>7} {'hits':>5} {'>' + format(result['lookup_timeout_ms'], 'g') + ' ms':>7}",
    ]
    for name, r in result["backends"].items():
        ms = r["lookup_ms"]
        lines.append(
            f"{name:<9} {r['publish_entries_per_s']:>10,.0f} {ms['p50']:>7.3f} {ms['p95']:>7.3f}"
            f" {ms['p99']:>7.3f}"
            f" {ms['mean']:>8.3f} {ms['max']:>7.2f} {r['hit_rate']:>5.0%}"
            f" {r['lookups_over_timeout']:>7}"
        )
    for name, r in result["backends"].items():
        if r["bytes_per_entry"] > 0:
            per_state = r["bytes_per_entry"] * ATTENTION_STATE_TOKENS // BLOCK_TOKENS
            lines.append(
                f"{name} memory: {r['bytes_per_entry']:,.0f} bytes per entry; an attention"
                f" checkpoint of {ATTENTION_STATE_TOKENS:,} tokens is published under each of"
                f" its {ATTENTION_STATE_TOKENS // BLOCK_TOKENS} blocks: {per_state / 1024:,.1f} KiB"
            )
    return "\n".join(lines)
