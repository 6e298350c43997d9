"""The emulated engine's timing: what one replica's compute costs, from a measured profile
(`bench sim`'s profiles, `loadtests/sim_bench.py`; `emulated_compute` spends it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


def decode_step_seconds(
    streams: int, decode_tokens_per_s: float, batch_decode_tokens_per_s: float, slots: int
) -> float:
    """Seconds of one decode step for `streams` decoding slots: linear between one stream
    alone and all `slots` together (a CPU's step grows with its batch, a GPU's hardly does).
    The simulator's replicas and the emulated engine both time their steps with it."""
    if not streams:  # a step of prompt pieces only
        return 0.0
    one = 1 / decode_tokens_per_s
    if slots == 1:
        return one
    full = slots / batch_decode_tokens_per_s
    return one + (streams - 1) * (full - one) / (slots - 1)


def step_seconds(decode_s: float, prompt_tokens: int, prefill_tokens_per_s: float) -> float:
    """Seconds of one engine step: its decode rows' (`decode_step_seconds`)
    plus its prompt tokens at the prefill pace. The two add, as on a CPU (a GPU overlaps
    them, by an amount not measured yet). The simulator's replicas and the emulated engine
    both use it."""
    return decode_s + prompt_tokens / prefill_tokens_per_s


class EmulatedTiming(BaseModel):
    """What one replica's compute costs: a profile of `bench sim`'s (its name labels the
    replica's device, `emulated:<name>`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, description="the profile's name")
    prefill_tokens_per_s: float = Field(gt=0, description="prompt tokens a second")
    decode_tokens_per_s: float = Field(gt=0, description="one stream decoding alone")
    batch_decode_tokens_per_s: float = Field(
        gt=0, description="`batch_slots` streams decoding together, all of them"
    )
    batch_slots: int = Field(ge=1, description="the batch the batch pace was measured at")
    state_bytes_per_token: int = Field(ge=0, description="the real state's size, for restores")
    restore_bytes_per_s: float = Field(gt=0, description="how fast a real state is restored")
    step_noise: float = Field(
        default=0.0, ge=0, description="sigma of a mean-1 lognormal factor on each step's time"
    )

    def decode_step_s(self, streams: int) -> float:
        """One decode step for `streams` sequences (`decode_step_seconds`)."""
        return decode_step_seconds(
            streams, self.decode_tokens_per_s, self.batch_decode_tokens_per_s, self.batch_slots
        )

    def step_s(self, streams: int, prompt_tokens: int) -> float:
        """One step: a token for each of `streams`, and `prompt_tokens` (`step_seconds`)."""
        return step_seconds(self.decode_step_s(streams), prompt_tokens, self.prefill_tokens_per_s)

    def restore_s(self, n_tokens: int) -> float:
        """Restoring a real `n_tokens`-token state."""
        return n_tokens * self.state_bytes_per_token / self.restore_bytes_per_s
