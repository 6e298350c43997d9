"""The gateway's memory of texts it has tokenised: a conversation sends its earlier messages
again every turn, and a chat prompt is tokenised message by message (`tokenize_chat`), so
each turn needs only its new messages tokenised."""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict

from baton_serve.replicas.engine.prompt import Tokenizer

MAX_CHARS = 4_000_000  # about 1M tokens; ~4 MB of token ids and 4-16 MB of text held
MIN_CHARS = 32  # shorter texts (role markers, template glue) cost less to tokenise than to look up


class TokenCache:
    """`tokenizer`, remembering its least recently used results within `max_chars` of text.
    Safe to share between the gateway's prompt threads; errors are not remembered."""

    def __init__(self, tokenizer: Tokenizer, max_chars: int = MAX_CHARS) -> None:
        self._tokenizer = tokenizer
        self._max_chars = max_chars
        self._entries: OrderedDict[tuple[str, bool, bool], array] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def tokenize(
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        if len(text) < MIN_CHARS or len(text) > self._max_chars // 8:
            return self._tokenizer.tokenize(
                text, add_special=add_special, parse_special=parse_special
            )
        key = (text, add_special, parse_special)
        with self._lock:
            held = self._entries.get(key)
            if held is not None:
                self._entries.move_to_end(key)
                return held.tolist()
        tokens = self._tokenizer.tokenize(
            text, add_special=add_special, parse_special=parse_special
        )
        with self._lock:
            if key not in self._entries:
                self._entries[key] = array("i", tokens)
                self._chars += len(text)
                while self._chars > self._max_chars:
                    (old, _, _), _ = self._entries.popitem(last=False)
                    self._chars -= len(old)
        return tokens

    def token_text(self, token: int) -> str:
        return self._tokenizer.token_text(token)

    @property
    def held_chars(self) -> int:
        """Characters of text remembered now."""
        return self._chars
