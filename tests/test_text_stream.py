"""Generated tokens → text deltas: incremental UTF-8 and stop strings that are never leaked."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from baton_serve.replicas.engine.text_stream import TextStream

EURO = "€".encode()  # 3 bytes
FACE = "😀".encode()  # 4 bytes

VOCAB: dict[int, bytes] = {
    0: b"Hel",
    1: b"lo",
    2: b" wor",
    3: b"ld",
    4: b"!",
    5: "é".encode()[:1],
    6: "é".encode()[1:],
    7: EURO[:2],
    8: EURO[2:],
    9: FACE[:1],
    10: FACE[1:3],
    11: FACE[3:],
    12: b"abcSTOPdef",
    13: b"ST",
    14: b"O",
    15: b"P",
    16: b" more",
    17: b"RY",
    18: b"x",
    19: b"a END b STOP c",
    20: b"",
}


def token_bytes(token: int) -> bytes:
    return VOCAB[token]


def run(tokens: Sequence[int], stop: Sequence[str] = ()) -> tuple[TextStream, list[str]]:
    """Push every token (until stopped), then flush; return the stream and its deltas."""
    stream = TextStream(token_bytes, stop)
    deltas = []
    for token in tokens:
        deltas.append(stream.push(token))
        if stream.stopped:
            break
    deltas.append(stream.flush())
    return stream, deltas


@pytest.mark.parametrize(
    ("tokens", "text"),
    [
        ([0, 1, 2, 3, 4], "Hello world!"),
        ([0, 1, 20, 4], "Hello!"),
        ([5, 6, 7, 8, 9, 10, 11], "é€😀"),
        ([12, 16], "abcSTOPdef more"),
        ([], ""),
    ],
)
def test_deltas_concatenate_to_full_text(tokens: list[int], text: str) -> None:
    """Without stop strings, the deltas add up to the decoded text."""
    stream, deltas = run(tokens)
    assert "".join(deltas) == text
    assert stream.text == text
    assert not stream.stopped


def test_ascii_tokens_are_emitted_at_once() -> None:
    """With no stop strings, each token's text is returned by its own push."""
    stream = TextStream(token_bytes)
    assert [stream.push(t) for t in [0, 1, 2, 3]] == ["Hel", "lo", " wor", "ld"]
    assert stream.flush() == ""


@pytest.mark.parametrize(
    ("tokens", "char"),
    [([5, 6], "é"), ([7, 8], "€"), ([9, 10, 11], "😀")],
)
def test_split_utf8_character_emitted_only_when_complete(tokens: list[int], char: str) -> None:
    """A character split over tokens appears only with its last byte, never as U+FFFD."""
    stream = TextStream(token_bytes)
    deltas = [stream.push(t) for t in tokens]
    assert deltas == [""] * (len(tokens) - 1) + [char]
    assert stream.text == char


def test_stop_string_inside_one_token() -> None:
    """A stop string inside a token cuts the text there and stops the stream."""
    stream = TextStream(token_bytes, ["STOP"])
    assert stream.push(0) == "Hel"
    assert stream.push(12) == "abc"
    assert stream.stopped
    assert stream.text == "Helabc"
    assert stream.flush() == ""


def test_stop_string_spanning_tokens_never_emitted() -> None:
    """'ST' + 'O' + 'P' is held back piece by piece, then dropped when the stop completes."""
    stream = TextStream(token_bytes, ["STOP"])
    assert stream.push(0) == "Hel"
    assert stream.push(1) == "lo"
    assert stream.push(13) == ""
    assert stream.push(14) == ""
    assert not stream.stopped
    assert stream.push(15) == ""
    assert stream.stopped
    assert stream.text == "Hello"
    assert stream.flush() == ""


def test_held_back_text_released_when_disambiguated() -> None:
    """'STO' followed by 'RY' is not the stop string: the held text comes out with the rest."""
    stream = TextStream(token_bytes, ["STOP"])
    assert stream.push(18) == "x"
    assert stream.push(13) == ""
    assert stream.push(14) == ""
    assert stream.push(17) == "STORY"
    assert not stream.stopped
    assert stream.text == "xSTORY"


def test_only_the_possible_stop_prefix_is_held_back() -> None:
    """Text before the possible start of a stop string is emitted immediately."""
    stream = TextStream(token_bytes, ["lo wo"])
    assert stream.push(0) == "He"  # "l" may start "lo wo"
    assert stream.push(1) == "l"  # now "lo" may: the first "l" cannot
    assert stream.push(3) == "lold"  # "lold" cannot
    assert stream.text == "Hellold"


def test_flush_releases_held_back_text() -> None:
    """At the end of generation, text held back for a possible stop string comes out."""
    stream = TextStream(token_bytes, ["STOP"])
    assert stream.push(0) == "Hel"
    assert stream.push(13) == ""
    assert stream.push(14) == ""
    assert stream.flush() == "STO"
    assert stream.text == "HelSTO"
    assert not stream.stopped


def test_flush_replaces_incomplete_character() -> None:
    """A character cut off at the end of generation becomes U+FFFD on flush."""
    stream = TextStream(token_bytes)
    assert stream.push(0) == "Hel"
    assert stream.push(9) == ""
    assert stream.flush() == "\ufffd"
    assert stream.text == "Hel\ufffd"


@pytest.mark.parametrize(
    ("stop", "text"),
    [
        (["world", "lo"], "Hel"),
        (["lo", "world"], "Hel"),
        (["!", "wor"], "Hello "),
        (["ld!", "o w"], "Hell"),
    ],
)
def test_earliest_stop_string_wins(stop: list[str], text: str) -> None:
    """With several stop strings, the text is cut at the earliest match, whatever the order."""
    stream, deltas = run([0, 1, 2, 3, 4], stop)
    assert stream.stopped
    assert stream.text == text
    assert "".join(deltas) == text


@pytest.mark.parametrize("stop", [("STOP", "END"), ("END", "STOP")])
def test_earliest_stop_in_one_token(stop: tuple[str, str]) -> None:
    """Two stop strings in one token: the earlier one cuts."""
    stream, deltas = run([19], stop)
    assert stream.stopped
    assert "".join(deltas) == stream.text == "a "


@pytest.mark.parametrize("stop", [[""], ["", ""], []])
def test_empty_stop_strings_ignored(stop: list[str]) -> None:
    """Empty stop strings neither stop the stream nor hold text back."""
    stream = TextStream(token_bytes, stop)
    assert [stream.push(t) for t in [0, 1, 13, 14]] == ["Hel", "lo", "ST", "O"]
    assert not stream.stopped


def test_empty_stop_string_beside_real_one() -> None:
    """An empty stop string next to a real one: only the real one counts."""
    stream, deltas = run([0, 1, 2, 3], ["", "wor"])
    assert stream.stopped
    assert "".join(deltas) == stream.text == "Hello "


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(1, min(len(s) - 1, len(text)) + 1):
            if s.startswith(text[-n:]):
                best = max(best, n)
    return best


def word(rng: random.Random, shortest: int, longest: int) -> str:
    return "".join(rng.choice("abST") for _ in range(rng.randint(shortest, longest)))


def test_random_streams_match_reference() -> None:
    """Random tokens and stop strings: after every push the emitted text is exactly the
    decoded text minus any possible stop-string start, or cut at the earliest stop."""
    rng = random.Random(0)
    for _ in range(400):
        pieces = [word(rng, 0, 3) for _ in range(8)]
        stops = [word(rng, 1, 4) for _ in range(rng.randint(1, 3))]
        stream = TextStream(lambda t, pieces=pieces: pieces[t].encode(), stops)
        decoded = emitted = ""
        for _ in range(12):
            token = rng.randrange(len(pieces))
            decoded += pieces[token]
            emitted += stream.push(token)
            hits = [i for i in (decoded.find(s) for s in stops) if i >= 0]
            if hits:
                assert stream.stopped
                assert emitted == stream.text == decoded[: min(hits)]
                break
            assert not stream.stopped
            assert stream.text == decoded
            assert emitted == decoded[: len(decoded) - _held_back(decoded, stops)]
        emitted += stream.flush()
        assert emitted == stream.text
