"""Engine settings (one replica, one model)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from baton_serve.replicas.engine.emulated_timing import EmulatedTiming
from baton_serve.replicas.engine.grammar_nesting import DEFAULT_MAX_GRAMMAR_NESTING

logger = logging.getLogger("baton.engine")

MIN_N_CTX = 64


class EngineConfig(BaseModel):
    """How one engine runs its model: context, slots, batching, checkpoints."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_ctx: int = Field(
        default=4096,
        ge=0,
        description="context window per sequence, in tokens (each slot has its own KV stream); "
        "0: the model's training context; a larger value is clamped to it, with a warning",
    )
    n_slots: int = Field(default=4, ge=1, le=256, description="sequences decoded concurrently")
    n_batch: int = Field(default=512, ge=2, description="most tokens in one llama_decode")
    prefill_chunk: int = Field(
        default=256, ge=4, description="most prompt tokens of one prefill step (one sequence)"
    )
    step_tokens: int = Field(
        default=2048,
        ge=1,
        description="most tokens of one engine step: every decoding stream's next token plus "
        "prompt pieces up to this many in all (one piece always goes in). Smaller: a running "
        "stream's longest gap (one step) is shorter and a long prompt takes more steps; "
        "where a step is one llama_decode (exact_reuse off) it is also capped at n_batch. "
        "Replaces prefill_budget (read as this, with a warning, for one release)",
    )
    n_threads: int = Field(
        default_factory=lambda: os.cpu_count() or 1,
        ge=1,
        description="llama.cpp threads (Ray sets OMP_NUM_THREADS=1, so this is explicit); "
        "unset: in Baton's app one per Ray CPU the replica asks for (num_cpus_per_replica), "
        "an engine on its own (the benchmarks) the CPU count",
    )
    node_cores: int | None = Field(
        default=None,
        ge=1,
        description="cores this replica shares with the other replicas on its machine that set "
        "it: a prompt step computes on n_threads plus the threads of those that are idle, up "
        "to node_cores (a decode step on n_threads); unset: n_threads only (baton serve's local "
        "cluster of several replicas sets it to the cores it shares out)",
    )
    n_gpu_layers: int = Field(
        default=0, ge=-1, description="layers offloaded to the GPU (-1: every layer)"
    )
    cpu_repack: bool | None = Field(
        default=None,
        description="repack weights for the CPU's matrix kernels (llama.cpp's use_extra_bufts: "
        "AMX, interleaved AVX2/AVX-512 rows); unset: on where this machine's backend test "
        "showed it runs",
    )
    chat_template: str | None = Field(
        default=None,
        description="a Jinja chat template used instead of the GGUF's tokenizer.chat_template; "
        "a model with neither answers chat requests with a 400 naming both fixes, and "
        "completions keep working",
    )
    flash_attn: bool | None = Field(
        default=None,
        description="flash attention: on changes results with how a prompt is split; off keeps "
        "reuse bit-exact on CPU; unset: off where the model runs on the CPU, llama.cpp's auto "
        "(on where the device has the kernels) where its layers are offloaded",
    )
    prefix_cache: bool = Field(default=True, description="reuse cached prefixes at all")
    exact_reuse: bool | None = Field(
        default=None,
        description="after a reply is sent, recompute it as a prefill (a replay), so every "
        "cached state is what a from-scratch prefill computes and a resumed or shipped "
        "conversation gives the same logits as a cold one; false: keep the state the decode "
        "built, as llama-server and vLLM do (a next turn sent at once does not wait for the "
        "replay, each reply is computed once, and a step is one llama_decode), at the price of "
        "logits that differ slightly from a cold prefill's; unset: on where the model runs on "
        "the CPU, off where its layers are offloaded (a GPU's kernels change with a batch's "
        "row count, so a replay cannot make states exact there)",
    )
    emulated: EmulatedTiming | None = Field(
        default=None,
        description="emulate the compute (for measuring the system at scale): every step "
        "sleeps for what this profile says it costs and yields deterministic tokens; the rest "
        "of the engine, the cache, routing and shipping run for real; only the model's "
        "vocabulary is loaded; the device reads emulated:NAME; unset: llama.cpp computes",
    )
    block_tokens: int = Field(default=64, ge=1, description="tokens per prefix-hash block")
    checkpoint_interval: int = Field(
        default=1024,
        ge=0,
        description="hybrid and recurrent models: checkpoint every N tokens of a long prefill "
        "(0: never)",
    )
    max_interval_checkpoints: int = Field(
        default=4, ge=0, description="at most this many interval checkpoints per request"
    )
    slot_anchors: int = Field(
        default=8,
        ge=1,
        description="hybrid and recurrent models: partial states (no attention KV) a slot keeps "
        "at its prompts' checkpoints, to rewind to without copying attention KV; the lowest go "
        "first (a 2.15 MB recurrent state each for a 1.2B qwen35, 0.27 MB for qwen35-12x512)",
    )
    store_budget_bytes: int = Field(
        default=2 << 30,
        ge=0,
        description="bytes of the local checkpoint store (RAM, in Ray's object store when "
        "shipping); least recently used checkpoints are evicted (to disk with checkpoint_dir); "
        "the default is lowered to fit each node's object store, a chosen value that cannot "
        "fit is refused",
    )
    checkpoint_dir: str | None = Field(
        default=None,
        min_length=1,
        description="the disk tier: checkpoints evicted from RAM are kept in this directory (a "
        "node's NVMe) as signed files, and a restart with the same model and HMAC key adopts "
        "them; it must be this user's own directory, not a symbolic link, writable by nobody "
        "else (created with mode 0700 if missing; a start refuses any other); unset: RAM only",
    )
    disk_budget_bytes: int = Field(
        default=16 << 30,
        ge=0,
        description="bytes of checkpoint files per replica in checkpoint_dir; least recently "
        "used deleted first",
    )
    floor_tokens_per_s: float = Field(
        default=2.0,
        gt=0,
        allow_inf_nan=False,
        description="the slowest pace a working engine is assumed to keep for one request "
        "(prompt plus generated tokens per second): a request not done within max_queue_s "
        "plus its prompt and n × max_tokens at this pace is cancelled and answered 504 (a "
        "backstop against a stuck engine)",
    )
    max_queue_s: float = Field(
        default=600.0,
        gt=0,
        allow_inf_nan=False,
        description="the part of a request's deadline allowed for waiting for a slot",
    )
    max_grammar_nesting: int = Field(
        default=DEFAULT_MAX_GRAMMAR_NESTING,
        ge=1,
        description="deepest nesting of groups in a request's grammar; deeper is refused "
        "before llama.cpp parses it, by the gateway (a 400) and the replica. Its parser "
        "recurses once per group with no bound of its own, ~300-400 bytes of stack a level: "
        "3,000 levels crashed a thread with a 1 MiB stack, 30,000 a replica (8 MiB). The "
        "default is llama.cpp's own cap upstream (PR #26602)",
    )
    stall_timeout_s: float = Field(
        default=60.0,
        gt=0,
        allow_inf_nan=False,
        description="the engine is unhealthy (Serve replaces the replica) when it has work "
        "but has not completed a step for this long",
    )

    @model_validator(mode="before")
    @classmethod
    def _retired_keys(cls, data: object) -> object:
        if isinstance(data, dict) and "prefill_budget" in data:
            data = dict(data)
            budget = data.pop("prefill_budget")
            logger.warning(
                "engine.prefill_budget is retired: read as engine.step_tokens (%s); "
                "rename it, it will be refused in the next release",
                budget,
            )
            if isinstance(budget, int) and "step_tokens" not in data:
                data["step_tokens"] = max(1, budget)
        return data

    @property
    def one_call_steps(self) -> bool:
        """Whether a step's decode rows and prompt pieces go into one llama_decode. Exact
        reuse (also while unresolved: `for_device`) keeps them apart: llama.cpp would give a
        piece's first token a ubatch with the decode rows, and that lone row rounds
        differently from the piece's others."""
        return self.exact_reuse is False

    @property
    def step_budget(self) -> int:
        """Tokens of one step (`step_tokens`, within n_batch where the step is one call)."""
        return min(self.step_tokens, self.n_batch) if self.one_call_steps else self.step_tokens

    @field_validator("n_ctx")
    @classmethod
    def _n_ctx_floor(cls, value: int) -> int:
        if 0 < value < MIN_N_CTX:
            raise ValueError(f"must be 0 (the model's training context) or at least {MIN_N_CTX}")
        return value

    @field_validator("checkpoint_dir")
    @classmethod
    def _absolute_dir(cls, value: str | None) -> str | None:
        # Replicas run in other processes, from other working directories.
        return None if value is None else str(Path(value).expanduser().absolute())

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.n_slots > self.n_batch:
            raise ValueError(f"n_slots ({self.n_slots}) exceeds n_batch ({self.n_batch})")
        if self.prefill_chunk > self.n_batch:
            raise ValueError(
                f"prefill_chunk ({self.prefill_chunk}) exceeds n_batch ({self.n_batch})"
            )
        if self.checkpoint_interval % self.block_tokens:
            raise ValueError(
                f"checkpoint_interval ({self.checkpoint_interval}) must be a multiple of "
                f"block_tokens ({self.block_tokens}) so interval checkpoints sit on hash blocks"
            )
        return self


def for_device(config: EngineConfig, offloaded: bool) -> EngineConfig:
    """`config` with its unset device-dependent settings decided: on the CPU, exact reuse
    on and flash attention off (bit-exact states); with layers offloaded, exact reuse off
    (a device's kernels change with the batch, so no replay buys exact bits) and flash
    attention left to llama.cpp's auto (contiguous V rows and smaller compute buffers where
    the device has the kernels)."""
    decided: dict[str, bool] = {}
    if config.exact_reuse is None:
        decided["exact_reuse"] = not offloaded
    if config.flash_attn is None and not offloaded:
        decided["flash_attn"] = False
    return config.model_copy(update=decided) if decided else config


def context_size(requested: int, n_ctx_train: int) -> int:
    """The context window to run: `requested`, or the model's own where that is 0, never
    more than the model was trained for (llama.cpp reports 0 when it does not know)."""
    if requested == 0:
        return n_ctx_train or EngineConfig.model_fields["n_ctx"].default
    if n_ctx_train and requested > n_ctx_train:
        logger.warning(
            "n_ctx %d exceeds the model's training context %d: using %d",
            requested,
            n_ctx_train,
            n_ctx_train,
        )
        return n_ctx_train
    return requested
