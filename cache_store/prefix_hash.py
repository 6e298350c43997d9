"""Hash chains over token prefixes.

``H = blake2b(digest_size=16)`` and tokens are encoded as little-endian int32.
``prefix_hash(0)`` is the seed ``H(b"baton-prefix-v1" + fingerprint)``; for ``n > 0``
with ``k = B * ((n - 1) // B)`` (the start of the block holding token ``n - 1``)::

    prefix_hash(n) = H(prefix_hash(k) || enc(tokens[k:n]))

So ``chain()[i] == prefix_hash((i + 1) * B)``, and a hash at any other position
(a chat message boundary, say) extends the last full block's chain hash.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Iterable, Sequence

import numpy as np

from baton_serve.cache_store.media_tokens import span_floor

HASH_BYTES = 16
DEFAULT_BLOCK_TOKENS = 64
TOKEN_DTYPE = np.dtype("<i4")

_SEED_DOMAIN = b"baton-prefix-v1"
_INT32 = np.iinfo(np.int32)


def token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Return `tokens` as a 1-D little-endian int32 array (no copy if it already is one)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=TOKEN_DTYPE)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.dtype != TOKEN_DTYPE and (arr.min() < _INT32.min or arr.max() > _INT32.max):
        raise ValueError("token ids must fit in a signed 32-bit integer")
    return np.ascontiguousarray(arr, dtype=TOKEN_DTYPE)


def _extend(digest: bytes, tokens: np.ndarray) -> bytes:
    h = hashlib.blake2b(digest, digest_size=HASH_BYTES)
    h.update(tokens.data)
    return h.digest()


class PrefixHasher:
    """Hash chain over token prefixes, seeded with a model fingerprint."""

    def __init__(self, fingerprint: bytes, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if not isinstance(fingerprint, bytes) or not fingerprint:
            raise ValueError("fingerprint must be non-empty bytes")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens must be a positive integer, got {block_tokens!r}")
        self.fingerprint = fingerprint
        self.block_tokens = block_tokens
        self.seed = hashlib.blake2b(_SEED_DOMAIN + fingerprint, digest_size=HASH_BYTES).digest()

    def chain(self, tokens: Sequence[int] | np.ndarray, known: Sequence[bytes] = ()) -> list[bytes]:
        """Return one hash per full block of `block_tokens` tokens.

        `known` (in every method): the chain of a token sequence that `tokens` begins, or
        that begins `tokens` (a prompt's, computed once by the gateway), trusted: the blocks
        it covers are not hashed again.
        """
        arr = token_array(tokens)
        size = self.block_tokens
        at = min(len(known), len(arr) // size)
        hashes = list(known[:at])
        digest = hashes[-1] if hashes else self.seed
        for start in range(at * size, len(arr) - size + 1, size):
            digest = _extend(digest, arr[start : start + size])
            hashes.append(digest)
        return hashes

    def prefix_hash(
        self, tokens: Sequence[int] | np.ndarray, n: int | None = None, known: Sequence[bytes] = ()
    ) -> bytes:
        """Return the hash of ``tokens[:n]`` (`n` defaults to ``len(tokens)``)."""
        arr = token_array(tokens)
        position = len(arr) if n is None else n
        return self.hashes_at(arr, [position], known)[position]

    def hashes_at(
        self,
        tokens: Sequence[int] | np.ndarray,
        positions: Iterable[int],
        known: Sequence[bytes] = (),
    ) -> dict[int, bytes]:
        """Return the prefix hash at each position, in one pass over the tokens."""
        arr = token_array(tokens)
        wanted = sorted({self._check_position(p, len(arr)) for p in positions})
        size = self.block_tokens
        hashes: dict[int, bytes] = {}
        digest, at = self.seed, 0  # `digest` is the chain hash of arr[:at]
        for position in wanted:
            if position == 0:
                hashes[0] = self.seed
                continue
            start = size * ((position - 1) // size)
            if (blocks := min(len(known), start // size)) * size > at:
                digest, at = known[blocks - 1], blocks * size
            while at < start:
                digest = _extend(digest, arr[at : at + size])
                at += size
            hashes[position] = _extend(digest, arr[start:position])
        return hashes

    @staticmethod
    def _check_position(position: int, n_tokens: int) -> int:
        try:
            index = operator.index(position)
        except TypeError:
            raise ValueError(f"position must be an integer, got {position!r}") from None
        if not 0 <= index <= n_tokens:
            raise ValueError(f"position {index} is out of range for {n_tokens} tokens")
        return index


def common_prefix_length(
    a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray, limit: int | None = None
) -> int:
    """How many leading tokens `a` and `b` share (at most `limit`), never ending inside a
    media span (an image is reused whole or not at all: `media_tokens.span_floor`)."""
    n = min(len(a), len(b), len(a) if limit is None else limit)
    if n <= 0:
        return 0
    mismatch = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return span_floor(a, int(mismatch[0]) if mismatch.size else n)
