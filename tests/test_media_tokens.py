"""Images in a prompt's token ids (`cache_store/media_tokens.py`): placeholders that tell
images apart, spans never split, positions that follow M-RoPE's, and the piece planning
that feeds each image whole (`checkpoint_policy.prefill_pieces`, `step_plan.plan_step`)."""

from __future__ import annotations

import pytest

from baton_serve.cache_store.media_tokens import (
    MEDIA_TOKEN_BASE,
    is_media,
    media_spans,
    media_tokens,
    positions_after,
    span_floor,
)
from baton_serve.cache_store.prefix_hash import PrefixHasher, common_prefix_length
from baton_serve.replicas.engine.checkpoint_policy import prefill_pieces
from baton_serve.replicas.engine.step_plan import RunView, StepView, plan_step

RED, BLUE = b"r" * 32, b"b" * 32


def test_an_image_is_one_placeholder_per_embedding_past_any_vocabulary() -> None:
    ids = media_tokens(RED, 12, 4)
    assert len(ids) == 12 and all(is_media(t) and t < 2**31 for t in ids)
    assert ids == media_tokens(RED, 12, 4)  # the same image, the same ids
    assert not set(ids) & set(media_tokens(BLUE, 12, 4))  # every id tells them apart
    with pytest.raises(ValueError):
        media_tokens(RED, 4, 5)


def test_two_images_with_the_same_text_have_different_hash_chains() -> None:
    hasher = PrefixHasher(b"model", block_tokens=8)
    text = list(range(10))
    red = text + list(media_tokens(RED, 16, 16)) + text
    blue = text + list(media_tokens(BLUE, 16, 16)) + text
    assert hasher.chain(red)[0] == hasher.chain(blue)[0]  # the first block is text only
    assert hasher.chain(red)[1:] != hasher.chain(blue)[1:]


def test_spans_and_positions_are_read_from_the_ids_alone() -> None:
    image = media_tokens(RED, 9, 3)  # a 3x3 grid under M-RoPE: 9 embeddings, 3 positions
    tokens = [1, 2, *image, 5, *media_tokens(BLUE, 4, 4), 6]
    assert media_spans(tokens) == [(2, 11), (12, 16)]
    assert positions_after(tokens) == 2 + 3 + 1 + 4 + 1
    assert positions_after(tokens[:5]) == 2 + 3  # a short list counts the same way
    assert positions_after(list(range(40))) == 40


def test_a_shared_prefix_never_ends_inside_an_image() -> None:
    red, blue = list(media_tokens(RED, 8, 8)), list(media_tokens(BLUE, 8, 8))
    forged = red[:3] + blue[3:]  # the first three placeholders collide
    a, b = [7, 7, *red, 9], [7, 7, *forged, 9]
    assert common_prefix_length(a, b) == 2
    assert span_floor(a, 5) == 2 and span_floor(a, 2) == 2 and span_floor(a, 10) == 10
    assert common_prefix_length(a, list(a)) == len(a)
    assert common_prefix_length(a, a, limit=6) == 2  # a limit inside the image


def test_each_image_is_a_piece_of_its_own_and_no_cut_falls_inside_it() -> None:
    spans = [(10, 74), (75, 80)]
    pieces = prefill_pieces(0, 100, [32, 50, 77, 90], 16, spans)
    assert 10 in pieces and 74 in pieces and 75 in pieces and 80 in pieces
    assert not any(10 < p < 74 or 75 < p < 80 for p in pieces)
    assert 90 in pieces  # a cut in the text after them stands
    assert pieces == sorted(pieces) and pieces[-1] == 100
    with pytest.raises(ValueError):
        prefill_pieces(20, 100, [], 16, spans)  # a start inside an image


def test_an_image_piece_is_planned_whole_or_not_at_all() -> None:
    def plan(done: int, first_run_left: int, step_tokens: int):
        image = RunView("image", 0, done=done, end=120, boundaries=(10, 74, 120), whole=(74,))
        other = RunView("text", 1, done=0, end=first_run_left, boundaries=(first_run_left,))
        view = StepView((), 0, (other, image), step_tokens, 32, True, 1e9, 0.0)
        return {p.key: (p.start, p.end) for p in plan_step(view).prefill}

    assert plan(10, 3, 100)["image"] == (10, 74)  # beyond max_piece, never cut
    assert "image" not in plan(10, 3, 40)  # no room beside another piece: it waits
    assert plan(10, 500, 40)["image"] == (10, 74)  # the step's first piece always goes
    assert MEDIA_TOKEN_BASE > 1 << 28
