"""Where a sequence's prefill is cut into decode steps, and where its state is saved.

Two rules keep every cached state exactly what a from-scratch prefill computes:
prefill pieces are never a single token (llama.cpp computes a lone row with
matrix-vector kernels whose rounding differs from the matrix-matrix kernels of longer
pieces), and checkpoints sit only at piece boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence

from baton_serve.cache_store.wire.prompt_types import Prompt

MIN_PIECE = 2


def prefill_checkpoints(
    prompt: Prompt, *, cached: int, interval: int, max_interval: int
) -> list[int]:
    """Token positions, ascending, after which a hybrid/recurrent sequence's state is saved.

    - the end of the leading system messages (what other sessions share),
    - the start of the last user message (what an edited turn reuses),
    - two tokens before the end of the prompt: the longest prefix a retry of the same
      prompt can reuse (at least one piece of two tokens is always computed), and what
      the next turn falls back to when the reply itself cannot be reused,
    - every `interval` tokens of a long prefill, at most `max_interval` of them, spread
      evenly, on absolute multiples of `interval` so they line up with hash blocks.

    The end of generation is checkpointed separately, when the request finishes.
    """
    end = len(prompt)
    positions = {end - MIN_PIECE}
    positions.update(p for p in (prompt.system_end, prompt.last_user_start) if p is not None)
    positions.update(interval_checkpoints(cached, end, interval, max_interval))
    return sorted(p for p in positions if cached < p < end)


def interval_checkpoints(cached: int, end: int, interval: int, max_interval: int) -> list[int]:
    """Every `interval` tokens of a prefill from `cached` to `end`, at most `max_interval`
    of them, spread evenly, on absolute multiples of `interval` (they line up with hash
    blocks, so peers find them)."""
    if not interval or not max_interval:
        return []
    grid = list(range((cached // interval + 1) * interval, end, interval))
    if len(grid) > max_interval:
        grid = [grid[(i + 1) * len(grid) // max_interval - 1] for i in range(max_interval)]
    return grid


def prefill_pieces(
    start: int,
    end: int,
    cuts: list[int],
    max_piece: int,
    spans: Sequence[tuple[int, int]] = (),
) -> list[int]:
    """End positions of the pieces that prefill tokens [start, end).

    Every piece has at least two tokens (when there are two to compute) and at most
    `max_piece` (≥ 4). Each of `cuts` becomes a piece boundary unless that would leave a
    one-token piece; the caller checkpoints only at boundaries it gets back.

    Each media span (`media_tokens.media_spans`; none may straddle `start` or `end`) is a
    piece of its own, however long: an image is fed in one call, and the text between two
    spans may be one token (it is cut there whenever it is computed, so it rounds the same).
    """
    if max_piece < 2 * MIN_PIECE:
        raise ValueError(f"max_piece must be at least {2 * MIN_PIECE}")
    ends: list[int] = []
    previous = start
    for span_start, span_end in spans:
        if span_end <= start or span_start >= end:
            continue
        if span_start < start or span_end > end:
            raise ValueError(f"media span [{span_start}, {span_end}) straddles [{start}, {end})")
        ends += _text_pieces(previous, span_start, cuts, max_piece)
        ends.append(span_end)
        previous = span_end
    return ends + _text_pieces(previous, end, cuts, max_piece)


def _text_pieces(start: int, end: int, cuts: list[int], max_piece: int) -> list[int]:
    if end - start < MIN_PIECE:
        return [end] if end > start else []
    kept: list[int] = []
    previous = start
    for cut in sorted({c for c in cuts if start < c < end}):
        if cut - previous >= MIN_PIECE and end - cut >= MIN_PIECE:
            kept.append(cut)
            previous = cut
    ends: list[int] = []
    previous = start
    for boundary in kept + [end]:
        gap = boundary - previous
        n = -(-gap // max_piece)  # ceil: pieces of near-equal size, each ≥ 2 since max_piece ≥ 4
        ends.extend(previous + gap * (i + 1) // n for i in range(n))
        previous = boundary
    return ends


def worth_saving(
    extra_tokens: int, state_bytes: int, prefill_tokens_per_s: float, save_bytes_per_s: float
) -> bool:
    """Whether an attention slot about to be given away should be saved: it holds
    `extra_tokens` beyond the longest stored state it begins with, and saving its
    `state_bytes` (paid now, by the request taking the slot) takes less time than computing
    those tokens again would. A pulled state plus a request's few tokens is not worth a
    second copy. A `state_bytes` of 0 (not known: sliding windows) saves it."""
    if extra_tokens <= 0 or not state_bytes:
        return extra_tokens > 0
    return extra_tokens / prefill_tokens_per_s > state_bytes / save_bytes_per_s
