"""One server's run of `bench peer`'s workload, and its figures: the sessions, `concurrency`
at a time, each request streamed (greedy, `ignore_eos`, usage included); TTFT and the gaps
between content chunks timed at the client (`play_server`) or at the engine's token events
(`engine_peer.play_engine`); `summarize` and `compare` over either. Nothing here imports
Ray: a GPU machine without it runs this too (`bench device --peer`)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np

from baton_serve.loadtests.bench_http import bench_client
from baton_serve.loadtests.peer_workload import PeerWorkload, Session
from baton_serve.loadtests.sse import StreamError, aresponse_events

LLAMA_SERVER, BATON = "llama-server", "baton"
HTTP_TIMEOUT_S = 600.0
WARMUP_REQUESTS = 2
QUANTILES = (50, 95, 99)
TARGET = 1.0  # Baton / llama-server: at most this for latencies, at least for throughput


def new_trace() -> tuple[str, str]:
    """A trace id and the `traceparent` header that starts a sampled trace with it."""
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-01"


@dataclass
class PeerRecord:
    """One request of one server's run."""

    server: str
    kind: str
    session: int
    turn: int
    sent_ns: int  # wall clock, comparable with span times
    ttft_s: float | None = None
    total_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # between streamed content chunks
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    trace_id: str = ""
    parts: dict[str, float] | None = None  # from the spans (traced runs only)


async def _stream_chat(
    http: httpx.AsyncClient, url: str, body: dict, record: PeerRecord, traceparent: str
) -> str:
    """Send one streamed chat request, filling `record`; returns the reply's text."""
    text, last = "", 0.0
    started = time.perf_counter()
    request = http.build_request(
        "POST", f"{url}/v1/chat/completions", json=body, headers={"traceparent": traceparent}
    )
    try:
        r = await _send(http, request)
        try:
            if r.status_code != 200:
                await r.aread()
                record.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return text
            async for chunk in aresponse_events(r):
                delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else ""
                if delta:
                    now = time.perf_counter()
                    if record.ttft_s is None:
                        record.ttft_s = now - started
                    else:
                        record.gaps_s.append(now - last)
                    last, text = now, text + delta
                if usage := chunk.get("usage"):
                    record.prompt_tokens = usage.get("prompt_tokens", 0)
                    record.completion_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = details.get("cached_tokens") or 0
        finally:
            await r.aclose()
    except (StreamError, httpx.HTTPError) as exc:  # this request's fault, counted, not fatal
        record.error = f"{type(exc).__name__}: {exc}"
    record.total_s = time.perf_counter() - started
    return text


async def _send(http: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
    """`request`'s streamed response; sent once more if the server closed the kept-alive
    connection as the request left (no response at all: seen on llama-server), as HTTP
    libraries do. The retry's time counts."""
    try:
        return await http.send(request, stream=True)
    except httpx.RemoteProtocolError:
        return await http.send(request, stream=True)


async def play_server(
    url: str,
    model_name: str,
    server: str,
    sessions: list[Session],
    workload: PeerWorkload,
    recorded: Callable[[int], None],
) -> tuple[list[PeerRecord], float]:
    """Every session against one server, `concurrency` at a time; the records and the wall
    time of the whole run."""
    records: list[PeerRecord] = []
    slots = asyncio.Semaphore(workload.concurrency)

    def body(messages: list[dict], max_tokens: int) -> dict:
        return {
            "model": model_name,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def session(http: httpx.AsyncClient, script: Session) -> None:
        messages = [{"role": "system", "content": script.system}]
        async with slots:
            for turn, text in enumerate(script.messages):
                content = script.first_content(workload.image_px) if turn == 0 else text
                messages.append({"role": "user", "content": content})
                trace_id, traceparent = new_trace()
                record = PeerRecord(
                    server, script.kind, script.index, turn, time.time_ns(), trace_id=trace_id
                )
                reply = await _stream_chat(
                    http, url, body(messages, workload.reply_tokens), record, traceparent
                )
                records.append(record)
                recorded(len(records))
                messages.append({"role": "assistant", "content": reply})

    async with bench_client(HTTP_TIMEOUT_S) as http:
        for i in range(WARMUP_REQUESTS):  # llama.cpp's first-call costs, on neither side
            warm = PeerRecord(server, "warm-up", i, 0, time.time_ns())
            messages = [{"role": "user", "content": f"Warm-up {i}: say hi."}]
            await _stream_chat(http, url, body(messages, 4), warm, new_trace()[1])
            if warm.error:
                raise RuntimeError(f"{server}: warm-up request failed: {warm.error}")
        started = time.perf_counter()
        await asyncio.gather(*(session(http, s) for s in sessions))
        return records, time.perf_counter() - started


# ---- figures --------------------------------------------------------------------------------


def _quantiles(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": float(np.percentile(values, q)) if values else None for q in QUANTILES}


def summarize(records: list[PeerRecord], wall_s: float) -> dict:
    ok = [r for r in records if not r.error and r.ttft_s is not None]
    cold, follow = [r for r in ok if r.turn == 0], [r for r in ok if r.turn > 0]
    followed_prompts = sum(r.prompt_tokens for r in follow)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "ttft_s": _quantiles([r.ttft_s for r in ok]),
        "cold_ttft_s": _quantiles([r.ttft_s for r in cold]),
        "follow_up_ttft_s": _quantiles([r.ttft_s for r in follow]),
        "follow_up_cached": sum(r.cached_tokens for r in follow) / followed_prompts
        if followed_prompts
        else None,
        "itl_s": _quantiles([g for r in ok for g in r.gaps_s]),
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / wall_s if wall_s else 0.0,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "completion_tokens": sum(r.completion_tokens for r in ok),
        "wall_s": wall_s,
    }


def compare(baton: dict, peer: dict) -> list[dict]:
    """One row per figure: both values, Baton / llama-server, and whether the target holds."""
    rows = []
    for metric in ("ttft_s", "itl_s"):
        for q in QUANTILES:
            rows.append(
                (f"{metric[:-2]} p{q}", baton[metric][f"p{q}"], peer[metric][f"p{q}"], True)
            )
    follow = "follow_up_ttft_s"
    rows.append(("follow-up ttft p50", baton[follow]["p50"], peer[follow]["p50"], True))
    rows.append(("requests/s", baton["requests_per_s"], peer["requests_per_s"], False))
    result = []
    for name, ours, theirs, lower_better in rows:
        ratio = ours / theirs if ours is not None and theirs else None
        met = None if ratio is None else (ratio <= TARGET if lower_better else ratio >= TARGET)
        result.append(
            {
                "figure": name,
                BATON: ours,
                LLAMA_SERVER: theirs,
                "ratio": ratio,
                "target": f"{'<=' if lower_better else '>='} {TARGET:g}",
                "met": met,
            }
        )
    return result


def _value(row: dict, side: str) -> str:
    value = row[side]
    if value is None:
        return "-"
    return f"{value:.2f}" if row["figure"] == "requests/s" else f"{value * 1000:.0f} ms"


def comparison_lines(rows: list[dict]) -> list[str]:
    """`compare`'s rows as a table: each figure on both sides, the ratio and its target."""
    lines = [f"  {'figure':<19}{'llama-server':>14}{'baton':>12}{'baton/llama':>13}  target"]
    for row in rows:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        verdict = {True: "met", False: "NOT met", None: "-"}[row["met"]]
        lines.append(
            f"  {row['figure']:<19}{_value(row, LLAMA_SERVER):>14}{_value(row, BATON):>12}"
            f"{ratio:>13}  {row['target']}x: {verdict}"
        )
    return lines
