"""Deterministic filler text of a chosen length in tokens, for benchmarks and load tests."""

from __future__ import annotations

import random
from collections.abc import Callable

_WORDS = (
    "system request replica cache prefix state token model layer cluster router batch "
    "decode prefill stream latency memory budget shard index redis ray serve queue "
    "checkpoint restore ship transfer bytes hash chain block message user assistant tool "
    "agent loop plan step result error retry timeout health metric trace span window "
    "context length recurrent hybrid attention kernel thread worker node pod service"
).split()


def filler_text(
    n_tokens: int, count_tokens: Callable[[str], int], *, seed: int, topic: str = ""
) -> str:
    """Sentences of pseudo-random words whose tokenization is about `n_tokens` long."""
    rng = random.Random(seed)
    words: list[str] = [topic] if topic else []
    text = ""
    while True:
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 14)))
        words.append(sentence.capitalize() + ".")
        candidate = " ".join(words)
        if count_tokens(candidate) > n_tokens:
            return text or candidate
        text = candidate
