"""How a request wants its tokens picked, and a picked token's log-probabilities."""

from __future__ import annotations

from pydantic import BaseModel, Field


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop; the OpenAI request fields map onto these."""

    model_config = {"frozen": True}

    max_tokens: int = Field(default=256, ge=0)
    temperature: float = Field(default=0.0, ge=0.0, le=10.0)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    # llama-server's samplers, with its defaults:
    typical_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_n_sigma: float = Field(default=-1.0)  # ≤ 0 disables it
    xtc_probability: float = Field(default=0.0, ge=0.0, le=1.0)
    xtc_threshold: float = Field(default=0.1, ge=0.0, le=1.0)  # > 0.5 disables XTC
    mirostat: int = Field(default=0, ge=0, le=2)  # 1, 2: instead of the truncating samplers
    mirostat_tau: float = Field(default=5.0, ge=0.0)
    mirostat_eta: float = Field(default=0.1, ge=0.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    grammar: str | None = None  # GBNF text, root rule `root`
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, description="no end before this many tokens")
    include_stop_str_in_output: bool = False  # the matched stop string ends the text
    skip_special_tokens: bool = False  # control tokens add nothing to the text
    logprobs: int | None = Field(default=None, ge=0, le=20)  # None: none; k: chosen + top k

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class TokenLogprob(BaseModel):
    """A generated token's log-probability, and the most likely alternatives at its step."""

    model_config = {"frozen": True}

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first
