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
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path

from baton_serve.deploy.app import engine_threads
from baton_serve.deploy.config import BatonConfig
from baton_serve.deploy.cpu_layout import share_cpus, usable_cpus
from baton_serve.loadtests.llama_server import ServerSettings, llama_server
from baton_serve.loadtests.peer_play import (
    BATON,
    LLAMA_SERVER,
    PeerRecord,
    compare,
    play_server,
    summarize,
)
from baton_serve.loadtests.peer_workload import PeerWorkload, Session, make_sessions, script_digest
from baton_serve.loadtests.progress import SILENT, Progress
from baton_serve.loadtests.serve_app import on_local_ray, wait_idle
from baton_serve.loadtests.span_breakdown import (
    SpanReceiver,
    breakdown,
    request_parts,
)
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_model import LlamaModel

TRACED = "baton-traced"
APP = "peer"
ENGINE_REPORTED = {"n_ctx", "n_slots", "n_threads", "node_cores", "exact_reuse", "flash_attn"}


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
        return asyncio.run(play_server(url, name, BATON, sessions, workload, recorded))


def _traced_baton(
    model: Path, setup: Setup, sessions: list[Session], workload: PeerWorkload, recorded: Callable
) -> list[PeerRecord]:
    """Baton once more with tracing on: each record gets its `parts`."""
    with SpanReceiver().running() as receiver, _baton(model, setup, receiver.env) as (url, name):
        records, _ = asyncio.run(play_server(url, name, TRACED, sessions, workload, recorded))
        asyncio.run(wait_idle(APP))
        receiver.wait_for([r.trace_id for r in records])
        for r in records:
            if r.ttft_s is not None and not r.error:
                first_token_ns = r.sent_ns + int(r.ttft_s * 1e9)
                spans = receiver.spans(r.trace_id)
                r.parts = request_parts(spans, r.sent_ns, first_token_ns, r.completion_tokens)
    return records


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
            play_server(
                url, model_path.stem, LLAMA_SERVER, sessions, workload, step(LLAMA_SERVER, 0)
            )
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
