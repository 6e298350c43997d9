"""`baton bench peer`: Baton against llama-server on one node, one seeded workload each.

The peer is llama-server built from the llama.cpp Baton's wheel vendors
(`deploy.llama_server_build`), started with T threads and S slots (`-t T -np S --jinja`, its
own prompt cache and context checkpoints on by default), on the CPU kernels Baton's engine
loads. Baton is deployed as `baton serve` deploys it (R replicas, HAProxy, the
gateway, the router and the embedded index) with the same threads and slots in total:
T/R llama.cpp threads and S/R slots a replica. Both get the same sessions
(`peer_workload`), `concurrency` at a time, every request streamed with usage, greedy,
`ignore_eos` so both generate the same number of tokens.

TTFT and inter-token latency (the gaps between streamed content chunks) are measured at the
client. Then Baton runs the workload once more with tracing on, and each request's spans
give where its time went (`span_breakdown`); that run is not in the comparison.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from baton_serve.deploy.app import engine_threads
from baton_serve.deploy.config import BatonConfig
from baton_serve.deploy.cpu_layout import share_cpus, usable_cpus
from baton_serve.loadtests.bench_http import bench_client
from baton_serve.loadtests.llama_server import ServerSettings, llama_server
from baton_serve.loadtests.peer_workload import PeerWorkload, Session, make_sessions, script_digest
from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.loadtests.serve_app import on_local_ray, wait_idle
from baton_serve.loadtests.span_breakdown import (
    SpanReceiver,
    breakdown,
    new_trace,
    request_parts,
)
from baton_serve.loadtests.sse import StreamError, aresponse_events
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_model import LlamaModel

LLAMA_SERVER, BATON, TRACED = "llama-server", "baton", "baton-traced"
APP = "peer"
HTTP_TIMEOUT_S = 600.0
WARMUP_REQUESTS = 2
QUANTILES = (50, 95, 99)
ENGINE_REPORTED = {"n_ctx", "n_slots", "n_threads", "node_cores", "exact_reuse", "flash_attn"}
TARGET = 1.0  # Baton / llama-server: at most this for latencies, at least for throughput


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


async def _play(
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


# ---- the two servers ------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """The same threads and slots in total on both sides."""

    threads: int
    slots: int
    replicas: int
    n_ctx: int
    flash_attn: bool  # both sides: Baton's `engine.flash_attn`, llama-server's `-fa`
    exact_reuse: bool = True
    mmproj: str | None = None  # both sides: the image projector

    def baton(self, model: Path) -> BatonConfig:
        """Baton as `baton serve` lays it out on `threads` cores (`share_cpus`)."""
        config = BatonConfig(
            model=str(model),
            mmproj=self.mmproj,
            replicas=self.replicas,
            engine=EngineConfig(
                n_ctx=self.n_ctx,
                n_slots=max(1, self.slots // self.replicas),
                exact_reuse=self.exact_reuse,
                flash_attn=self.flash_attn,
            ),
            index="embedded",
            hmac_key=secrets.token_hex(16),
        )
        return share_cpus(config, self.threads)


def deployed_engine(config: BatonConfig) -> dict:
    """The engine settings each replica of `config` runs with (for the report)."""
    engine = config.engine.model_copy(update={"n_threads": engine_threads(config)})
    return engine.model_dump(include=ENGINE_REPORTED)


def _baton(
    model: Path, setup: Setup, env: dict[str, str]
) -> AbstractContextManager[tuple[str, str]]:
    """A fresh local Ray (its workers see `env`) with Baton deployed; yields URL and name."""
    return on_local_ray(setup.baton(model), APP, env)


def _run_baton(
    model: Path, setup: Setup, sessions: list[Session], workload: PeerWorkload, recorded: Callable
) -> tuple[list[PeerRecord], float]:
    with _baton(model, setup, {}) as (url, name):
        return asyncio.run(_play(url, name, BATON, sessions, workload, recorded))


def _traced_baton(
    model: Path, setup: Setup, sessions: list[Session], workload: PeerWorkload, recorded: Callable
) -> list[PeerRecord]:
    """Baton once more with tracing on: each record gets its `parts`."""
    with SpanReceiver().running() as receiver, _baton(model, setup, receiver.env) as (url, name):
        records, _ = asyncio.run(_play(url, name, TRACED, sessions, workload, recorded))
        asyncio.run(wait_idle(APP))
        receiver.wait_for([r.trace_id for r in records])
        for r in records:
            if r.ttft_s is not None and not r.error:
                first_token_ns = r.sent_ns + int(r.ttft_s * 1e9)
                spans = receiver.spans(r.trace_id)
                r.parts = request_parts(spans, r.sent_ns, first_token_ns, r.completion_tokens)
    return records


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


def peer_benchmark(
    model_path: Path,
    *,
    workload: PeerWorkload = PeerWorkload(),
    threads: int | None = None,
    slots: int | None = None,
    replicas: int | None = None,
    exact_reuse: bool = True,
    flash_attn: bool = False,
    mmproj: Path | None = None,
    traced: bool = True,
    progress: Progress = SILENT,
) -> tuple[dict, list[PeerRecord]]:
    """Run `workload` against llama-server, then Baton (and Baton traced, unless not
    `traced`). Threads default to the CPU count, slots to the concurrency, replicas to
    `baton serve`'s default; Baton's engines replay replies unless not `exact_reuse`; both
    sides compute attention with flash attention only if `flash_attn`, and read images with
    `mmproj` (which a workload with `image_px` needs). Returns the summary and every request."""
    if workload.image_px and mmproj is None:
        raise ValueError("a workload with images (image_px) needs the model's projector (mmproj)")
    setup = Setup(
        threads=threads or usable_cpus(),  # what `baton serve` shares out
        slots=slots or workload.concurrency,
        replicas=replicas or BatonConfig.model_fields["replicas"].default,
        n_ctx=workload.n_ctx(),
        exact_reuse=exact_reuse,
        flash_attn=flash_attn,
        mmproj=str(mmproj) if mmproj else None,
    )
    model = LlamaModel(model_path, vocab_only=True)
    try:
        sessions = make_sessions(workload, model)
    finally:
        model.close()
    n = workload.requests()
    runs = 3 if traced else 2
    progress.start(runs * n)

    def step(name: str, index: int) -> Callable[[int], None]:
        return lambda k: progress.step(f"{name}: request {k}/{n}", done=index * n + k)

    progress.step(f"llama-server: -t {setup.threads} -np {setup.slots} (building it if needed)")
    settings = ServerSettings(setup.threads, setup.slots, setup.n_ctx, setup.flash_attn, mmproj)
    with llama_server(model_path, settings) as url:
        peer_rows, peer_wall = asyncio.run(
            _play(url, model_path.stem, LLAMA_SERVER, sessions, workload, step(LLAMA_SERVER, 0))
        )
    progress.step(f"baton: deploying {setup.replicas} replicas")
    baton_rows, baton_wall = _run_baton(model_path, setup, sessions, workload, step(BATON, 1))
    records = peer_rows + baton_rows
    result = {
        "model": str(model_path),
        "workload": asdict(workload),
        "script": script_digest(sessions),
        "setup": asdict(setup),
        "engine": deployed_engine(setup.baton(model_path)),
        LLAMA_SERVER: summarize(peer_rows, peer_wall),
        BATON: summarize(baton_rows, baton_wall),
    }
    result["rows"] = compare(result[BATON], result[LLAMA_SERVER])
    if traced:
        progress.step("baton traced: deploying again with tracing on, for the breakdown")
        traced_rows = _traced_baton(model_path, setup, sessions, workload, step("traced", 2))
        parts = [r.parts for r in traced_rows if r.parts]
        result["breakdown"] = {"requests": len(parts), "p50_s": breakdown(parts)}
        records += traced_rows
    return result, records
