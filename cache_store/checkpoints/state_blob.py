"""Wire format of a serialized llama.cpp sequence state.

A blob is a fixed little-endian header followed by the payload::

    magic 8s | version H | flags H | fingerprint 32s | n_tokens I | prefix_hash 16s
    | state_len Q | nonce 16s | lanes B | digest 32s | hmac 32s

The payload is the prefix tokens as little-endian int32 followed by ``state_len`` bytes
of llama.cpp state. The state is cut into ``lanes`` equal lanes, each authenticated by
GMAC (AES-256-GCM over no plaintext, a key derived from the cluster's HMAC key, the IV
``nonce`` + the lane's index); ``digest`` is the SHA-256 of the lanes' tags, and ``hmac``
is HMAC-SHA256 over the header up to the hmac field and the token ids. So the state is
read once on each side, in one keyed pass that runs on every core (GHASH, carry-less
multiplication: about twice BLAKE3's speed per core here), the seal of a stored state can
be kept and reused for every export, and the HMAC covers a few KB. Version 1 (a SHA-256
checksum) and version 2 (a BLAKE3 checksum of the payload) are refused.

A blob travels in two parts, the *head* (header and token ids, a few KB) and the state
itself, so that neither side copies the state to put a header in front of it:
`encode_parts` returns them, `decode_blob` takes them or one contiguous buffer.

`decode_blob` is a safety boundary: a truncated or forged state handed to llama.cpp
can crash the process, so every field is checked before anything is returned.
`decode_head` checks a head alone (a disk tier's start reads a few KB of each file, not
its state); the state must still pass `decode_blob` before it is used.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from baton_serve.cache_store.prefix_hash import HASH_BYTES, TOKEN_DTYPE, PrefixHasher, token_array

MAGIC = b"BATONSB1"
FORMAT_VERSION = 3
FINGERPRINT_BYTES = 32
NONCE_BYTES = 16
MAX_LANES = 8
LANE_BYTES = 1 << 20  # a state is cut into lanes of at least this (up to MAX_LANES)

_SIGNED = struct.Struct("<8sHH32sI16sQ16sB32s")  # every header field but the hmac
_MAC_BYTES = 32
HEADER_SIZE = _SIGNED.size + _MAC_BYTES
_RETIRED_VERSIONS = {1: "SHA-256 payload checksum", 2: "BLAKE3 payload checksum"}
_GMAC_KEY_LABEL = b"baton state blob GMAC key, format 3"

Buffer = bytes | bytearray | memoryview | np.ndarray
BlobParts = tuple[Buffer, Buffer]  # (head: header + token ids, state)


class BlobError(ValueError):
    """A blob failed validation; `.reason` is a short machine-readable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class PayloadSeal:
    """What authenticates a state: its nonce, how many lanes it was cut into, and the
    SHA-256 of the lanes' GMAC tags."""

    nonce: bytes
    lanes: int
    digest: bytes


@dataclass(frozen=True, eq=False)
class StateBlob:
    """A validated blob: zero-copy views into the buffer(s) it was decoded from."""

    fingerprint: bytes
    prefix_hash: bytes
    tokens: np.ndarray
    state: memoryview
    seal: PayloadSeal  # checked: an export of the state can reuse it

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


ALL_CORES = os.cpu_count() or 1


@functools.lru_cache(maxsize=8)
def _gmac(key: bytes) -> AESGCM:
    return AESGCM(hmac.new(key, _GMAC_KEY_LABEL, hashlib.sha256).digest())


@functools.lru_cache(maxsize=1)
def _lane_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(ALL_CORES, thread_name_prefix="baton-blob-lanes")


def lanes_for(state_bytes: int) -> int:
    """Lanes a state of `state_bytes` is cut into: one per `LANE_BYTES`, up to MAX_LANES."""
    return max(1, min(MAX_LANES, state_bytes // LANE_BYTES))


def _digest(key: bytes, nonce: bytes, lanes: int, state: memoryview, threads: int) -> bytes:
    gmac, size = _gmac(key), len(state)

    def tag(lane: int) -> bytes:  # AES-GCM releases the GIL: lanes run on several cores
        part = state[lane * size // lanes : (lane + 1) * size // lanes]
        return gmac.encrypt(nonce + lane.to_bytes(4, "big"), b"", part)

    if threads <= 1 or lanes == 1:
        tags = [tag(lane) for lane in range(lanes)]
    else:
        tags = list(_lane_pool().map(tag, range(lanes)))
    return hashlib.sha256(b"".join(tags)).digest()


def seal_payload(
    key: bytes, state: Buffer, *, nonce: bytes | None = None, threads: int = ALL_CORES
) -> PayloadSeal:
    """The seal of `state` under `key`: a new random nonce unless one is given; the lanes'
    tags computed on this thread when `threads` is 1, else on a pool of a thread per core."""
    _check_key(key)
    nonce = secrets.token_bytes(NONCE_BYTES) if nonce is None else nonce
    _check_size("nonce", nonce, NONCE_BYTES)
    view = byte_view(state)
    lanes = lanes_for(len(view))
    return PayloadSeal(nonce, lanes, _digest(key, nonce, lanes, view, threads))


def _check_key(key: bytes) -> None:
    if not key:
        raise BlobError("no_key", "an empty HMAC key was given; state blobs must be signed")


def _check_size(name: str, value: bytes, size: int) -> None:
    if not isinstance(value, bytes) or len(value) != size:
        raise ValueError(f"{name} must be exactly {size} bytes")


def _mac(key: bytes, signed_header: Buffer, token_ids: Buffer) -> bytes:
    mac = hmac.new(key, signed_header, hashlib.sha256)
    mac.update(token_ids)
    return mac.digest()


def encode_parts(
    *,
    fingerprint: bytes,
    prefix_hash: bytes,
    tokens: Sequence[int] | np.ndarray,
    state: Buffer,
    key: bytes,
    seal: PayloadSeal | None = None,
) -> tuple[bytes, memoryview]:
    """Sign a sequence state: the blob's head, and `state` itself as a byte view (not copied).

    `seal` is the state's seal under `key` when the caller already knows it (a stored
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
    if seal is None:
        seal = seal_payload(key, state_view)
    _check_size("nonce", seal.nonce, NONCE_BYTES)
    _check_size("digest", seal.digest, 32)
    signed = _SIGNED.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        fingerprint,
        len(token_ids),
        prefix_hash,
        len(state_view),
        seal.nonce,
        seal.lanes,
        seal.digest,
    )
    return b"".join((signed, _mac(key, signed, token_ids.data), token_ids.data)), state_view


def encode_blob(
    *,
    fingerprint: bytes,
    prefix_hash: bytes,
    tokens: Sequence[int] | np.ndarray,
    state: Buffer,
    key: bytes,
    seal: PayloadSeal | None = None,
) -> bytes:
    """One contiguous signed blob, head then state (a copy: for files and tests)."""
    head, state_view = encode_parts(
        fingerprint=fingerprint,
        prefix_hash=prefix_hash,
        tokens=tokens,
        state=state,
        key=key,
        seal=seal,
    )
    return b"".join((head, state_view))


def head_bytes(n_tokens: int) -> int:
    """Bytes of the head (header and token ids) of a blob of `n_tokens` tokens."""
    return HEADER_SIZE + TOKEN_DTYPE.itemsize * n_tokens


@dataclass(frozen=True, eq=False)
class BlobHead:
    """A blob's authenticated head: its model, prefix and tokens, and the length and seal
    of the state that follows it (the state itself not read, so not checked)."""

    fingerprint: bytes
    prefix_hash: bytes
    tokens: np.ndarray
    state_len: int
    seal: PayloadSeal

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def head_length(
    header: Buffer, *, max_state_bytes: int = 8 << 30, max_tokens: int = 1 << 22
) -> int:
    """Bytes of the head (header and token ids) of the blob whose first `HEADER_SIZE` bytes
    are `header`: what to read for `decode_head`. Raises `BlobError` for a bad header."""
    return _parse_header(_part_view(header), max_state_bytes, max_tokens).head_len


def decode_head(
    head: Buffer,
    *,
    key: bytes,
    fingerprint: bytes,
    max_state_bytes: int = 8 << 30,
    max_tokens: int = 1 << 22,
    hasher: PrefixHasher | None = None,
) -> BlobHead:
    """Validate a blob's head alone (header and token ids: its HMAC, model, tokens and prefix
    hash); raise `BlobError` otherwise. A few KB are read, whatever the state's size: the
    state is only checked by `decode_blob`, which must run before llama.cpp sees it."""
    _check_key(key)
    _check_size("fingerprint", fingerprint, FINGERPRINT_BYTES)
    view = _part_view(head)
    header = _parse_header(view, max_state_bytes, max_tokens)
    if len(view) != header.head_len:
        raise BlobError(
            "bad_length",
            f"a blob head is {len(view)} bytes but its header implies {header.head_len}",
        )
    _check_signed(header, view, key, fingerprint)
    tokens = _checked_tokens(header, view, hasher)
    return BlobHead(header.fingerprint, header.prefix_hash, tokens, header.state_len, header.seal)


@dataclass(frozen=True)
class _Header:
    fingerprint: bytes
    n_tokens: int
    prefix_hash: bytes
    state_len: int
    seal: PayloadSeal

    @property
    def head_len(self) -> int:
        return head_bytes(self.n_tokens)


def _parse_header(head: memoryview, max_state_bytes: int, max_tokens: int) -> _Header:
    """The header's fields, each checked on its own (nothing keyed yet)."""
    if len(head) < HEADER_SIZE:
        raise BlobError(
            "too_short", f"blob is {len(head)} bytes, shorter than the {HEADER_SIZE}-byte header"
        )
    (
        magic,
        version,
        flags,
        blob_fingerprint,
        n_tokens,
        prefix_hash,
        state_len,
        nonce,
        lanes,
        digest,
    ) = _SIGNED.unpack_from(head)
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
    return _Header(
        blob_fingerprint, n_tokens, prefix_hash, state_len, PayloadSeal(nonce, lanes, digest)
    )


def _check_signed(header: _Header, head: memoryview, key: bytes, fingerprint: bytes) -> None:
    """The model and the HMAC over the header and token ids; the lane count."""
    if header.fingerprint != fingerprint:
        raise BlobError("wrong_model", "blob was made by a different model")
    mac = head[_SIGNED.size : HEADER_SIZE]
    if not hmac.compare_digest(_mac(key, head[: _SIGNED.size], head[HEADER_SIZE:]), mac):
        raise BlobError("bad_hmac", "blob signature does not match (forged or other key)")
    if not 1 <= header.seal.lanes <= MAX_LANES:
        raise BlobError(
            "bad_lanes", f"blob state is cut into {header.seal.lanes} lanes, not 1-{MAX_LANES}"
        )


def _checked_tokens(header: _Header, head: memoryview, hasher: PrefixHasher | None) -> np.ndarray:
    tokens = np.frombuffer(head, dtype=TOKEN_DTYPE, count=header.n_tokens, offset=HEADER_SIZE)
    tokens.flags.writeable = False
    if tokens.min() < 0:
        raise BlobError("bad_tokens", "blob holds negative token ids")
    if hasher is not None and hasher.prefix_hash(tokens) != header.prefix_hash:
        raise BlobError("bad_prefix_hash", "blob prefix hash does not match its tokens")
    return tokens


def decode_blob(
    data: Buffer | BlobParts,
    *,
    key: bytes,
    fingerprint: bytes,
    max_state_bytes: int = 8 << 30,
    max_tokens: int = 1 << 22,
    hasher: PrefixHasher | None = None,
    threads: int = ALL_CORES,
) -> StateBlob:
    """Validate a blob completely and return views into it; raise `BlobError` otherwise.

    `data` is one contiguous blob or its two parts, `(head, state)`; the state's lanes
    are checked on this thread when `threads` is 1, else on a pool of a thread per core.
    """
    _check_key(key)
    _check_size("fingerprint", fingerprint, FINGERPRINT_BYTES)
    parts = isinstance(data, tuple)
    if parts and len(data) != 2:
        raise BlobError("bad_length", f"a blob travels in 2 parts, got {len(data)}")
    head = _part_view(data[0] if parts else data)
    header = _parse_header(head, max_state_bytes, max_tokens)
    state_start = header.head_len
    if parts:
        state = _part_view(data[1])
        sizes, expected = (len(head), len(state)), (state_start, header.state_len)
    else:
        state = head[state_start:]
        sizes, expected = (len(head),), (state_start + header.state_len,)
        head = head[:state_start]
    if sizes != expected:
        raise BlobError(
            "bad_length", f"blob parts are {sizes} bytes but its header implies {expected}"
        )
    _check_signed(header, head, key, fingerprint)
    seal = header.seal
    if not hmac.compare_digest(_digest(key, seal.nonce, seal.lanes, state, threads), seal.digest):
        raise BlobError("bad_checksum", "blob state does not match its seal")
    return StateBlob(
        fingerprint=header.fingerprint,
        prefix_hash=header.prefix_hash,
        tokens=_checked_tokens(header, head, hasher),
        state=state.toreadonly(),
        seal=seal,
    )
