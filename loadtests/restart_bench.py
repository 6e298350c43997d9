"""`baton bench restart`: a rolling restart of every replica, and a downscale by one replica,
under a locust multi-turn chat load; does the cache survive them?

The app is deployed the way a RayService deploys it: a Serve config (`deploy/serve_config.py`)
applied to the controller, with the replica deployment's options set in the config. Each
event is a new config:

- rolling: the replicas' `ray_actor_options` get a new `BATON_DEPLOY_GENERATION` environment
  variable, a change Serve must restart an actor for: it replaces the replicas in a rolling
  update (20% at a time, at least one: with 3 replicas, one after the other; an old one is
  stopped, then its successor started, unless `rollout_surge_percent` lets successors start
  first). It is complete when Serve reports the app running and none of the old replicas
  is left.
- downscale: `num_replicas` one lower (3 → 2), a change Serve applies in place; complete when
  only that many replicas are left.

Locust runs `MultiTurnChatUser` only; the events come one after the other (rolling first by
default), the first after a warm-up, each next one a minute after the previous one was
complete, and the run ends a minute after the last. Figures: `loadtests/restart_figures.py`.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from ray import serve
from ray.serve.context import _get_global_client
from ray.serve.schema import ServeDeploySchema

from baton_serve.deploy.app import (
    GATEWAY_CPUS,
    REPLICA_DEPLOYMENT,
    local_cluster_cpus,
    replica_actor_options,
)
from baton_serve.deploy.config import BatonConfig
from baton_serve.deploy.local_ray import local_ray
from baton_serve.deploy.ports import free_port
from baton_serve.deploy.serve_config import serve_config
from baton_serve.loadtests.locust_process import headless_locust, locust_failed
from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.loadtests.restart_figures import (
    CHAT_CLASS,
    WINDOW_S,
    cold_start,
    event_figures,
    read_requests,
    read_turns,
    window,
)
from baton_serve.loadtests.serve_app import replica_names, wait_healthy
from baton_serve.replicas.engine.engine_config import EngineConfig

APP = "restart"
EVENTS = ("rolling", "downscale")
GENERATION_VAR = "BATON_DEPLOY_GENERATION"
SETTLE_TIMEOUT_S = 600.0
PROGRESS_PERIOD_S = 30.0
STORE_BUDGET_BYTES = 512 << 20  # three replicas' stores on one small machine


def restart_benchmark(
    model_path: Path,
    *,
    out_dir: Path,
    events: tuple[str, ...] = EVENTS,
    users: int = 6,
    replicas: int = 3,
    system_tokens: int = 500,
    max_tokens: int = 16,
    chat_turns: int = 24,
    warmup_s: float = 90.0,
    handoff_s: float | None = None,
    surge_percent: int = 0,
    cpus_per_replica: float = 1.0,
    progress: Progress = SILENT,
) -> dict:
    """Deploy `replicas` replicas of `model_path`, run locust, and go through `events` under
    its load; locust's reports and per-request files go to `out_dir`. `handoff_s`: the
    config's hand-off deadline (None: its default; 0: no hand-off); `surge_percent`: its
    `rollout_surge_percent` (replacements that start before old replicas stop)."""
    unknown = [e for e in events if e not in EVENTS]
    if unknown or not events:
        raise ValueError(f"unknown events {unknown}: choose from {', '.join(EVENTS)}")
    if replicas - events.count("downscale") < 1:
        raise ValueError(f"{replicas} replicas cannot be downscaled {events.count('downscale')}x")
    if warmup_s < WINDOW_S:
        raise ValueError(
            f"the warm-up must hold the minute before the first event ({WINDOW_S:g} s)"
        )
    config = BatonConfig(
        model=str(model_path),
        replicas=replicas,
        num_cpus_per_replica=cpus_per_replica,
        engine=EngineConfig(
            n_ctx=8192, n_slots=2, n_threads=1, store_budget_bytes=STORE_BUDGET_BYTES
        ),
        hmac_key=secrets.token_hex(16),  # the same for every generation of replicas
        rollout_surge_percent=surge_percent,
        **({} if handoff_s is None else {"handoff_s": handoff_s}),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = out_dir / "restart"
    # A rolling update starts replicas while those they replace may still be stopping.
    extra = max(1, math.ceil(replicas * surge_percent / 100))
    num_cpus = local_cluster_cpus((replicas + extra) * cpus_per_replica + GATEWAY_CPUS)
    port = free_port()
    timeline: list[tuple[str, float, float]] = []  # (event, started, done)
    progress.step(f"starting Ray and the app ({replicas} replicas)")
    with local_ray(num_cpus), _serve(port):
        deployed = _Deployment(config, port)
        deployed.apply(replicas, generation=0)
        url = f"http://127.0.0.1:{port}/{APP}"
        wait_healthy(url)
        progress.step(f"locust: {users} users, {warmup_s:.0f} s of warm-up")
        with _locust(url, users, system_tokens, max_tokens, chat_turns, prefix):
            started = time.time()
            _wait_until(started + warmup_s, prefix, progress)
            for event in events:
                progress.step(f"{event}: {_event_text(event, deployed)}")
                at = time.time()
                deployed.change(event)
                timeline.append((event, at, time.time()))
                progress.line(f"{event} complete after {timeline[-1][2] - at:.0f} s")
                _wait_until(timeline[-1][2] + WINDOW_S, prefix, progress)
    turns = read_turns(_final(prefix, "turns"))
    requests = read_requests(_final(prefix, "samples"))
    end = timeline[-1][2] + WINDOW_S
    whole = window(turns, requests, started, end)
    progress.line(f"done: {whole['requests']} requests, {whole['failures']} failures")
    return {
        "model": str(model_path),
        "replicas": replicas,
        "users": users,
        "chat_turns": chat_turns,
        "system_tokens": system_tokens,
        "max_tokens": max_tokens,
        "handoff_s": config.handoff_s,
        "surge_percent": surge_percent,
        "warmup_s": warmup_s,
        "started_at": started,  # time.time() when locust started; events' times count from it
        "requests": whole["requests"],
        "failures": whole["failures"],
        "events": [event_figures(turns, requests, *e, started) for e in timeline],
        "cold_start": cold_start(turns, started),
        "reports": [str(p) for p in sorted(out_dir.glob("restart*"))],
    }


class _Deployment:
    """The app as a Serve config applied to the controller, changed one event at a time."""

    def __init__(self, config: BatonConfig, port: int) -> None:
        self._config = config
        self._port = port
        self.replicas = 0
        self.generation = 0

    def apply(
        self, replicas: int, generation: int, *, replaced: frozenset[str] = frozenset()
    ) -> None:
        """Apply the config for `replicas` of `generation`; return once Serve runs exactly
        that many and none of `replaced` is left."""
        self.replicas, self.generation = replicas, generation
        app = serve_config(self._config, app_name=APP)["applications"][0]
        options = replica_actor_options(self._config)
        options["runtime_env"] = {"env_vars": {GENERATION_VAR: str(generation)}}
        app["route_prefix"] = f"/{APP}"
        app["deployments"] = [
            {"name": REPLICA_DEPLOYMENT, "num_replicas": replicas, "ray_actor_options": options}
        ]
        document = {
            "http_options": {"host": "127.0.0.1", "port": self._port},
            "applications": [app],
        }
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate(document))
        self._wait_settled(replaced)

    def change(self, event: str) -> None:
        old = frozenset(replica_names(APP))
        if event == "rolling":
            self.apply(self.replicas, self.generation + 1, replaced=old)
        else:
            self.apply(self.replicas - 1, self.generation)

    def _wait_settled(self, replaced: frozenset[str]) -> None:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            app = serve.status().applications.get(APP)
            if app is not None and app.status == "DEPLOY_FAILED":
                raise RuntimeError(f"deploying the app failed: {app.message}")
            replica = app.deployments.get(REPLICA_DEPLOYMENT) if app else None
            ids = set(replica_names(APP))
            if (
                app is not None
                and app.status == "RUNNING"
                and replica is not None
                and replica.status == "HEALTHY"
                and len(ids) == self.replicas
                and not ids & replaced
            ):
                return
            time.sleep(0.25)
        raise TimeoutError(f"the app did not settle at {self.replicas} replicas")


def _event_text(event: str, deployed: _Deployment) -> str:
    if event == "rolling":
        return f"replacing the {deployed.replicas} replicas (rolling update)"
    return f"{deployed.replicas} → {deployed.replicas - 1} replicas"


@contextlib.contextmanager
def _serve(port: int) -> Iterator[None]:
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            serve.delete(APP)
        serve.shutdown()


@contextlib.contextmanager
def _locust(
    url: str, users: int, system_tokens: int, max_tokens: int, chat_turns: int, prefix: Path
) -> Iterator[None]:
    """Locust headless until the block ends (then stopped with SIGTERM, which writes its
    reports); its per-request files and output (`_locust.log`) are written at `prefix`."""
    for name in ("samples", "turns"):  # an earlier run's must not pass for this one's
        _final(prefix, name).unlink(missing_ok=True)
    options = [
        *("--system-tokens", str(system_tokens), "--max-tokens", str(max_tokens)),
        *("--chat-turns", str(chat_turns), CHAT_CLASS),
    ]
    with headless_locust(url, prefix, users, users, options) as locust:
        try:
            yield
        finally:
            locust.send_signal(signal.SIGTERM)
            try:
                locust.wait(timeout=60)
            except subprocess.TimeoutExpired:
                locust.kill()
    if not _final(prefix, "turns").exists():
        raise locust_failed(locust, prefix)


def _final(prefix: Path, name: str) -> Path:
    return prefix.parent / f"{prefix.name}_{name}.csv"


def _wait_until(deadline: float, prefix: Path, progress: Progress) -> None:
    """Sleep until `deadline` (a `time.time()`), telling how the last minute went now and then."""
    last = time.time()
    while (now := time.time()) < deadline:
        time.sleep(min(1.0, deadline - now))
        if time.time() - last >= PROGRESS_PERIOD_S:
            last = time.time()
            turns = read_turns(prefix.parent / f"{prefix.name}_turns.csv.part")
            requests = read_requests(prefix.parent / f"{prefix.name}_samples.csv.part")
            w = window(turns, requests, last - WINDOW_S, last)
            ratio = w["follow_up_cached_ratio"]
            progress.line(
                f"last minute: {w['requests']} requests, {w['failures']} failures,"
                f" follow-ups {'-' if ratio is None else f'{100 * ratio:.1f}%'} cached"
            )
