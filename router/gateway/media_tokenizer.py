"""A chat's text with media markers (`media_parts`) as tokens: the text between markers
through the gateway's tokenizer, each marker as its image's or clip's tokens — the text its
projector puts around the item, then one placeholder per embedding
(`cache_store.media_tokens`)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from baton_serve.cache_store.wire.prompt_types import MediaInput
from baton_serve.replicas.engine.prompt import Tokenizer
from baton_serve.router.gateway.media_parts import MARKER_PREFIX

_MARKER = re.compile(re.escape(MARKER_PREFIX) + r"(\d+)__>")


class MediaTokenizer:
    """`tokenizer`, with each marker of `images[i]` read as `image_tokens[i]`; `used` lists
    the images in the order their markers were read (a template may drop or repeat one)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        images: Sequence[MediaInput],
        image_tokens: Sequence[Sequence[int]],
    ) -> None:
        self._tokenizer = tokenizer
        self._images = images
        self._image_tokens = image_tokens
        self.used: list[MediaInput] = []

    def tokenize(
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        tokens: list[int] = []
        at = 0
        for match in _MARKER.finditer(text):
            index = int(match.group(1))
            if index >= len(self._images):
                continue  # text, not one of this request's markers
            if match.start() > at:
                before = text[at : match.start()]
                tokens += self._text(before, add_special and not tokens, parse_special)
            tokens += self._image_tokens[index]
            self.used.append(self._images[index])
            at = match.end()
        if at < len(text) or not tokens:
            tokens += self._text(text[at:], add_special and not tokens, parse_special)
        return tokens

    def _text(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self._tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_text(self, token: int) -> str:
        return self._tokenizer.token_text(token)
