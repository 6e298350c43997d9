"""Engine settings (one replica, one model)."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineConfig(BaseModel):
    """How one engine runs its model: context, slots, batching, checkpoints."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_ctx: int = Field(default=4096, ge=64, description="context window per sequence, in tokens")
    n_slots: int = Field(default=4, ge=1, le=256, description="sequences decoded concurrently")
    n_batch: int = Field(default=512, ge=2, description="most tokens in one llama_decode")
    prefill_chunk: int = Field(
        default=256, ge=4, description="most prompt tokens of one sequence per decode step"
    )
    n_threads: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1)
    n_gpu_layers: int = Field(default=0, ge=-1, description="-1 offloads every layer")
    flash_attn: bool = Field(
        default=False,
        description="flash attention; off keeps CPU results independent of how a prompt is split",
    )
    prefix_cache: bool = Field(default=True, description="reuse cached prefixes at all")
    block_tokens: int = Field(default=64, ge=1, description="tokens per prefix-hash block")
    checkpoint_interval: int = Field(
        default=1024, ge=0, description="checkpoint every N tokens of long prefills (0: never)"
    )
    max_interval_checkpoints: int = Field(default=4, ge=0, description="per request")
    store_budget_bytes: int = Field(default=2 << 30, ge=0, description="local checkpoint store")

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
