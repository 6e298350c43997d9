"""Wire format of a serialized llama.cpp sequence state.

A blob is a fixed little-endian header followed by the payload::

    magic 8s | version H | flags H | fingerprint 32s | n_tokens I | prefix_hash 16s
    | state_len Q | checksum 32s | hmac 32s

The payload is the prefix tokens as little-endian int32 followed by ``state_len`` bytes
of llama.cpp state. ``checksum`` is the SHA-256 of the payload and ``hmac`` is
HMAC-SHA256 over the header up to the hmac field, so the HMAC authenticates the whole
blob while only hashing the header.

`decode_blob` is a safety boundary: a truncated or forged state handed to llama.cpp
can crash the process, so every field is checked before anything is returned.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from baton_serve.cache_store.prefix_hash import HASH_BYTES, TOKEN_DTYPE, PrefixHasher, token_array

MAGIC = b"BATONSB1"
FORMAT_VERSION = 1
FINGERPRINT_BYTES = 32

_SIGNED = struct.Struct("<8sHH32sI16sQ32s")  # every header field but the hmac
_MAC_BYTES = 32
HEADER_SIZE = _SIGNED.size + _MAC_BYTES

Buffer = bytes | bytearray | memoryview | np.ndarray


class BlobError(ValueError):
    """A blob failed validation; `.reason` is a short machine-readable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, eq=False)
class StateBlob:
    """A validated blob: zero-copy views into the buffer it was decoded from."""

    fingerprint: bytes
    prefix_hash: bytes
    tokens: np.ndarray
    state: memoryview

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def _check_key(key: bytes) -> None:
    if not key:
        raise BlobError("no_key", "an empty HMAC key was given; state blobs must be signed")


def _check_size(name: str, value: bytes, size: int) -> None:
    if not isinstance(value, bytes) or len(value) != size:
        raise ValueError(f"{name} must be exactly {size} bytes")


def _mac(key: bytes, signed_header: bytes | memoryview) -> bytes:
    return hmac.new(key, signed_header, hashlib.sha256).digest()


def encode_blob(
    *,
    fingerprint: bytes,
    prefix_hash: bytes,
    tokens: Sequence[int] | np.ndarray,
    state: bytes | bytearray | memoryview,
    key: bytes,
) -> bytes:
    """Serialize and sign a sequence state."""
    _check_key(key)
    _check_size("fingerprint", fingerprint, FINGERPRINT_BYTES)
    _check_size("prefix_hash", prefix_hash, HASH_BYTES)
    token_ids = token_array(tokens)
    if len(token_ids) == 0:
        raise ValueError("a state blob needs at least one token")
    if token_ids.min() < 0:
        raise ValueError("token ids must be non-negative")
    state_view = memoryview(state).cast("B")
    checksum = hashlib.sha256(token_ids.data)
    checksum.update(state_view)
    signed = _SIGNED.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        fingerprint,
        len(token_ids),
        prefix_hash,
        len(state_view),
        checksum.digest(),
    )
    return b"".join((signed, _mac(key, signed), token_ids.data, state_view))


def decode_blob(
    data: Buffer,
    *,
    key: bytes,
    fingerprint: bytes,
    max_state_bytes: int = 8 << 30,
    max_tokens: int = 1 << 22,
    hasher: PrefixHasher | None = None,
) -> StateBlob:
    """Validate a blob completely and return views into `data`; raise `BlobError` otherwise."""
    _check_key(key)
    _check_size("fingerprint", fingerprint, FINGERPRINT_BYTES)
    view = (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")
    if len(view) < HEADER_SIZE:
        raise BlobError(
            "too_short", f"blob is {len(view)} bytes, shorter than the {HEADER_SIZE}-byte header"
        )
    magic, version, flags, blob_fingerprint, n_tokens, prefix_hash, state_len, checksum = (
        _SIGNED.unpack_from(view)
    )
    if magic != MAGIC:
        raise BlobError("bad_magic", "not a Baton state blob (bad magic)")
    if version != FORMAT_VERSION:
        raise BlobError(
            "bad_version", f"unsupported blob version {version}, expected {FORMAT_VERSION}"
        )
    if flags:
        raise BlobError("bad_flags", f"unknown blob flags 0x{flags:04x}")
    if n_tokens > max_tokens:
        raise BlobError("too_large", f"blob claims {n_tokens} tokens, the limit is {max_tokens}")
    if state_len > max_state_bytes:
        raise BlobError(
            "too_large", f"blob claims {state_len} state bytes, the limit is {max_state_bytes}"
        )
    if n_tokens == 0:
        raise BlobError("bad_length", "blob holds no tokens")
    state_start = HEADER_SIZE + 4 * n_tokens
    expected = state_start + state_len
    if len(view) != expected:
        raise BlobError(
            "bad_length", f"blob is {len(view)} bytes but its header implies {expected}"
        )
    if blob_fingerprint != fingerprint:
        raise BlobError("wrong_model", "blob was made by a different model")
    mac = view[_SIGNED.size : HEADER_SIZE]
    if not hmac.compare_digest(_mac(key, view[: _SIGNED.size]), mac):
        raise BlobError("bad_hmac", "blob signature does not match (forged or other key)")
    if hashlib.sha256(view[HEADER_SIZE:]).digest() != checksum:
        raise BlobError("bad_checksum", "blob payload does not match its checksum")
    tokens = np.frombuffer(view, dtype=TOKEN_DTYPE, count=n_tokens, offset=HEADER_SIZE)
    tokens.flags.writeable = False
    if tokens.min() < 0:
        raise BlobError("bad_tokens", "blob holds negative token ids")
    if hasher is not None and hasher.prefix_hash(tokens) != prefix_hash:
        raise BlobError("bad_prefix_hash", "blob prefix hash does not match its tokens")
    return StateBlob(
        fingerprint=blob_fingerprint,
        prefix_hash=prefix_hash,
        tokens=tokens,
        state=view[state_start:],
    )
