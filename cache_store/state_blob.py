"""Wire format of a serialized llama.cpp sequence state.

A blob is a fixed little-endian header followed by the payload::

    magic 8s | version H | flags H | fingerprint 32s | n_tokens I | prefix_hash 16s
    | state_len Q | digest 32s | hmac 32s

The payload is the prefix tokens as little-endian int32 followed by ``state_len`` bytes
of llama.cpp state. ``digest`` is the BLAKE3-256 of the payload and ``hmac`` is
HMAC-SHA256 over the header up to the hmac field: digest-then-sign, so the payload is
hashed once on each side, the digest of a stored state can be kept and reused for every
export, and the HMAC itself only covers 104 bytes. Version 1 used SHA-256 for the digest
(three times slower here, and it was computed twice per transfer); it is refused.

A blob travels in two parts, the *head* (header and token ids, a few KB) and the state
itself, so that neither side copies the state to put a header in front of it:
`encode_parts` returns them, `decode_blob` takes them or one contiguous buffer.

`decode_blob` is a safety boundary: a truncated or forged state handed to llama.cpp
can crash the process, so every field is checked before anything is returned.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import numpy as np

from baton_serve.cache_store.prefix_hash import HASH_BYTES, TOKEN_DTYPE, PrefixHasher, token_array

MAGIC = b"BATONSB1"
FORMAT_VERSION = 2
FINGERPRINT_BYTES = 32

_SIGNED = struct.Struct("<8sHH32sI16sQ32s")  # every header field but the hmac
_MAC_BYTES = 32
HEADER_SIZE = _SIGNED.size + _MAC_BYTES
_RETIRED_VERSIONS = {1: "SHA-256 payload checksum"}

Buffer = bytes | bytearray | memoryview | np.ndarray
BlobParts = tuple[Buffer, Buffer]  # (head: header + token ids, state)


class BlobError(ValueError):
    """A blob failed validation; `.reason` is a short machine-readable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, eq=False)
class StateBlob:
    """A validated blob: zero-copy views into the buffer(s) it was decoded from."""

    fingerprint: bytes
    prefix_hash: bytes
    tokens: np.ndarray
    state: memoryview
    digest: bytes  # BLAKE3-256 of the payload, checked: an export of it can reuse it

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def byte_view(data: Buffer) -> memoryview:
    """A flat unsigned-byte view of `data`, without copying."""
    return (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")


def _part_view(data: object) -> memoryview:
    try:
        return byte_view(data)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise BlobError("bad_type", f"a blob is bytes, not {type(data).__name__}") from exc


ALL_CORES = blake3.blake3.AUTO


def payload_digest(tokens: Buffer, state: Buffer, *, threads: int = ALL_CORES) -> bytes:
    """BLAKE3-256 of a payload: little-endian int32 token ids, then the state; hashed on up
    to `threads` threads (BLAKE3 is a tree: a big state splits across every core)."""
    digest = blake3.blake3(byte_view(tokens), max_threads=threads)
    digest.update(byte_view(state))
    return digest.digest()


def _check_key(key: bytes) -> None:
    if not key:
        raise BlobError("no_key", "an empty HMAC key was given; state blobs must be signed")


def _check_size(name: str, value: bytes, size: int) -> None:
    if not isinstance(value, bytes) or len(value) != size:
        raise ValueError(f"{name} must be exactly {size} bytes")


def _mac(key: bytes, signed_header: bytes | memoryview) -> bytes:
    return hmac.new(key, signed_header, hashlib.sha256).digest()


def encode_parts(
    *,
    fingerprint: bytes,
    prefix_hash: bytes,
    tokens: Sequence[int] | np.ndarray,
    state: Buffer,
    key: bytes,
    digest: bytes | None = None,
) -> tuple[bytes, memoryview]:
    """Sign a sequence state: the blob's head, and `state` itself as a byte view (not copied).

    `digest` is the payload's BLAKE3-256 when the caller already knows it (a stored
    checkpoint's, kept from its first export); it is computed otherwise.
    """
    _check_key(key)
    _check_size("fingerprint", fingerprint, FINGERPRINT_BYTES)
    _check_size("prefix_hash", prefix_hash, HASH_BYTES)
    token_ids = token_array(tokens)
    if len(token_ids) == 0:
        raise ValueError("a state blob needs at least one token")
    if token_ids.min() < 0:
        raise ValueError("token ids must be non-negative")
    state_view = byte_view(state)
    if digest is None:
        digest = payload_digest(token_ids, state_view)
    _check_size("digest", digest, 32)
    signed = _SIGNED.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        fingerprint,
        len(token_ids),
        prefix_hash,
        len(state_view),
        digest,
    )
    return b"".join((signed, _mac(key, signed), token_ids.data)), state_view


def encode_blob(
    *,
    fingerprint: bytes,
    prefix_hash: bytes,
    tokens: Sequence[int] | np.ndarray,
    state: Buffer,
    key: bytes,
    digest: bytes | None = None,
) -> bytes:
    """One contiguous signed blob, head then state (a copy: for files and tests)."""
    head, state_view = encode_parts(
        fingerprint=fingerprint,
        prefix_hash=prefix_hash,
        tokens=tokens,
        state=state,
        key=key,
        digest=digest,
    )
    return b"".join((head, state_view))


def decode_blob(
    data: Buffer | BlobParts,
    *,
    key: bytes,
    fingerprint: bytes,
    max_state_bytes: int = 8 << 30,
    max_tokens: int = 1 << 22,
    hasher: PrefixHasher | None = None,
) -> StateBlob:
    """Validate a blob completely and return views into it; raise `BlobError` otherwise.

    `data` is one contiguous blob or its two parts, `(head, state)`.
    """
    _check_key(key)
    _check_size("fingerprint", fingerprint, FINGERPRINT_BYTES)
    parts = isinstance(data, tuple)
    if parts and len(data) != 2:
        raise BlobError("bad_length", f"a blob travels in 2 parts, got {len(data)}")
    head = _part_view(data[0] if parts else data)
    if len(head) < HEADER_SIZE:
        raise BlobError(
            "too_short", f"blob is {len(head)} bytes, shorter than the {HEADER_SIZE}-byte header"
        )
    magic, version, flags, blob_fingerprint, n_tokens, prefix_hash, state_len, digest = (
        _SIGNED.unpack_from(head)
    )
    if magic != MAGIC:
        raise BlobError("bad_magic", "not a Baton state blob (bad magic)")
    if version != FORMAT_VERSION:
        retired = _RETIRED_VERSIONS.get(version)
        detail = f" ({retired}) is no longer accepted" if retired else " is unsupported"
        raise BlobError(
            "bad_version", f"blob format version {version}{detail}; expected {FORMAT_VERSION}"
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
    if parts:
        state = _part_view(data[1])
        sizes, expected = (len(head), len(state)), (state_start, state_len)
    else:
        state = head[state_start:]
        sizes, expected = (len(head),), (state_start + state_len,)
        head = head[:state_start]
    if sizes != expected:
        raise BlobError(
            "bad_length", f"blob parts are {sizes} bytes but its header implies {expected}"
        )
    if blob_fingerprint != fingerprint:
        raise BlobError("wrong_model", "blob was made by a different model")
    mac = head[_SIGNED.size : HEADER_SIZE]
    if not hmac.compare_digest(_mac(key, head[: _SIGNED.size]), mac):
        raise BlobError("bad_hmac", "blob signature does not match (forged or other key)")
    if not hmac.compare_digest(payload_digest(head[HEADER_SIZE:], state), digest):
        raise BlobError("bad_checksum", "blob payload does not match its digest")
    tokens = np.frombuffer(head, dtype=TOKEN_DTYPE, count=n_tokens, offset=HEADER_SIZE)
    tokens.flags.writeable = False
    if tokens.min() < 0:
        raise BlobError("bad_tokens", "blob holds negative token ids")
    if hasher is not None and hasher.prefix_hash(tokens) != prefix_hash:
        raise BlobError("bad_prefix_hash", "blob prefix hash does not match its tokens")
    return StateBlob(
        fingerprint=blob_fingerprint,
        prefix_hash=prefix_hash,
        tokens=tokens,
        state=state.toreadonly(),
        digest=digest,
    )
