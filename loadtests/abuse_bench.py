"""`baton bench abuse`: abusive bodies against a live server, and what a normal request
beside them sees.

Each abusive body (`abusive_bodies`: oversized lists and texts, and the poison requests whose
client values once reached native code or the event loop unbounded — a huge `max_tokens`
with a penalty, a deeply nested grammar, 150,000 choices, a backtracking pattern, aliased
`logit_bias` ids, a request's whole work budget, a long `/detokenize`) is sent over and over
from a few clients for a while, as a normal small chat request is sent again and again
beside them. Printed per body: the normal request's latency (p50/p99/max, and any that
failed), and the abusive ones' statuses and times. Targets: the normal request under 1 s,
every abusive one answered with a 4xx in under 2 s. A baseline without abuse comes first.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np

from baton_serve.loadtests.progress import SILENT, Progress

NORMAL_TARGET_S = 1.0
ABUSIVE_TARGET_S = 2.0
HTTP_TIMEOUT_S = 120.0
APP = "abuse"


def abusive_bodies(model: str) -> dict[str, tuple[str, dict]]:
    """The abusive requests by name: (path, body)."""
    return {
        "chat of 20,001 messages": (
            "/v1/chat/completions",
            {
                "model": model,
                "messages": [{"role": "user", "content": "word"}] * 20_001,
                "max_tokens": 1,
            },
        ),
        "completion of 2,000 prompts": (
            "/v1/completions",
            {"model": model, "prompt": ["word"] * 2_000, "max_tokens": 1},
        ),
        "chat of one 1 MiB message": (
            "/v1/chat/completions",
            {
                "model": model,
                "messages": [{"role": "user", "content": ("word " * (1 << 18))[: 1 << 20]}],
                "max_tokens": 1,
            },
        ),
        **poison_bodies(model),
    }


def poison_bodies(model: str) -> dict[str, tuple[str, dict]]:
    """Small bodies whose values once reached llama.cpp or the event loop unbounded."""
    chat = "/v1/chat/completions"
    hello = [{"role": "user", "content": "hello"}]
    return {
        "max_tokens 2^31-1, penalty": (  # once an 8 GiB penalty window per choice
            chat,
            {"model": model, "messages": hello, "max_tokens": 2**31 - 1, "presence_penalty": 0.1},
        ),
        "grammar nested 30,000 deep": (  # once a segfault in llama.cpp's grammar parser
            chat,
            {"model": model, "messages": hello, "grammar": _nested_grammar(30_000)},
        ),
        "guided_choice of 150,000": (
            chat,
            {"model": model, "messages": hello, "guided_choice": [f"c{i}" for i in range(150_000)]},
        ),
        "pattern ^(a?){1000}a{1000}$": (
            chat,
            {
                "model": model,
                "messages": hello,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "p",
                        "schema": {"type": "string", "pattern": "^(a?){1000}a{1000}$"},
                    },
                },
            },
        ),
        "logit_bias, 20,000 aliased ids": (  # "7", "07", "007", ...: one id, many keys
            chat,
            {
                "model": model,
                "messages": hello,
                "max_tokens": 1,
                "logit_bias": {"0" * zeros + str(i): 1 for i in range(500) for zeros in range(40)},
            },
        ),
        "256 prompts, n 16, 100k tokens": (
            "/v1/completions",
            {"model": model, "prompt": ["word"] * 256, "n": 16, "max_tokens": 100_000},
        ),
        "detokenize of 1,000,000 ids": ("/detokenize", {"tokens": [1] * 1_000_000}),
    }


def _nested_grammar(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


def normal_body(model: str) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 4,
        "temperature": 0,
    }


def served_model(url: str, api_key: str | None = None) -> str:
    """The first model the server at `url` lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).raise_for_status()
    return models.json()["data"][0]["id"]


def abuse_benchmark(
    url: str,
    model: str,
    *,
    api_key: str | None = None,
    seconds: float = 5.0,
    abusers: int = 2,
    progress: Progress = SILENT,
) -> dict:
    """The figures for each abusive body against the server at `url` (serving `model`)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=HTTP_TIMEOUT_S) as client:
        warm = client.post("/v1/chat/completions", json=normal_body(model))
        if warm.status_code != 200:
            raise RuntimeError(f"the normal request failed: {warm.status_code} {warm.text[:200]}")
        progress.step(f"baseline: the normal request alone for {seconds:g} s")
        runs = {"baseline (no abuse)": _run(client, model, None, seconds, abusers)}
        for name, abuse in abusive_bodies(model).items():
            progress.step(f"{name}, {abusers} clients, for {seconds:g} s")
            runs[name] = _run(client, model, abuse, seconds, abusers)
    return {
        "url": url,
        "seconds": seconds,
        "abusers": abusers,
        "targets": {"normal_s": NORMAL_TARGET_S, "abusive_s": ABUSIVE_TARGET_S},
        "runs": runs,
    }


def _run(
    client: httpx.Client, model: str, abuse: tuple[str, dict] | None, seconds: float, abusers: int
) -> dict:
    """The normal request, in a loop, while `abusers` clients send `abuse` in a loop."""
    stop = threading.Event()
    abusive: list[tuple[int, float]] = []
    threads = []
    if abuse is not None:
        path, body = abuse
        content = httpx.Request("POST", "http://x", json=body).content  # encoded once
        send = _sender(client, path, content, abusive)
        threads = [threading.Thread(target=_repeat, args=(send, stop)) for _ in range(abusers)]
    for thread in threads:
        thread.start()
    normal: list[tuple[int, float]] = []
    deadline = time.monotonic() + seconds
    body = normal_body(model)
    try:
        while time.monotonic() < deadline or (threads and not abusive):
            normal.append(_timed(lambda: client.post("/v1/chat/completions", json=body)))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    return summarise(normal, abusive)


def _sender(
    client: httpx.Client, path: str, content: bytes, into: list[tuple[int, float]]
) -> Callable[[], None]:
    headers = {"Content-Type": "application/json"}

    def send() -> None:
        into.append(_timed(lambda: client.post(path, content=content, headers=headers)))

    return send


def _repeat(send: Callable[[], None], stop: threading.Event) -> None:
    while not stop.is_set():
        send()


def _timed(call: Callable[[], httpx.Response]) -> tuple[int, float]:
    """(status, seconds); status 0 for a request that got no answer."""
    started = time.perf_counter()
    try:
        status = call().status_code
    except httpx.HTTPError:
        status = 0
    return status, time.perf_counter() - started


def summarise(normal: list[tuple[int, float]], abusive: list[tuple[int, float]]) -> dict:
    """The figures of one run: the normal request's latency and failures, the abusive
    requests' statuses and times, and whether each met its target."""
    ok = [s for status, s in normal if status == 200]
    row: dict = {
        "normal": {
            "requests": len(normal),
            "failed": len(normal) - len(ok),
            **_latency(ok),
        },
        "normal_met_target": bool(ok) and len(ok) == len(normal) and max(ok) < NORMAL_TARGET_S,
    }
    if abusive:
        times = [s for _, s in abusive]
        row["abusive"] = {
            "requests": len(abusive),
            "statuses": {str(k): v for k, v in sorted(Counter(st for st, _ in abusive).items())},
            **_latency(times),
        }
        row["abusive_met_target"] = all(
            400 <= status < 500 and s < ABUSIVE_TARGET_S for status, s in abusive
        )
    return row


def _latency(seconds: list[float]) -> dict:
    if not seconds:
        return {"p50_s": None, "p99_s": None, "max_s": None}
    values = np.asarray(seconds)
    return {
        "p50_s": round(float(np.percentile(values, 50)), 4),
        "p99_s": round(float(np.percentile(values, 99)), 4),
        "max_s": round(float(values.max()), 4),
    }


def format_report(result: dict) -> str:
    """The runs as a table."""
    lines = [
        f"abusive bodies against {result['url']}, {result['seconds']:g} s each, "
        f"{result['abusers']} abusive clients; targets: normal < {NORMAL_TARGET_S:g} s, "
        f"abusive 4xx < {ABUSIVE_TARGET_S:g} s",
        f"{'run':<30} {'normal n':>8} {'fail':>4} {'p50 s':>7} {'p99 s':>7} {'max s':>7}"
        f"  {'abusive n':>9} {'statuses':<12} {'p50 s':>7} {'max s':>7}  met",
    ]
    for name, run in result["runs"].items():
        normal = run["normal"]
        line = (
            f"{name:<30} {normal['requests']:>8} {normal['failed']:>4} "
            f"{_s(normal['p50_s'])} {_s(normal['p99_s'])} {_s(normal['max_s'])}"
        )
        met = run["normal_met_target"]
        if "abusive" in run:
            abusive = run["abusive"]
            statuses = ",".join(f"{k}x{v}" for k, v in abusive["statuses"].items())
            line += (
                f"  {abusive['requests']:>9} {statuses:<12} "
                f"{_s(abusive['p50_s'])} {_s(abusive['max_s'])}"
            )
            met = met and run["abusive_met_target"]
        else:
            line += " " * 41
        lines.append(f"{line}  {'yes' if met else 'NO'}")
    return "\n".join(lines)


def _s(value: float | None) -> str:
    return f"{value:>7.3f}" if value is not None else f"{'-':>7}"


@contextlib.contextmanager
def local_server(model: Path, progress: Progress = SILENT) -> Iterator[tuple[str, str]]:
    """A fresh Baton app (one replica) on a local Ray cluster: (url, served model name)."""
    from baton_serve.deploy.config import BatonConfig
    from baton_serve.deploy.local_ray import local_ray
    from baton_serve.loadtests.serve_app import serve_app

    config = BatonConfig(model=str(model), replicas=1, num_cpus_per_replica=1)
    progress.step("starting a local Baton app")
    with local_ray(num_cpus=2), serve_app(config, APP, None) as url:
        yield url, config.served_model_name
