"""Token sampling from a row of logits: greedy, temperature, top-k, top-p, min-p, seeded."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, Field


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop; the OpenAI request fields map onto these."""

    model_config = {"frozen": True}

    max_tokens: int = Field(default=256, ge=0)
    temperature: float = Field(default=0.0, ge=0.0, le=10.0)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class TokenSampler:
    """Samples one token per call; owns the random generator of one request."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.params.greedy:
            return int(np.argmax(logits))
        ids, probs = self._candidates(logits)
        return int(self._rng.choice(ids, p=probs))

    def _candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Token ids that survive top-k / top-p / min-p, with their renormalised probabilities."""
        p = self.params
        scaled = logits.astype(np.float64) / p.temperature
        if 0 < p.top_k < scaled.size:
            ids = np.argpartition(scaled, -p.top_k)[-p.top_k :]
        else:
            ids = np.arange(scaled.size)
        order = ids[np.argsort(scaled[ids])[::-1]]
        probs = np.exp(scaled[order] - scaled[order[0]])
        probs /= probs.sum()
        keep = probs.size
        if p.top_p < 1.0:
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
        probs = probs[:keep] / probs[:keep].sum()
        return order[:keep], probs
