"""What a simulated replica costs: its prefill and decode speeds, the link, state sizes (a
measured profile, `sim_bench.PROFILES`), and the step and pull times the simulator derives
from them with the engine's own timing functions."""

from __future__ import annotations

from dataclasses import dataclass

from baton_serve.cache_store.pull_cost import ShipCost
from baton_serve.replicas.engine.checkpoint_policy import MIN_PIECE
from baton_serve.replicas.engine.emulated_timing import decode_step_seconds, step_seconds
from baton_serve.replicas.engine.engine_config import EngineConfig as _Engine


@dataclass(frozen=True)
class Profile:
    """What a replica costs: prefill and decode speeds, the link, state sizes."""

    name: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float  # one stream decoding alone
    batch_decode_tokens_per_s: float  # all `slots` streams decoding at once, together
    slots: int
    link_bytes_per_s: float
    ship_latency_s: float  # per pull: the peer's export call, the index lookup
    restore_bytes_per_s: float
    bytes_per_token: int
    cache_bytes: int
    block_tokens: int = 64
    prefill_chunk: int = _Engine.model_fields["prefill_chunk"].default  # the engine's defaults
    step_tokens: int = _Engine.model_fields["step_tokens"].default
    step_noise: float = 0.0  # sigma of a mean-1 lognormal factor on each step's time (0: none)

    def decode_step_s(self, streams: int) -> float:
        """Seconds of one decode step for `streams` decoding slots (`decode_step_seconds`)."""
        return decode_step_seconds(
            streams, self.decode_tokens_per_s, self.batch_decode_tokens_per_s, self.slots
        )

    def step_s(self, streams: int, prompt_tokens: int) -> float:
        """One step: a token for each of `streams`, and `prompt_tokens` (`step_seconds`)."""
        return step_seconds(self.decode_step_s(streams), prompt_tokens, self.prefill_tokens_per_s)

    def prefill_speed(self, streams: int) -> float:
        """Prompt tokens per second while `streams` slots decode (their rows in every step,
        beside one piece): what an in-flight prefix's expected end is estimated with."""
        if not streams:
            return self.prefill_tokens_per_s
        tokens = max(min(self.prefill_chunk, self.step_tokens - streams), MIN_PIECE)
        return tokens / self.step_s(streams, tokens)


def ship_cost(profile: Profile) -> ShipCost:
    """What a pull costs a replica of `profile` (the rates a real replica measures): the
    link and the restore in one rate, since a state crosses both."""
    seconds_per_byte = 1 / profile.link_bytes_per_s + 1 / profile.restore_bytes_per_s
    return ShipCost(bandwidth_bytes_per_s=1 / seconds_per_byte, latency_s=profile.ship_latency_s)
