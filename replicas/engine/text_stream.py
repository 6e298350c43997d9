"""Generated token ids → text deltas, holding back text that may become a stop string."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


class TextStream:
    """Incremental UTF-8 decoding of generated tokens, with stop-string detection.

    The text ends before the first stop string found, or after it with `keep_stop` (vLLM's
    `include_stop_str_in_output`); stop strings are looked for only once `min_tokens`
    tokens are pushed (as vLLM does)."""

    def __init__(
        self,
        token_bytes: Callable[[int], bytes],
        stop: Sequence[str] = (),
        *,
        keep_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._token_bytes = token_bytes
        self._keep_stop = keep_stop
        self._min_tokens = min_tokens
        self._pushed = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self.text = ""
        self._emitted = 0
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one token; return the text that is now safe to show (may be empty)."""
        self.text += self._decoder.decode(self._token_bytes(token))
        self._pushed += 1
        if not self._stop or self._pushed < self._min_tokens:
            return self._emit(len(self.text))
        # Text shown before min_tokens is never cut back: only what is not shown yet is searched.
        search_from = (
            self._emitted if self._min_tokens else max(0, self._emitted - self._longest_stop + 1)
        )
        found = (self.text.find(s, search_from) for s in self._stop)
        hits = [(i, i + len(s)) for i, s in zip(found, self._stop) if i >= 0]
        if hits:
            start, end = min(hits)
            self.text = self.text[: end if self._keep_stop else start]
            self.stopped = True
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self._held_back())

    def flush(self) -> str:
        """The rest of the text, at the end of generation."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        return self._emit(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest tail of the text that starts some stop string."""
        for n in range(min(self._longest_stop - 1, len(self.text) - self._emitted), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

    def _emit(self, end: int) -> str:
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta
