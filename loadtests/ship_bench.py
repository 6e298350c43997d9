"""`baton bench ship`: pulling a prefix state from a peer process against recomputing it.

Three replica processes (Ray actors) share one embedded index, on one Ray node or (with
`cross_node`) on a local cluster of a head and two workers, A's replica on one worker and
B's on the other, so the state crosses from one node's object store to the other's. For
each prefix length, replica A computes the prefix; replica B, which has nothing cached, is
asked for the same prefix plus two tokens and pulls A's state (index lookup, export,
transfer through Ray's object store, validation, restore); replica C, with the cache off,
computes it all. Each length is pulled `runs` times, a new prefix each time, and the run
with the median move is reported with the range over all runs. Last, the object store
alone moves the largest state's bytes between two actors placed like A and B: the floor of
an export that copies the state into the store.

The move itself — from B asking A for the state until the state is restored in B's slot —
is timed on B and split into stages from the replicas' own counters: export (A signs the
state), transfer (the rest of the fetch: the call, Ray's object store), validate (every
check of the blob, one hash pass), restore (`llama_state_seq_set_data`) and the rest
(storing it, handing the request to the engine thread).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path

import ray

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import GenerationRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.deploy.local_ray import local_ray
from baton_serve.loadtests.local_cluster import local_cluster, node_resource
from baton_serve.loadtests.object_store_floor import object_store_floor
from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.loadtests.synthetic_text import filler_text
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.replica_actor import spawn_replica

PREFILL_ONLY = SamplingParams(max_tokens=0)
STAGES = ("export", "transfer", "validate", "restore", "rest")


def _move(holder: dict, puller: dict) -> tuple[float, dict[str, float]]:
    """Seconds from asking for the state to its restore, and each stage's seconds, from
    the `ship_timings` differences over one pull (holder's and puller's)."""
    move = puller["restore_done"] - puller["pull_started"]
    stages = {
        "export": holder["export"],
        "transfer": puller["fetch"] - holder["export"],
        "validate": puller["validate"],
        "restore": puller["restore"],
    }
    stages["rest"] = move - sum(stages.values())
    return move, stages


async def _timings(actor) -> dict[str, float]:
    return await actor.ship_timings.remote()


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    timestamps = ("pull_started", "restore_done")
    return {k: v if k in timestamps else v - before[k] for k, v in after.items()}


def _node_id(actor) -> str:
    # No public API gives an actor's node without the dashboard; the GCS' actor table does.
    return ray._private.state.actors(actor._actor_id.hex())["Address"]["NodeID"]


def _prompts(model: Path, n: int, runs: int) -> list[tuple[int, ...]]:
    """`runs` different `n`-token prompts (each run pulls a prefix B has never seen)."""
    with LlamaModel(model, vocab_only=True) as vocab:
        count = lambda text: len(vocab.tokenize(text))  # noqa: E731
        return [
            tuple(vocab.tokenize(filler_text(n + 64, count, seed=n * 1000 + run)))[:n]
            for run in range(runs)
        ]


async def _timed(actor, prompt: tuple[int, ...], sampling: SamplingParams) -> tuple[float, object]:
    started = time.perf_counter()
    done = await actor.generate.remote(
        GenerationRequest(prompt=Prompt(tokens=prompt), sampling=sampling)
    )
    return time.perf_counter() - started, done


async def _run(
    model: Path, lengths: list[int], runs: int, progress: Progress, cross_node: bool
) -> list[dict]:
    key = secrets.token_bytes(32)
    config = EngineConfig(n_ctx=max(lengths) + 256, n_slots=2)
    holder, puller = (
        spawn_replica(
            name,
            str(model),
            config,
            hmac_key=key,
            index="embedded",
            heartbeat_s=0.2,
            resources=resources,
        )
        for name, resources in zip(("bench-a", "bench-b"), _placement(cross_node))
    )
    no_cache = config.model_copy(update={"prefix_cache": False})
    baseline = spawn_replica("bench-c", str(model), no_cache, hmac_key=key)
    await asyncio.gather(holder.start.remote(), puller.start.remote(), baseline.start.remote())
    if cross_node and _node_id(holder) == _node_id(puller):
        raise RuntimeError("the cross-node benchmark's replicas A and B share a node")
    rows: list[dict] = []
    progress.start(len(lengths) * runs)
    try:
        for n in lengths:
            pulls: list[dict] = []
            for run, tokens in enumerate(_prompts(model, n, runs)):
                progress.step(f"{n}-token prefix, run {run + 1}: computing it on A")
                pull = await _pull(holder, puller, tokens)
                pulls.append(pull)
                progress.step(
                    f"{n}-token prefix, run {run + 1}: ship {pull['ship_s']:.3f} s",
                    done=len(rows) * runs + run + 1,
                )
            recompute_s, computed = await _timed(baseline, pull["prompt"], PREFILL_ONLY)
            rows.append(_row(n, pulls, recompute_s, computed.usage.computed_tokens))
    finally:
        for actor in (holder, puller, baseline):
            await actor.close.remote()
            ray.kill(actor)
    return rows


async def _pull(holder, puller, tokens: tuple[int, ...]) -> dict:
    """A computes `tokens` (and replays them); B is asked for them plus two tokens and
    pulls A's state: the request's time and the move's stages."""
    # A holds exactly len(tokens) tokens: a prompt of n-2, two generated tokens, replayed
    _, first = await _timed(holder, tokens[:-2], SamplingParams(max_tokens=2, ignore_eos=True))
    await holder.wait_idle.remote()
    await asyncio.sleep(0.5)  # let A's publisher reach the index
    prompt = tokens[:-2] + tuple(first.tokens) + tokens[:2]
    pulled_before = (await puller.stats.remote())[0].pulled_bytes
    before = await asyncio.gather(_timings(holder), _timings(puller))
    ship_s, shipped = await _timed(puller, prompt, PREFILL_ONLY)
    after = await asyncio.gather(_timings(holder), _timings(puller))
    state_bytes = (await puller.stats.remote())[0].pulled_bytes - pulled_before
    move_s, stages = (
        _move(*(_delta(a, b) for a, b in zip(after, before)))
        if state_bytes
        else (None, {})  # nothing was pulled: only the request time means anything
    )
    return {
        "prompt": prompt,
        "ship_s": ship_s,
        "move_s": move_s,
        "gb_per_s": state_bytes / move_s / 1e9 if move_s else None,
        "stages_s": stages,
        "cached_tokens": shipped.usage.cached_tokens,
        "state_bytes": state_bytes,
    }


def _row(n: int, pulls: list[dict], recompute_s: float, computed_tokens: int) -> dict:
    """One prefix length: the run with the median move (or the median request where
    nothing was pulled), with every run's GB/s."""
    moved = [p for p in pulls if p["move_s"]]
    ranked = sorted(moved or pulls, key=lambda p: p["move_s"] if moved else p["ship_s"])
    median = ranked[(len(ranked) - 1) // 2]
    return {
        "prefix_tokens": n,
        "ship_s": median["ship_s"],
        "move_s": median["move_s"],
        "gb_per_s": median["gb_per_s"],
        "gb_per_s_runs": [p["gb_per_s"] for p in moved],
        "stages_s": median["stages_s"],
        "recompute_s": recompute_s,
        "ratio": median["ship_s"] / recompute_s,
        "cached_tokens": median["cached_tokens"],
        "computed_tokens_recompute": computed_tokens,
        "state_bytes": median["state_bytes"],
        "runs": len(pulls),
        "pulled_runs": len(moved),
    }


def ship_benchmark(
    model: Path,
    lengths: list[int] = [512, 2048, 4096],  # noqa: B006
    progress: Progress = SILENT,
    *,
    runs: int = 3,
    cross_node: bool = False,
) -> dict:
    """Ship each prefix length's state from A to B `runs` times (a new prefix each time), on
    one Ray node or across two nodes."""
    if cross_node:
        progress.step("starting a Ray cluster of three nodes and three replicas")
        ray_runtime = local_cluster(workers=2)
    else:
        progress.step("starting Ray and three replicas")
        ray_runtime = local_ray(num_cpus=2)
    with ray_runtime:
        rows = asyncio.run(_run(model, lengths, runs, progress, cross_node))
        nbytes = max(r["state_bytes"] for r in rows)
        progress.step(f"the object store alone moving {nbytes / 1e6:.1f} MB")
        floor = object_store_floor(nbytes, *_placement(cross_node)) if nbytes else None
    return {
        "model": str(model),
        "cross_node": cross_node,
        "runs": runs,
        "rows": rows,
        "floor": floor,
    }


def _placement(cross_node: bool) -> tuple[dict | None, dict | None]:
    """The custom resources of A's replica and of B's: one worker node each, or none."""
    if not cross_node:
        return None, None
    return {node_resource(0): 1}, {node_resource(1): 1}


def format_report(result: dict) -> str:
    stage_heads = " ".join(f"{name:>8}" for name in STAGES)
    lines = [
        f"model: {result['model']}"
        + ("; A and B on two Ray nodes" if result.get("cross_node") else "; one Ray node"),
        f"{'prefix':>7} {'state MB':>9} {'move s':>7} {'GB/s':>6} {'GB/s range':>11}"
        f" {'ship s':>7} {'recompute s':>12} {'ratio':>7} {'reused':>7}"
        f"   share of move: {stage_heads}",
    ]
    for r in result["rows"]:
        if r["move_s"] is None:
            move, shares = f"{'-':>7} {'-':>6} {'-':>11}", "no state was pulled"
        else:
            runs = r["gb_per_s_runs"]
            spread = f"{min(runs):.2f}-{max(runs):.2f}"
            move = f"{r['move_s']:>7.4f} {r['gb_per_s']:>6.2f} {spread:>11}"
            shares = " ".join(f"{r['stages_s'][name] / r['move_s']:>8.0%}" for name in STAGES)
        lines.append(
            f"{r['prefix_tokens']:>7} {r['state_bytes'] / 1e6:>9.1f} {move}"
            f" {r['ship_s']:>7.3f} {r['recompute_s']:>12.3f}"
            f" {r['ratio']:>7.3f} {r['cached_tokens']:>7}   {'':>14} {shares}"
        )
    floor = result.get("floor")
    if floor:
        lines.append(
            f"the object store alone moving {floor['nbytes'] / 1e6:.1f} MB from A's node to"
            f" B's and touching every page: first {floor['first_s']:.4f} s"
            f" ({floor['first_gb_per_s']:.2f} GB/s), then {floor['warm_s']:.4f} s"
            f" ({floor['warm_gb_per_s']:.2f} GB/s, median)"
        )
    lines += [
        f"{result['runs']} runs per prefix length, each a new prefix; shown: the run with the"
        " median move, and the range over the runs that pulled (the first pull between A and"
        " B also opens Ray's connection between them)",
        "move = from asking the peer for the state until it is restored here; GB/s = state"
        " bytes / move",
        "ship = the whole request: index lookup + move + 2 new tokens; ratio = ship / recompute",
    ]
    return "\n".join(lines)
