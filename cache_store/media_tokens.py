"""Media (an image) in a prompt's token ids: one placeholder id per embedding it becomes.

The ids lie at or above `MEDIA_TOKEN_BASE`, past any vocabulary, so no text token is ever
one. Each carries 28 bits of a stream drawn from the media's content digest, so a prompt's
ids — and with them its block hash chain, its checkpoints, the cluster index, routing and
pulls — tell two images apart exactly as they tell two texts apart: the same image in a
later turn matches, a different image with the same text never does.

Two flags make a span's layout readable from its ids alone:
- **start**: the span's first id. A prefix shared with another prompt never ends inside a
  span (`span_floor`): an image is computed whole or not at all.
- **advances**: the id moves the sequence's position on. An image takes fewer positions
  than embeddings under M-RoPE (the Qwen-VL line: `max(width, height)` of its grid); the
  first `n_pos` ids of its span advance. A sequence's llama.cpp position after some ids is
  then a function of the ids (`positions_after`), so a stored state carries no extra layout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

MEDIA_TOKEN_BASE = 1 << 30  # ≥ it: a media placeholder (vocabularies are far smaller)
_START = 1 << 29
_ADVANCES = 1 << 28
_CONTENT_BITS = _ADVANCES - 1  # the low 28 bits: the content stream


def media_tokens(digest: bytes, n_tokens: int, n_pos: int) -> tuple[int, ...]:
    """The placeholder ids of a media item whose content digest is `digest`, computed as
    `n_tokens` embeddings taking `n_pos` positions."""
    if not 0 < n_pos <= n_tokens:
        raise ValueError(f"a media item takes 1 to {n_tokens} positions, not {n_pos}")
    stream = hashlib.shake_256(b"baton-media-v1" + digest).digest(4 * n_tokens)
    content = np.frombuffer(stream, dtype="<u4") & _CONTENT_BITS
    flags = np.where(np.arange(n_tokens) < n_pos, _ADVANCES, 0)
    flags[0] |= _START
    return tuple(int(t) for t in MEDIA_TOKEN_BASE | flags | content)


def is_media(token: int) -> bool:
    return token >= MEDIA_TOKEN_BASE


def span_floor(tokens: Sequence[int], n: int) -> int:
    """`n`, or where the media span it falls inside starts: the most of `tokens[:n]` that can
    be kept without splitting an image (`tokens[n]` continues a span begun before it)."""
    while 0 < n < len(tokens) and tokens[n] >= MEDIA_TOKEN_BASE and not tokens[n] & _START:
        n -= 1
    return n


def media_spans(tokens: Sequence[int]) -> list[tuple[int, int]]:
    """The `[start, end)` of each media span in `tokens`, in order."""
    arr = np.asarray(tokens, dtype=np.int64)
    media = arr >= MEDIA_TOKEN_BASE
    if not media.any():
        return []
    starts = np.flatnonzero(media & ((arr & _START) != 0))
    spans = []
    for start in starts.tolist():
        end = start + 1
        while end < len(arr) and media[end] and not arr[end] & _START:
            end += 1
        spans.append((start, end))
    return spans


def positions_after(tokens: Sequence[int]) -> int:
    """The llama.cpp position that follows `tokens`: one for each text id, one for each
    media id that advances."""
    if len(tokens) < 32 and not isinstance(tokens, np.ndarray):  # a decode step's one token
        return sum(1 for t in tokens if t < MEDIA_TOKEN_BASE or t & _ADVANCES)
    arr = np.asarray(tokens, dtype=np.int64)
    return int(np.count_nonzero((arr < MEDIA_TOKEN_BASE) | ((arr & _ADVANCES) != 0)))
