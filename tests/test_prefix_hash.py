import hashlib
import random
import struct

import numpy as np
import pytest

from baton_serve.cache_store.prefix_hash import HASH_BYTES, PrefixHasher

FINGERPRINT = b"model-a" * 4
BLOCK = 8


def reference_hash(fingerprint: bytes, tokens: list[int], n: int, block: int) -> bytes:
    """The definition, written out independently of the implementation."""

    def h(data: bytes) -> bytes:
        return hashlib.blake2b(data, digest_size=16).digest()

    if n == 0:
        return h(b"baton-prefix-v1" + fingerprint)
    k = block * ((n - 1) // block)
    encoded = struct.pack(f"<{n - k}i", *tokens[k:n])
    return h(reference_hash(fingerprint, tokens, k, block) + encoded)


@pytest.fixture
def hasher() -> PrefixHasher:
    return PrefixHasher(FINGERPRINT, block_tokens=BLOCK)


@pytest.fixture
def tokens() -> list[int]:
    rng = random.Random(1)
    return [rng.randrange(50_000) for _ in range(101)]


def test_matches_reference_definition(hasher: PrefixHasher, tokens: list[int]) -> None:
    for n in range(len(tokens) + 1):
        assert hasher.prefix_hash(tokens, n) == reference_hash(FINGERPRINT, tokens, n, BLOCK)


def test_seed_and_sizes(hasher: PrefixHasher, tokens: list[int]) -> None:
    assert hasher.seed == hashlib.blake2b(b"baton-prefix-v1" + FINGERPRINT, digest_size=16).digest()
    assert hasher.prefix_hash(tokens, 0) == hasher.seed
    assert hasher.prefix_hash([]) == hasher.seed
    assert all(len(h) == HASH_BYTES for h in hasher.chain(tokens))


def test_chain_equals_prefix_hash_at_block_ends(hasher: PrefixHasher, tokens: list[int]) -> None:
    chain = hasher.chain(tokens)
    assert len(chain) == len(tokens) // BLOCK
    for i, digest in enumerate(chain):
        assert digest == hasher.prefix_hash(tokens, (i + 1) * BLOCK)


def test_hashes_at_equals_prefix_hash(hasher: PrefixHasher, tokens: list[int]) -> None:
    rng = random.Random(2)
    positions = [rng.randrange(len(tokens) + 1) for _ in range(30)] + [0, len(tokens)]
    hashes = hasher.hashes_at(tokens, positions)
    assert set(hashes) == set(positions)
    for position in positions:
        assert hashes[position] == hasher.prefix_hash(tokens, position)


def test_accepts_list_tuple_and_arrays(hasher: PrefixHasher, tokens: list[int]) -> None:
    expected = hasher.prefix_hash(tokens)
    assert hasher.prefix_hash(tuple(tokens)) == expected
    assert hasher.prefix_hash(np.array(tokens, dtype=np.int32)) == expected
    assert hasher.prefix_hash(np.array(tokens, dtype=np.int64)) == expected
    assert hasher.prefix_hash(np.array(tokens, dtype=">i4")) == expected
    expected_5 = {5: hasher.prefix_hash(tokens, 5)}
    assert hasher.hashes_at(tokens, [np.int64(5)]) == expected_5  # type: ignore[list-item]


def test_different_fingerprints_differ(tokens: list[int]) -> None:
    a = PrefixHasher(b"model-a", BLOCK)
    b = PrefixHasher(b"model-b", BLOCK)
    for n in (0, 3, BLOCK, len(tokens)):
        assert a.prefix_hash(tokens, n) != b.prefix_hash(tokens, n)


def test_block_size_matters(tokens: list[int]) -> None:
    a = PrefixHasher(FINGERPRINT, 4)
    b = PrefixHasher(FINGERPRINT, 8)
    assert a.prefix_hash(tokens, 16) != b.prefix_hash(tokens, 16)


def test_only_tokens_before_n_matter(hasher: PrefixHasher, tokens: list[int]) -> None:
    n = 3 * BLOCK + 5
    before = hasher.prefix_hash(tokens, n)
    for i in range(len(tokens)):
        changed = list(tokens)
        changed[i] += 1
        if i < n:
            assert hasher.prefix_hash(changed, n) != before, i
        else:
            assert hasher.prefix_hash(changed, n) == before, i


def test_deterministic(tokens: list[int]) -> None:
    first = PrefixHasher(FINGERPRINT, BLOCK)
    second = PrefixHasher(FINGERPRINT, BLOCK)
    assert first.chain(tokens) == second.chain(tokens) == first.chain(tokens)
    assert first.prefix_hash(tokens, 37) == second.prefix_hash(tokens, 37)


def test_prefix_property(hasher: PrefixHasher, tokens: list[int]) -> None:
    for n in range(len(tokens) + 1):
        assert hasher.prefix_hash(tokens[:n]) == hasher.prefix_hash(tokens, n)
        assert hasher.chain(tokens[:n]) == hasher.chain(tokens)[: n // BLOCK]


def test_a_known_chain_gives_the_same_hashes(hasher: PrefixHasher, tokens: list[int]) -> None:
    """A prompt's chain (the gateway's) stands for the blocks it covers, whether it is
    shorter than the tokens (a reply continues the prompt) or longer (a prefix of it)."""
    positions = range(len(tokens) + 1)
    expected = hasher.hashes_at(tokens, positions)
    for cut in (0, 1, 3, 7, 60, len(tokens)):
        known = hasher.chain(tokens[:cut])
        assert hasher.hashes_at(tokens, positions, known) == expected
        assert hasher.chain(tokens, known) == hasher.chain(tokens)
        for n in (0, 5, 8, 9, 40, 57, len(tokens)):
            assert hasher.prefix_hash(tokens, n, known) == expected[n]
            assert hasher.chain(tokens[:n], known) == hasher.chain(tokens[:n])
    wrong = [b"\0" * HASH_BYTES] * 3
    assert hasher.prefix_hash(tokens, 20, wrong) != expected[20]  # trusted, not checked


def test_no_collisions_between_partial_and_full_blocks() -> None:
    rng = random.Random(3)
    hasher = PrefixHasher(FINGERPRINT, 4)
    seen: dict[bytes, tuple[int, ...]] = {}
    for _ in range(20):
        tokens = [rng.randrange(8) for _ in range(40)]  # small vocabulary: many shared tails
        for n, digest in hasher.hashes_at(tokens, range(1, 41)).items():
            prefix = tuple(tokens[:n])
            assert seen.setdefault(digest, prefix) == prefix  # equal hashes only for equal prefixes


@pytest.mark.parametrize(
    ("fingerprint", "block_tokens"),
    [(b"", 4), ("text", 4), (None, 4), (FINGERPRINT, 0), (FINGERPRINT, -1), (FINGERPRINT, 2.0)],
)
def test_bad_constructor_args(fingerprint: object, block_tokens: object) -> None:
    with pytest.raises(ValueError):
        PrefixHasher(fingerprint, block_tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [-1, 102, 10**9, 2.5])
def test_bad_positions(hasher: PrefixHasher, tokens: list[int], n: object) -> None:
    with pytest.raises(ValueError, match="position"):
        hasher.prefix_hash(tokens, n)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="position"):
        hasher.hashes_at(tokens, [0, n])  # type: ignore[list-item]


@pytest.mark.parametrize(
    "bad_tokens",
    [[1.5, 2.0], [[1, 2], [3, 4]], [2**31], [-(2**31) - 1], np.array([2**40]), ["a"]],
)
def test_bad_tokens(hasher: PrefixHasher, bad_tokens: object) -> None:
    with pytest.raises(ValueError):
        hasher.prefix_hash(bad_tokens)  # type: ignore[arg-type]
