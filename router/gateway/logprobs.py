"""Log-probabilities in OpenAI's two shapes: chat (`content` entries with bytes) and text
completions (parallel lists with text offsets)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from baton_serve.cache_store.wire.sampling_params import TokenLogprob
from baton_serve.router.gateway import openai_types as api

LOWEST_LOGPROB = -9999.0  # JSON has no -inf; vLLM reports this floor too


class LogprobFormat:
    """Turns the engine's per-token log-probabilities into API objects, naming tokens by
    their text in the served vocabulary."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes

    def chat(self, entries: Sequence[TokenLogprob]) -> api.ChatLogprobs:
        return api.ChatLogprobs(
            content=[
                api.TokenLogprob(
                    **self._top(entry.token, entry.logprob).model_dump(),
                    top_logprobs=[self._top(token, logprob) for token, logprob in entry.top],
                )
                for entry in entries
            ]
        )

    def completion(
        self, entries: Sequence[TokenLogprob], text_offset: int = 0
    ) -> api.CompletionLogprobs:
        """`text_offset`: where the first entry's token starts in the choice's text."""
        tokens, offsets = [], []
        for entry in entries:
            offsets.append(text_offset)
            tokens.append(self._text(entry.token))
            text_offset += len(tokens[-1])
        return api.CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[_finite(entry.logprob) for entry in entries],
            top_logprobs=[
                {self._text(token): _finite(logprob) for token, logprob in entry.top}
                for entry in entries
            ],
            text_offset=offsets,
        )

    def _top(self, token: int, logprob: float) -> api.TopLogprob:
        data = self._token_bytes(token)
        return api.TopLogprob(
            token=data.decode("utf-8", errors="replace"), logprob=_finite(logprob), bytes=list(data)
        )

    def _text(self, token: int) -> str:
        return self._token_bytes(token).decode("utf-8", errors="replace")


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)
