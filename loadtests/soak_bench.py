"""`baton bench soak`: a mixed locust workload against a local cluster for N minutes.

Locust runs the three user classes of `loadtests/locustfile.py` (multi-turn chat, agent loop,
no sharing) headless against a fresh Baton app. Printed: requests and failures, TTFT p50/p99
minute by minute (from the locustfile's per-request samples), and each replica process's
resident memory (RSS, read from /proc) at the end of warm-up and at the end of the run: past
warm-up it must grow by less than 10%. The replicas' checkpoint stores get a small budget
(256 MiB) so that this cache is full by then: its growth to the budget is by design.
"""

from __future__ import annotations

import asyncio
import csv
import io
import os
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import ray

from baton_serve.deploy.app import GATEWAY_CPUS, REPLICA_DEPLOYMENT, local_cluster_cpus
from baton_serve.deploy.config import BatonConfig
from baton_serve.deploy.local_ray import local_ray
from baton_serve.loadtests.locust_process import headless_locust, locust_failed
from baton_serve.loadtests.plots import soak_plots
from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.loadtests.serve_app import replica_actors, replica_stats, serve_app
from baton_serve.replicas.engine.engine_config import EngineConfig

APP = "soak"
USER_CLASSES = ("MultiTurnChatUser", "AgentLoopUser", "NoSharingUser")
RSS_PERIOD_S = 5.0
MAX_WARMUP_S = 60.0
RSS_GROWTH_TARGET = 0.10
# The checkpoint store is a cache that grows to its budget: a small one fills during warm-up,
# so growth after it is what leaks would show.
STORE_BUDGET_BYTES = 256 << 20
WINDOW_S = 60.0


class MemorySampler:
    """Every `RSS_PERIOD_S`, in a thread: the RSS of the app's replica processes, and how
    full their checkpoint stores are (the fullest-first replica's share of the budget).

    Ray titles a replica's process `ray::ServeReplica:<app>:<deployment>...`; a replica that
    is replaced shows up as a new process id."""

    def __init__(self, app: str, store_budget_bytes: int) -> None:
        self._app = app
        self._title = f"ray::ServeReplica:{app}:{REPLICA_DEPLOYMENT}".encode()
        self._budget = store_budget_bytes
        self.rss: list[tuple[float, int, int]] = []  # (time, pid, rss bytes)
        self.store_fill: list[tuple[float, float]] = []  # (time, least-full store / budget)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0 if not self.rss else RSS_PERIOD_S):
            self._sample_rss()
            self._sample_stores()

    def _sample_rss(self) -> None:
        now = time.time()
        found: dict[int, tuple[int, int]] = {}  # pid → (parent pid, rss)
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if not (proc / "cmdline").read_bytes().startswith(self._title):
                    continue
                status = (proc / "status").read_text()
            except OSError:  # the process ended meanwhile
                continue
            found[int(proc.name)] = (_parent_pid(status), _rss_bytes(status))
        for pid, (parent, rss) in found.items():
            if parent not in found:  # a replica's child (forked, not yet exec'd) has its title
                self.rss.append((now, pid, rss))

    def _sample_stores(self) -> None:
        refs = [a.record_routing_stats.remote() for a in replica_actors(self._app).values()]
        try:
            stats = ray.get(refs, timeout=5)
        except ray.exceptions.RayError:
            return
        if stats:
            least = min(int(s["cache_bytes"]) for s in stats)
            self.store_fill.append((time.time(), least / self._budget))


def _rss_bytes(status: str) -> int:
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _locust(
    url: str,
    seconds: int,
    users: int,
    system_tokens: int,
    max_tokens: int,
    prefix: Path,
    each_window: Callable[[int], None],
) -> None:
    """Run the locustfile headless; its reports, samples and output (`_locust.log`) are
    written at `prefix`. `each_window(n)` is called after each `WINDOW_S` of the run."""
    samples = prefix.parent / f"{prefix.name}_samples.csv"
    samples.unlink(missing_ok=True)  # an earlier run's must not pass for this one's
    options = [
        *("--run-time", f"{seconds}s", "--stop-timeout", "60"),
        *("--system-tokens", str(system_tokens), "--max-tokens", str(max_tokens)),
        *USER_CLASSES,
    ]
    started = time.monotonic()
    windows = 0
    with headless_locust(url, prefix, users, max(1, users // 5), options) as locust:
        while locust.poll() is None:
            time.sleep(1.0)
            elapsed = time.monotonic() - started
            if elapsed > seconds + 300:
                locust.kill()
            elif elapsed >= (windows + 1) * WINDOW_S:
                windows += 1
                each_window(windows)
    if not samples.exists():
        raise locust_failed(locust, prefix)


def _read_samples(path: Path) -> list[tuple[float, str, float, bool]]:
    """(time, type, seconds, ok) of every complete sample line the locustfile wrote."""
    text = path.read_text() if path.exists() else ""
    rows = csv.DictReader(io.StringIO(text[: text.rfind("\n") + 1]))
    return [
        (float(r["time_s"]), r["type"], float(r["response_time_ms"]) / 1000, r["ok"] == "True")
        for r in rows
    ]


def _so_far(figures: dict) -> str:
    return (
        f"{figures['requests']} requests, {figures['failures']} failures,"
        f" TTFT p50 {_s(figures['ttft_p50_s'])} p99 {_s(figures['ttft_p99_s'])}"
    )


def _figures(samples: list[tuple[float, str, float, bool]]) -> dict:
    """Requests (locust's "POST" rows), failures, and TTFT percentiles of `samples`."""
    requests = [ok for _, kind, _, ok in samples if kind == "POST"]
    ttfts = [seconds for _, kind, seconds, _ in samples if kind == "TTFT"]
    return {
        "requests": len(requests),
        "failures": requests.count(False),
        "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else None,
        "ttft_p99_s": float(np.percentile(ttfts, 99)) if ttfts else None,
    }


def _windows(samples: list[tuple[float, str, float, bool]], started: float) -> list[dict]:
    """`_figures` per `WINDOW_S` since `started`."""
    by_window: dict[int, list] = defaultdict(list)
    for sample in samples:
        by_window[int((sample[0] - started) // WINDOW_S)].append(sample)
    return [{"minute": w + 1, **_figures(by_window[w])} for w in sorted(by_window)]


def _warmup_s(sampler: MemorySampler, started: float, seconds: int) -> float:
    """Warm-up lasts `MAX_WARMUP_S` (a quarter of a short run), and longer while a replica's
    checkpoint store is under 90% full: until it is, at most three quarters into the run."""
    base = min(MAX_WARMUP_S, 0.25 * seconds)
    full = next((at - started for at, fill in sampler.store_fill if fill >= 0.9), None)
    return base if full is None else min(max(base, full), 0.75 * seconds)


def _parent_pid(status: str) -> int:
    """PPid from a /proc/<pid>/status text."""
    line = next(line for line in status.splitlines() if line.startswith("PPid:"))
    return int(line.split()[1])


def _memory(samples: list[tuple[float, int, int]], started: float, warmup_s: float) -> dict:
    """Per replica process: RSS at the end of warm-up and at the end; the largest growth."""
    by_pid: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for at, pid, rss in samples:
        by_pid[pid].append((at - started, rss))
    replicas = {}
    for pid, series in by_pid.items():
        after = [(t, rss) for t, rss in series if t >= warmup_s]
        if len(after) < 2:
            continue  # a process that did not live through the run
        start, end = after[0][1], after[-1][1]
        replicas[str(pid)] = {"rss_start_mb": start / 2**20, "rss_end_mb": end / 2**20}
        replicas[str(pid)]["growth"] = end / start - 1
    growth = max((r["growth"] for r in replicas.values()), default=None)
    return {"replicas": replicas, "max_growth": growth}


def _rss_by_window(samples: list[tuple[float, int, int]], started: float) -> dict[int, float]:
    """The largest replica RSS (MB) seen in each `WINDOW_S`."""
    largest: dict[int, float] = {}
    for at, _, rss in samples:
        window = int((at - started) // WINDOW_S)
        largest[window] = max(largest.get(window, 0.0), rss / 2**20)
    return largest


def soak_benchmark(
    model_path: Path,
    *,
    minutes: float,
    out_dir: Path,
    users: int = 6,
    replicas: int = 2,
    system_tokens: int = 500,
    max_tokens: int = 32,
    cpus_per_replica: float = 1.0,
    store_budget_bytes: int = STORE_BUDGET_BYTES,
    http_port: int | None = None,
    progress: Progress = SILENT,
) -> dict:
    """Run the mixed workload for `minutes` against `replicas` replicas of `model_path`;
    locust's CSV/HTML reports, samples and the PNG plots go to `out_dir`."""
    seconds = max(10, round(minutes * 60))
    threads = max(1, (os.cpu_count() or 1) // replicas)
    config = BatonConfig(
        model=str(model_path),
        replicas=replicas,
        num_cpus_per_replica=cpus_per_replica,
        engine=EngineConfig(
            n_ctx=8192, n_slots=4, n_threads=threads, store_budget_bytes=store_budget_bytes
        ),
        hmac_key=secrets.token_hex(16),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = out_dir / "soak"
    num_cpus = local_cluster_cpus(replicas * cpus_per_replica + GATEWAY_CPUS)
    progress.step(f"starting Ray and the app ({replicas} replicas)")
    with (
        local_ray(num_cpus),
        serve_app(config, APP, http_port) as url,
        MemorySampler(APP, store_budget_bytes) as memory,
    ):
        started = time.time()

        def each_window(window: int) -> None:
            rss = _rss_by_window(list(memory.rss), started).get(window - 1)
            progress.line(
                f"minute {window} of {seconds / 60:.1f}, so far: "
                + _so_far(_figures(_read_samples(out_dir / "soak_samples.csv.part")))
                + f"; largest replica RSS this minute {_mb(rss)}"
            )

        progress.step(f"locust: {users} users for {seconds} s")
        _locust(url, seconds, users, system_tokens, max_tokens, prefix, each_window)
        stores = [s["cache_bytes"] for s in asyncio.run(replica_stats(APP))]
    samples = _read_samples(out_dir / "soak_samples.csv")
    warmup_s = _warmup_s(memory, started, seconds)
    windows = _windows(samples, started)
    rss_by_window = _rss_by_window(memory.rss, started)
    for window in windows:
        window["rss_max_mb"] = rss_by_window.get(window["minute"] - 1)
    progress.line(f"done: {_so_far(_figures(samples))}")
    rss = [(at - started, pid, size) for at, pid, size in memory.rss]
    plots = soak_plots(rss, windows, warmup_s, out_dir)
    return {
        "model": str(model_path),
        "minutes": seconds / 60,
        "users": users,
        "user_classes": list(USER_CLASSES),
        "replicas": replicas,
        "warmup_s": warmup_s,
        **_figures(samples),
        "windows": windows,
        "memory": _memory(memory.rss, started, warmup_s),
        "store_budget_mb": store_budget_bytes / 2**20,
        "store_end_mb": [b / 2**20 for b in stores],
        "rss_growth_target": RSS_GROWTH_TARGET,
        "reports": [str(p) for p in sorted(out_dir.glob("soak*"))],
        "plots": [str(p) for p in plots],
    }


def format_report(result: dict) -> str:
    lines = [
        f"soak: {result['model']}, {result['replicas']} replicas, {result['users']} locust users"
        f" ({', '.join(result['user_classes'])}), {result['minutes']:.1f} min",
        f"requests {result['requests']}, failures {result['failures']};"
        f" TTFT p50 {_s(result['ttft_p50_s'])}, p99 {_s(result['ttft_p99_s'])}",
        f"{'minute':>6} {'requests':>9} {'failures':>9} {'TTFT p50':>9} {'TTFT p99':>9}"
        f" {'max RSS':>9}",
    ]
    for w in result["windows"]:
        lines.append(
            f"{w['minute']:>6} {w['requests']:>9} {w['failures']:>9} {_s(w['ttft_p50_s']):>9}"
            f" {_s(w['ttft_p99_s']):>9} {_mb(w['rss_max_mb']):>9}"
        )
    memory = result["memory"]
    stores = ", ".join(f"{mb:.0f}" for mb in result["store_end_mb"])
    lines.append(
        f"checkpoint stores at the end: {stores} MB (budget {result['store_budget_mb']:.0f} MB each)"
    )
    lines.append(f"replica RSS after {result['warmup_s']:.0f} s of warm-up and at the end:")
    for pid, r in memory["replicas"].items():
        lines.append(
            f"  pid {pid}: {r['rss_start_mb']:.0f} MB -> {r['rss_end_mb']:.0f} MB ({r['growth']:+.1%})"
        )
    if memory["max_growth"] is not None:
        met = memory["max_growth"] < result["rss_growth_target"]
        lines.append(
            f"largest growth {memory['max_growth']:+.1%} (target < {result['rss_growth_target']:.0%}):"
            f" {'met' if met else 'NOT met'}"
        )
    lines.append("wrote " + ", ".join(result["reports"]))
    return "\n".join(lines)


def _mb(mb: float | None) -> str:
    return "-" if mb is None else f"{mb:.0f} MB"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}s"
