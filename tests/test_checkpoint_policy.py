"""Prefill pieces (never one token, bounded size, cuts kept) and checkpoint positions."""

from __future__ import annotations

import random

import pytest

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.replicas.engine.checkpoint_policy import (
    MIN_PIECE,
    prefill_checkpoints,
    prefill_pieces,
    worth_saving,
)


def chat(n_tokens: int, starts: list[int], roles: list[str]) -> Prompt:
    return Prompt(
        tokens=tuple(range(n_tokens)), message_starts=tuple(starts), message_roles=tuple(roles)
    )


# ---------------------------------------------------------------- prefill_pieces


def test_min_piece_is_two() -> None:
    """The rule the module enforces: no one-token pieces."""
    assert MIN_PIECE == 2


def test_prefill_pieces_properties() -> None:
    """Random cases: contiguous pieces ending at `end`, each of 2..max_piece tokens,
    and every cut with room on both sides (and no cut just before it) is a boundary."""
    rng = random.Random(0)
    for _ in range(5000):
        start = rng.randint(0, 300)
        end = start + rng.choice([0, 1, 2, 3, rng.randint(0, 40), rng.randint(0, 2000)])
        max_piece = rng.randint(4, 600)
        cuts = [rng.randint(start - 5, end + 5) for _ in range(rng.randint(0, 12))]
        cuts += [c + 1 for c in cuts[: rng.randint(0, 3)]]  # some adjacent cuts
        ends = prefill_pieces(start, end, cuts, max_piece)
        if end == start:
            assert ends == []
            continue
        assert ends[-1] == end
        sizes = [b - a for a, b in zip([start] + ends, ends)]
        assert all(size > 0 for size in sizes)  # contiguous, ascending, covering [start, end)
        assert all(size <= max_piece for size in sizes)
        if end - start >= MIN_PIECE:
            assert all(size >= MIN_PIECE for size in sizes)
        for cut in cuts:
            if cut - start >= MIN_PIECE and end - cut >= MIN_PIECE and cut - 1 not in cuts:
                assert cut in ends, (start, end, cuts, max_piece, ends)


@pytest.mark.parametrize(
    ("start", "end", "cuts", "max_piece", "expected"),
    [
        (0, 10, [], 100, [10]),
        (0, 10, [4], 100, [4, 10]),
        (0, 10, [1], 100, [10]),  # would leave a one-token first piece
        (0, 10, [9], 100, [10]),  # would leave a one-token last piece
        (0, 10, [0, 10, -3, 12], 100, [10]),  # on or outside the range
        (0, 10, [4, 5, 6], 100, [4, 6, 10]),  # 5 is one token after the kept 4
        (0, 10, [6, 4, 4], 100, [4, 6, 10]),  # unsorted, duplicated
        (5, 15, [7, 12], 100, [7, 12, 15]),
        (0, 10, [], 4, [3, 6, 10]),  # near-equal pieces, none over 4
        (0, 5, [], 4, [2, 5]),
        (0, 1, [], 4, [1]),  # a single token is the only way
        (3, 4, [3], 4, [4]),
        (7, 7, [7], 4, []),
    ],
)
def test_prefill_pieces_examples(
    start: int, end: int, cuts: list[int], max_piece: int, expected: list[int]
) -> None:
    """Hand-checked cases of cut keeping and splitting."""
    assert prefill_pieces(start, end, cuts, max_piece) == expected


@pytest.mark.parametrize("max_piece", [-1, 0, 1, 2, 3])
def test_prefill_pieces_rejects_small_max_piece(max_piece: int) -> None:
    """max_piece below 4 cannot guarantee two-token pieces: ValueError."""
    with pytest.raises(ValueError, match="max_piece"):
        prefill_pieces(0, 10, [], max_piece)


# ---------------------------------------------------------------- Prompt.last_user_start


@pytest.mark.parametrize(
    ("starts", "roles", "expected"),
    [
        ([], [], None),
        ([0], ["system"], None),
        ([0, 10], ["system", "user"], 10),
        ([0, 10, 20, 30], ["system", "user", "assistant", "user"], 30),
        ([0, 10, 20], ["user", "user", "assistant"], 10),
    ],
)
def test_last_user_start(starts: list[int], roles: list[str], expected: int | None) -> None:
    """The offset of the last message whose role is 'user', or None."""
    assert chat(40, starts, roles).last_user_start == expected


def test_prompt_len_is_token_count() -> None:
    """len(prompt) is its number of tokens."""
    assert len(Prompt(tokens=(4, 5, 6))) == 3


# ---------------------------------------------------------------- prefill_checkpoints


@pytest.mark.parametrize(
    ("cached", "interval", "max_interval", "expected"),
    [
        (0, 256, 8, [256, 400, 512, 700, 768, 998]),
        (256, 256, 8, [400, 512, 700, 768, 998]),
        (400, 256, 8, [512, 700, 768, 998]),
        (700, 256, 8, [768, 998]),
        (997, 256, 8, [998]),
        (998, 256, 8, []),
        (1000, 256, 8, []),
        (0, 0, 8, [400, 700, 998]),  # interval 0: no grid
        (0, 256, 0, [400, 700, 998]),  # max_interval 0: no grid
        (0, 100, 3, [300, 400, 600, 700, 900, 998]),  # 9 grid points thinned to 3
        (0, 1000, 8, [400, 700, 998]),  # the only multiple would be the end itself
    ],
)
def test_prefill_checkpoints_examples(
    cached: int, interval: int, max_interval: int, expected: list[int]
) -> None:
    """A 1000-token chat whose system prompt ends at 400 and last user message starts at 700."""
    prompt = chat(1000, [0, 400, 600, 700], ["system", "user", "assistant", "user"])
    got = prefill_checkpoints(prompt, cached=cached, interval=interval, max_interval=max_interval)
    assert got == expected


@pytest.mark.parametrize(
    ("n_tokens", "expected"),
    [(60, [16, 32, 48, 58]), (50, [16, 32, 48]), (3, [1]), (2, []), (1, [])],
)
def test_raw_prompt_has_no_user_checkpoint(n_tokens: int, expected: list[int]) -> None:
    """A raw text prompt: only the grid and the point two tokens before the end."""
    prompt = Prompt(tokens=tuple(range(n_tokens)))
    assert prefill_checkpoints(prompt, cached=0, interval=16, max_interval=8) == expected


def test_checkpoints_survive_as_piece_boundaries() -> None:
    """Checkpoints passed as cuts come back as prefill piece boundaries (none too close)."""
    prompt = chat(1000, [0, 400, 600, 700], ["system", "user", "assistant", "user"])
    checkpoints = prefill_checkpoints(prompt, cached=0, interval=100, max_interval=20)
    ends = prefill_pieces(0, len(prompt), checkpoints, max_piece=512)
    assert set(checkpoints) <= set(ends)


def test_prefill_checkpoints_properties() -> None:
    """Random prompts and cache states: the documented rules hold exactly."""
    rng = random.Random(0)
    for _ in range(3000):
        end = rng.randint(1, 5000)
        n_messages = rng.randint(0, 6)
        starts = sorted(rng.sample(range(end), min(n_messages, end)))
        roles = [rng.choice(["system", "user", "assistant", "tool"]) for _ in starts]
        prompt = chat(end, starts, roles)
        cached = rng.choice([0, rng.randint(0, end), end - 3, end - 2, end - 1, end])
        interval = rng.choice([0, 1, 7, 64, 256, rng.randint(1, 600)])
        max_interval = rng.choice([0, 1, 3, rng.randint(0, 40)])
        got = prefill_checkpoints(
            prompt, cached=cached, interval=interval, max_interval=max_interval
        )

        assert got == sorted(set(got))
        assert all(cached < p < end for p in got)
        retry = end - MIN_PIECE
        assert (retry in got) == (cached < retry)
        last_user, system_end = prompt.last_user_start, prompt.system_end
        for boundary in (last_user, system_end):
            if boundary is not None and cached < boundary < end:
                assert boundary in got
        special = {retry, last_user, system_end}
        grid = [p for p in got if p not in special]
        if not interval or not max_interval:
            assert grid == []
            continue
        assert all(p % interval == 0 and cached < p < end for p in grid)
        assert len(grid) <= max_interval
        multiples = [m for m in range(interval, end, interval) if m > cached]
        if len(multiples) <= max_interval:
            assert set(multiples) - special == set(grid)
        elif not special & set(multiples):
            assert len(grid) == max_interval
            steps = [(b - a) // interval for a, b in zip([multiples[0] - interval] + grid, grid)]
            assert max(steps) - min(steps) <= 1  # spread evenly over the grid


def test_a_slot_is_saved_when_that_is_faster_than_computing_its_tail_again() -> None:
    # SmolLM2 on this machine: 2,052 tokens in a 47 MB state, saved at ~1.1 GB/s (43 ms);
    # prefill at ~100 tok/s. A pulled 2,048-token state plus 4 tokens: 40 ms to recompute.
    assert not worth_saving(4, 47_300_000, 100.0, 1.1e9)
    assert worth_saving(24, 47_300_000, 100.0, 1.1e9)  # a reply: 240 ms to recompute
    assert not worth_saving(0, 47_300_000, 100.0, 1.1e9)  # stored already
    assert worth_saving(1, 0, 100.0, 1.1e9)  # a state size that is not known: kept
