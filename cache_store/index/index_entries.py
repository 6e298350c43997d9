"""Which index entries a prefix state is found under, and when one a prefill is computing
will be ready: one rule each for the replica that publishes it, the router that records
what it sent where, and the simulator."""

from __future__ import annotations

from collections.abc import Sequence


def index_entries(
    chain: Sequence[bytes], n_tokens: int, block_tokens: int, *, every_block: bool
) -> list[tuple[bytes, int]]:
    """(block hash, tokens) a state of a prompt's first `n_tokens` tokens is published
    under, given the prompt's chain of block hashes (at least `n_tokens // block_tokens`
    long). Lookups send block hashes: an attention state serves every prefix of itself (it
    is cut back), so with `every_block` each whole block it covers finds it; a hybrid or
    recurrent state serves only its exact length, under its last whole block. A state
    shorter than one block is not published."""
    blocks = n_tokens // block_tokens
    if not blocks:
        return []
    if len(chain) < blocks:
        raise ValueError(f"a chain of {len(chain)} blocks cannot place {n_tokens} tokens")
    last = (chain[blocks - 1], n_tokens)
    if not every_block:
        return [last]
    return [(h, (i + 1) * block_tokens) for i, h in enumerate(chain[: blocks - 1])] + [last]


def prefix_ready_at(
    end_at: float,
    prompt_end: int,
    position: int,
    prefill_tokens_per_s: float,
    *,
    computed_from: int = 0,
) -> float:
    """When a prefill that computes a prompt's tokens from `computed_from` to `prompt_end`
    and is due to end at `end_at` passes `position`: the end less the time of the tokens
    after it (a shared system prompt is ready long before its first prompt's end). Without
    a speed, the end."""
    if prefill_tokens_per_s <= 0:
        return end_at
    after = prompt_end - max(position, computed_from)
    return end_at - after / prefill_tokens_per_s
