"""`baton bench routing --engine emulated`: `bench sim`'s cluster workload through the real
system — Ray Serve, the gateway, each routing policy, the index, the replicas' caches and
pulls — on 16 to 64 replicas whose engines emulate the compute (`emulated_compute`: the
profile's time, deterministic tokens), and the same workload simulated beside it.

Prompts are token ids: each of the workload's segments (system prompt, document, turn,
tool result) is a fixed run of word tokens, and a session's next prompt is its previous
prompt, the reply's tokens (its text tokenised again: emulated replies are words that read
back as the same ids) and the turn's segment, sent `think_s` after the reply ended. TTFT is
measured at the client, from sending to the first streamed token; computed tokens are
`prompt_tokens - cached_tokens`; *new* tokens are those of the prompt in no prompt-and-reply
finished before it was sent, counted as the simulator counts them.

`slowdown` runs the real system on a clock that many times slower — every compute time,
the link, the think pauses, the bursts and the arrivals — and reports its TTFTs divided by
it, beside the simulator at full speed: for more replicas than the machine's cores keep at
full speed (Ray's own work per replica and per request does not slow down, so it weighs
that many times less in the figures; every report says so).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import httpx
import numpy as np

from baton_serve.deploy.app import GATEWAY_CPUS, local_cluster_cpus
from baton_serve.deploy.config import BatonConfig, RouterPolicy
from baton_serve.deploy.local_ray import local_ray
from baton_serve.loadtests.bench_http import bench_client
from baton_serve.loadtests.index_bench import redis_url_or_private_server
from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.loadtests.serve_app import replica_stats, serve_app
from baton_serve.loadtests.sim_bench import AGREEMENT, P99_RATIO_TARGET, PROFILES, summarize
from baton_serve.loadtests.sim_cluster import Cluster
from baton_serve.loadtests.sim_profile import Profile, ship_cost
from baton_serve.loadtests.sim_workload import ClusterWorkload, Session, cluster_workload
from baton_serve.loadtests.sse import StreamError, aresponse_events
from baton_serve.replicas.engine.emulated_compute import STATE_PER_TOKEN, EmulatedModel
from baton_serve.replicas.engine.emulated_timing import EmulatedTiming
from baton_serve.replicas.engine.engine_config import EngineConfig

CPUS_PER_REPLICA = 0.01  # Ray's logical CPUs: 64 replicas fit a 2-core machine
HEARTBEAT_S = 0.5
N_CTX = 4096
HTTP_TIMEOUT_S = 600.0
REQUEST_DEADLINE_S = 300.0  # a request without its whole reply by then counts as an error
TARGET_AGREEMENT_SIZES = (16, 32)
TARGET_RATIO_SIZE = 32
COMPARED = ("ttft_p50_s", "ttft_mean_s", "computed_over_new")


def timing_of(profile: Profile) -> EmulatedTiming:
    """A `bench sim` profile as the emulated engine's timing."""
    return EmulatedTiming(
        name=profile.name,
        prefill_tokens_per_s=profile.prefill_tokens_per_s,
        decode_tokens_per_s=profile.decode_tokens_per_s,
        batch_decode_tokens_per_s=profile.batch_decode_tokens_per_s,
        batch_slots=profile.slots,
        state_bytes_per_token=profile.bytes_per_token,
        restore_bytes_per_s=profile.restore_bytes_per_s,
        step_noise=profile.step_noise,
    )


def slowed(
    profile: Profile, workload: ClusterWorkload, slowdown: float
) -> tuple[Profile, ClusterWorkload]:
    """`profile` and `workload` on a clock `slowdown` times slower: every rate divided by
    it, every interval multiplied (the workload's arrivals follow the prefill speed)."""
    if slowdown == 1:
        return profile, workload
    slow_profile = replace(
        profile,
        prefill_tokens_per_s=profile.prefill_tokens_per_s / slowdown,
        decode_tokens_per_s=profile.decode_tokens_per_s / slowdown,
        batch_decode_tokens_per_s=profile.batch_decode_tokens_per_s / slowdown,
        link_bytes_per_s=profile.link_bytes_per_s / slowdown,
        restore_bytes_per_s=profile.restore_bytes_per_s / slowdown,
        ship_latency_s=profile.ship_latency_s * slowdown,
    )
    slow_workload = replace(
        workload,
        think_s=workload.think_s * slowdown,
        burst_every_s=workload.burst_every_s * slowdown,
    )
    return slow_profile, slow_workload


def engine_config(profile: Profile) -> EngineConfig:
    """The replicas' engine: the profile's slots and chunks, and a store that holds as many
    tokens as the profile's (emulated states are smaller: their bytes, not their tokens,
    are scaled; a checkpoint also keeps its token ids, 4 bytes each)."""
    tokens = profile.cache_bytes // profile.bytes_per_token
    return EngineConfig(
        n_ctx=N_CTX,
        n_slots=profile.slots,
        n_threads=1,
        prefill_chunk=profile.prefill_chunk,
        step_tokens=profile.step_tokens,
        block_tokens=profile.block_tokens,
        store_budget_bytes=tokens * (STATE_PER_TOKEN + 4),
        emulated=timing_of(profile),
    )


@dataclass
class Measured:
    """One request as the client saw it."""

    kind: str
    ttft_s: float | None
    prompt_tokens: int
    cached_tokens: int
    new_tokens: int
    error: str | None = None


class Player:
    """Plays the workload's sessions against one app, with token-id prompts."""

    def __init__(
        self, http: httpx.AsyncClient, url: str, model: EmulatedModel, name: str, slowdown: float
    ) -> None:
        self._http, self._url, self._model, self._name = http, url, model, name
        self._slowdown = slowdown  # TTFTs are recorded on the profile's clock
        self._words = np.array(model.word_tokens, dtype=np.int64)
        self._segments: dict[int, list[int]] = {}
        self._finished: set[int] = set()  # prefix keys of finished prompts with their replies
        self.records: list[Measured] = []
        self._start = 0.0

    def _segment_tokens(self, segment: tuple[int, int]) -> list[int]:
        sid, n = segment
        if sid not in self._segments:
            picks = np.random.default_rng(sid).integers(0, len(self._words), n)
            self._segments[sid] = self._words[picks].tolist()
        return self._segments[sid]

    async def play(self, sessions: Sequence[Session]) -> None:
        self._start = time.perf_counter()
        await asyncio.gather(*(self._session(s) for s in sessions))

    async def _session(self, session: Session) -> None:
        await asyncio.sleep(max(0.0, self._start + session.start_s - time.perf_counter()))
        parts: list[tuple[int, ...]] = [tuple(self._segment_tokens(s)) for s in session.head]
        for i, turn in enumerate(session.turns):
            if i:
                await asyncio.sleep(turn.think_s)
            parts += [tuple(self._segment_tokens(s)) for s in turn.added]
            keys = _prefix_keys(parts)
            seen = max((n for k, n in keys if k in self._finished), default=0)
            reply = await self._request(session.kind, parts, keys[-1][1] - seen, turn.reply_tokens)
            if reply is None:
                return
            parts.append(reply)
            self._finished.update(k for k, _ in _prefix_keys(parts))

    async def _request(
        self, kind: str, parts: list[tuple[int, ...]], new: int, max_tokens: int
    ) -> tuple[int, ...] | None:
        prompt = [t for part in parts for t in part]
        body = {"model": self._name, "prompt": prompt, "max_tokens": max_tokens}
        body |= {"temperature": 0, "ignore_eos": True, "stream": True}
        body |= {"stream_options": {"include_usage": True}}
        record = Measured(kind, None, len(prompt), 0, new)
        self.records.append(record)
        text, usage, started = "", {}, time.perf_counter()
        try:
            async with (
                asyncio.timeout(REQUEST_DEADLINE_S * self._slowdown),
                self._http.stream("POST", f"{self._url}/v1/completions", json=body) as r,
            ):
                if r.status_code != 200:
                    await r.aread()
                    record.error = f"HTTP {r.status_code}"
                    return None
                async for chunk in aresponse_events(r):
                    piece = chunk["choices"][0].get("text") if chunk["choices"] else ""
                    if piece and record.ttft_s is None:
                        record.ttft_s = (time.perf_counter() - started) / self._slowdown
                    text += piece or ""
                    usage = chunk.get("usage") or usage
        except StreamError as exc:
            record.error = (exc.error or {}).get("type") or "stream error"
            return None
        except httpx.HTTPError as exc:  # no reply within HTTP_TIMEOUT_S: counted, not fatal
            record.error = type(exc).__name__
            return None
        except TimeoutError:
            record.error = f"no reply within {REQUEST_DEADLINE_S * self._slowdown:g} s"
            return None
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return tuple(self._model.tokenize(text, parse_special=False))


def _prefix_keys(parts: Sequence[tuple[int, ...]]) -> list[tuple[int, int]]:
    keys, key, length = [], 0, 0
    for part in parts:
        key, length = hash((key, part)), length + len(part)
        keys.append((key, length))
    return keys


def figures(records: Sequence[Measured]) -> dict:
    """One policy's figures, named as `bench sim`'s (None where no request succeeded)."""
    ok = [r for r in records if r.error is None and r.ttft_s is not None]
    ttfts = np.array([r.ttft_s for r in ok])
    computed = sum(r.prompt_tokens - r.cached_tokens for r in ok)
    new = sum(r.new_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    errors = sorted({r.error for r in records if r.error is not None})
    found = {"requests": len(records), "errors": len(records) - len(ok), "error_kinds": errors}
    for name, q in (("p50", 50), ("p95", 95), ("p99", 99)):
        found[f"ttft_{name}_s"] = float(np.percentile(ttfts, q)) if ok else None
    return found | {
        "ttft_mean_s": float(ttfts.mean()) if ok else None,
        "computed_over_new": computed / new if new else None,
        "cache_hit_ratio": sum(r.cached_tokens for r in ok) / prompt if prompt else None,
    }


async def _policy_run(
    url: str, app: str, model: EmulatedModel, name: str, sessions, slowdown: float
) -> dict:
    async with bench_client(HTTP_TIMEOUT_S * slowdown, keepalive=200) as http:
        player = Player(http, url, model, name, slowdown)
        started = time.perf_counter()
        await player.play(sessions)
        wall = time.perf_counter() - started
    stats = await replica_stats(app)
    result = figures(player.records) | {"wall_s": wall}
    result["records"] = [asdict(r) for r in player.records]
    result["pulls"] = sum(int(s["pulls"]) for s in stats)
    result["replans"] = dict(sum((Counter(s.get("replans", {})) for s in stats), Counter()))
    result["devices"] = sorted({s["device"] for s in stats})
    return result


def emulated_routing_benchmark(
    model_path: str,
    *,
    replicas: int,
    profile: Profile = PROFILES["cpu"],
    policies: Sequence[RouterPolicy] = tuple(RouterPolicy),
    workload: ClusterWorkload = ClusterWorkload(),
    index: str | None = None,
    progress: Progress = SILENT,
    save: Callable[[dict], None] = lambda _: None,
    slowdown: float = 1.0,
) -> dict:
    """Each policy on `replicas` emulated replicas, and the simulator on the same workload;
    `save` is given the result so far after each policy (a later crash loses nothing).
    The emulated cluster runs on a clock `slowdown` times slower (`slowed`)."""
    phases = cluster_workload(workload, replicas, profile.prefill_tokens_per_s)
    slow_profile, slow_workload = slowed(profile, workload, slowdown)
    slow_phases = (
        phases
        if slowdown == 1
        else cluster_workload(slow_workload, replicas, slow_profile.prefill_tokens_per_s)
    )
    sessions = [s for phase in slow_phases for s in phase.sessions]
    num_cpus = local_cluster_cpus(replicas * CPUS_PER_REPLICA + GATEWAY_CPUS)
    model = EmulatedModel(model_path, timing_of(slow_profile))
    results: dict[str, dict] = {}
    head = {
        "replicas": replicas,
        "profile": asdict(profile),
        "workload": asdict(workload),
        "sessions": len(sessions),
        "slowdown": slowdown,
    }
    progress.start(len(policies))
    try:
        with redis_url_or_private_server(index) as index_spec, local_ray(num_cpus):
            head["index"] = "redis" if index_spec.startswith("redis") else index_spec
            base = BatonConfig(
                model=model_path,
                replicas=replicas,
                num_cpus_per_replica=CPUS_PER_REPLICA,
                engine=engine_config(slow_profile),
                index=index_spec,
                heartbeat_s=HEARTBEAT_S,
                hmac_key=secrets.token_hex(16),
            )
            # Baton's: the link the simulator's replicas pull over, as an operator sets it
            link = {"pull_bandwidth_gb_s": ship_cost(slow_profile).bandwidth_bytes_per_s / 1e9}
            for policy in policies:
                progress.step(
                    f"{policy.value}: {replicas} emulated replicas, {len(sessions)} sessions"
                )
                only_baton = link if policy is RouterPolicy.BATON else {}
                config = base.model_copy(update={"router": policy, **only_baton})
                app = f"emulated-{policy.value}"
                with serve_app(config, app, None) as url:
                    name = config.served_model_name
                    run = _policy_run(url, app, model, name, sessions, slowdown)
                    measured = asyncio.run(run)
                simulation = Cluster(profile, replicas, policy.value, workload.seed).run(phases)
                simulated = summarize(simulation) | {
                    "ttfts_s": [r.ttft_s for r in simulation.records]
                }
                results[policy.value] = {"emulated": measured, "simulated": simulated}
                save(head | {"policies": results, "targets": targets(results, replicas)})
    finally:
        model.close()
    return head | {"policies": results, "targets": targets(results, replicas)}


def targets(results: dict[str, dict], replicas: int) -> dict:
    """Agreement (emulated over simulated within `AGREEMENT`) at 16 and 32 replicas;
    Baton's p50 and p99 at most `P99_RATIO_TARGET` of the best other policy's at 32."""
    found: dict[str, dict] = {}
    if replicas in TARGET_AGREEMENT_SIZES:
        for policy, pair in results.items():
            for name in COMPARED:
                ratio = _ratio(pair["emulated"][name], pair["simulated"][name])
                met = ratio is not None and abs(ratio - 1) <= AGREEMENT
                found[f"{policy} {name} emulated/simulated"] = {"value": ratio, "met": met}
    others = [p for p in results if p != RouterPolicy.BATON.value]
    if replicas == TARGET_RATIO_SIZE and RouterPolicy.BATON.value in results and others:
        for name in ("ttft_p50_s", "ttft_p99_s"):
            best = min(
                (v for p in others if (v := results[p]["emulated"][name]) is not None),
                default=None,
            )
            ratio = _ratio(results[RouterPolicy.BATON.value]["emulated"][name], best)
            found[f"baton {name} / best other"] = {
                "value": ratio,
                "met": ratio is not None and ratio <= P99_RATIO_TARGET,
            }
    return found


def _ratio(value: float | None, to: float | None) -> float | None:
    return None if value is None or not to else value / to


def format_report(result: dict) -> str:
    """The policies side by side: emulated, simulated, and their ratio; then the targets."""
    lines = [
        f"bench routing --engine emulated: {result['replicas']} replicas, profile "
        f"{result['profile']['name']}, {result['sessions']} sessions, index {result['index']}"
        + _slowdown_note(result.get("slowdown", 1)),
        f"{'policy':<16}{'figure':<20}{'emulated':>10}{'simulated':>11}{'ratio':>8}",
    ]
    shown = ("ttft_p50_s", "ttft_mean_s", "ttft_p95_s", "ttft_p99_s", "computed_over_new")
    for policy, pair in result["policies"].items():
        for name in shown:
            emulated, simulated = pair["emulated"][name], pair["simulated"][name]
            ratio = _ratio(emulated, simulated)
            lines.append(
                f"{policy:<16}{name:<20}{_num(emulated):>10}{_num(simulated):>11}{_num(ratio):>8}"
            )
        extra = pair["emulated"]
        lines.append(
            f"{'':<16}requests {extra['requests']}, errors {extra['errors']}, pulls "
            f"{extra['pulls']}, wall {extra['wall_s']:.0f} s, device {','.join(extra['devices'])}"
        )
        if extra.get("replans"):
            replans = ", ".join(f"{k} {v}" for k, v in sorted(extra["replans"].items()))
            lines.append(f"{'':<16}router plans the replicas decided again: {replans}")
        if extra["error_kinds"]:
            lines.append(f"{'':<16}errors: {'; '.join(extra['error_kinds'])}")
    for name, target in result["targets"].items():
        lines.append(
            f"target {name}: {_num(target['value'])} {'met' if target['met'] else 'MISSED'}"
        )
    return "\n".join(lines)


def _slowdown_note(slowdown: float) -> str:
    if slowdown == 1:
        return ""
    return (
        f"\nemulated on a clock {slowdown:g}x slower (compute, link, pauses, arrivals); "
        f"its TTFTs divided by {slowdown:g}, Ray's own work weighs {slowdown:g}x less"
    )


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def scaled(workload: ClusterWorkload, **fields: object) -> ClusterWorkload:
    """`workload` with the given fields replaced (None: kept)."""
    return replace(workload, **{k: v for k, v in fields.items() if v is not None})
