import hashlib
import hmac
import random
import struct
from typing import Any

import blake3
import numpy as np
import pytest

from baton_serve.cache_store.prefix_hash import PrefixHasher
from baton_serve.cache_store.state_blob import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    BlobError,
    decode_blob,
    encode_blob,
    encode_parts,
)

# The wire format, spelled out independently of the implementation: `digest` is the
# BLAKE3-256 of the payload, `hmac` HMAC-SHA256 of the header before it.
LAYOUT = struct.Struct("<8sHH32sI16sQ32s32s")
FIELDS = ("magic", "version", "flags", "fingerprint", "n_tokens", "prefix_hash", "state_len",
          "digest", "hmac")  # fmt: skip
SIGNED_SIZE = LAYOUT.size - 32

RNG = random.Random(20240601)
KEY = RNG.randbytes(32)
OTHER_KEY = RNG.randbytes(32)
FINGERPRINT = hashlib.sha256(b"model-a").digest()
OTHER_FINGERPRINT = hashlib.sha256(b"model-b").digest()
HASHER = PrefixHasher(FINGERPRINT, block_tokens=8)
TOKENS = [RNG.randrange(50_000) for _ in range(50)]
STATE = RNG.randbytes(1000)


def make_blob(**overrides: Any) -> bytes:
    args: dict[str, Any] = {
        "fingerprint": FINGERPRINT,
        "prefix_hash": HASHER.prefix_hash(TOKENS),
        "tokens": TOKENS,
        "state": STATE,
        "key": KEY,
    }
    return encode_blob(**(args | overrides))


BLOB = make_blob()


def reseal(blob: bytes, *, key: bytes = KEY, payload: bytes | None = None, **fields: Any) -> bytes:
    """Rewrite header fields (and optionally the payload) and sign the result validly."""
    header = dict(zip(FIELDS, LAYOUT.unpack_from(blob), strict=True))
    header.update(fields)
    if payload is None:
        payload = blob[HEADER_SIZE:]
    else:
        header["digest"] = blake3.blake3(payload).digest()
    signed = LAYOUT.pack(*header.values())[:SIGNED_SIZE]
    return signed + hmac.new(key, signed, hashlib.sha256).digest() + payload


def flip_bit(blob: bytes, bit: int) -> bytes:
    data = bytearray(blob)
    data[bit // 8] ^= 1 << (bit % 8)
    return bytes(data)


def hostile_cases() -> list[Any]:
    rng = random.Random(7)
    cases = [pytest.param(b"", {"too_short"}, {}, id="trunc-0")]
    for size in sorted(rng.sample(range(1, HEADER_SIZE), 40)):
        cases.append(pytest.param(BLOB[:size], {"too_short"}, {}, id=f"trunc-header-{size}"))
    for size in sorted(rng.sample(range(HEADER_SIZE, len(BLOB)), 60)):
        cases.append(pytest.param(BLOB[:size], {"bad_length"}, {}, id=f"trunc-payload-{size}"))
    for bit in sorted(rng.sample(range(HEADER_SIZE * 8), 40)):
        cases.append(pytest.param(flip_bit(BLOB, bit), None, {}, id=f"flip-header-bit-{bit}"))
    for bit in sorted(rng.sample(range(HEADER_SIZE * 8, len(BLOB) * 8), 60)):
        cases.append(
            pytest.param(
                flip_bit(BLOB, bit), {"bad_checksum", "bad_hmac"}, {}, id=f"flip-payload-bit-{bit}"
            )
        )
    n_tokens, state_len = len(TOKENS), len(STATE)
    negative = np.array(TOKENS, dtype="<i4")
    negative[3] = -1
    resummed = reseal(BLOB, payload=bytes(len(BLOB) - HEADER_SIZE))
    no_limits = {"max_tokens": 2**64, "max_state_bytes": 2**64}
    named: dict[str, tuple[bytes, str, dict[str, Any]]] = {
        "other-model-expected": (BLOB, "wrong_model", {"fingerprint": OTHER_FINGERPRINT}),
        "other-model-blob": (make_blob(fingerprint=OTHER_FINGERPRINT), "wrong_model", {}),
        "signed-other-key": (make_blob(key=OTHER_KEY), "bad_hmac", {}),
        "verified-other-key": (BLOB, "bad_hmac", {"key": OTHER_KEY}),
        "forged-key": (reseal(BLOB, key=b"guess"), "bad_hmac", {}),
        "hmac-zeroed": (BLOB[:SIGNED_SIZE] + bytes(32) + BLOB[HEADER_SIZE:], "bad_hmac", {}),
        "payload-resummed-not-resigned": (
            resummed[:SIGNED_SIZE] + BLOB[SIGNED_SIZE:HEADER_SIZE] + resummed[HEADER_SIZE:],
            "bad_hmac",
            {},
        ),
        "bad-magic": (reseal(BLOB, magic=b"BATONSB2"), "bad_magic", {}),
        "version-0": (reseal(BLOB, version=0), "bad_version", {}),
        "version-1-sha256": (
            reseal(BLOB, version=1, digest=hashlib.sha256(BLOB[HEADER_SIZE:]).digest()),
            "bad_version",
            {},
        ),
        "version-2": (reseal(BLOB, version=FORMAT_VERSION + 1), "bad_version", {}),
        "version-max": (reseal(BLOB, version=0xFFFF), "bad_version", {}),
        "flags-1": (reseal(BLOB, flags=1), "bad_flags", {}),
        "flags-high": (reseal(BLOB, flags=0x8000), "bad_flags", {}),
        "n-tokens-max": (reseal(BLOB, n_tokens=2**32 - 1), "too_large", {}),
        "n-tokens-max-no-limit": (reseal(BLOB, n_tokens=2**32 - 1), "bad_length", no_limits),
        "state-len-2-63": (reseal(BLOB, state_len=2**63), "too_large", {}),
        "state-len-max": (reseal(BLOB, state_len=2**64 - 1), "too_large", {}),
        "state-len-max-no-limit": (reseal(BLOB, state_len=2**64 - 1), "bad_length", no_limits),
        "over-token-limit": (BLOB, "too_large", {"max_tokens": n_tokens - 1}),
        "over-state-limit": (BLOB, "too_large", {"max_state_bytes": state_len - 1}),
        "n-tokens-plus-1": (reseal(BLOB, n_tokens=n_tokens + 1), "bad_length", {}),
        "n-tokens-minus-1": (reseal(BLOB, n_tokens=n_tokens - 1), "bad_length", {}),
        "n-tokens-0": (
            reseal(BLOB, n_tokens=0, state_len=len(BLOB) - HEADER_SIZE),
            "bad_length",
            {},
        ),
        "state-len-plus-1": (reseal(BLOB, state_len=state_len + 1), "bad_length", {}),
        "state-len-minus-1": (reseal(BLOB, state_len=state_len - 1), "bad_length", {}),
        "trailing-byte": (BLOB + b"\0", "bad_length", {}),
        "trailing-garbage": (BLOB + RNG.randbytes(100), "bad_length", {}),
        "doubled": (BLOB + BLOB, "bad_length", {}),
        "wrong-prefix-hash": (make_blob(prefix_hash=bytes(16)), "bad_prefix_hash", {}),
        "negative-token": (reseal(BLOB, payload=negative.tobytes() + STATE), "bad_tokens", {}),
        "empty-key": (BLOB, "no_key", {"key": b""}),
    }
    for name, (data, reason, overrides) in named.items():
        cases.append(pytest.param(data, {reason}, overrides, id=name))
    return cases


HOSTILE = hostile_cases()


def test_enough_hostile_cases() -> None:
    assert len(HOSTILE) >= 200


def split(blob: bytes) -> tuple[bytes, bytes]:
    """A blob as its two travelling parts, cut where the valid blob's state begins."""
    cut = HEADER_SIZE + 4 * len(TOKENS)
    return blob[:cut], blob[cut:]


@pytest.mark.parametrize("parts", [False, True], ids=["contiguous", "parts"])
@pytest.mark.parametrize(("data", "reasons", "overrides"), HOSTILE)
def test_hostile_input_rejected(
    data: bytes, reasons: set[str] | None, overrides: dict[str, Any], parts: bool
) -> None:
    kwargs: dict[str, Any] = {"key": KEY, "fingerprint": FINGERPRINT, "hasher": HASHER}
    kwargs |= overrides
    with pytest.raises(BlobError) as info:
        decode_blob(split(data) if parts else data, **kwargs)
    if reasons is not None:
        assert info.value.reason in reasons, str(info.value)
    assert isinstance(info.value, ValueError)
    assert KEY.hex() not in str(info.value) and repr(KEY)[2:-1] not in str(info.value)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ((BLOB,), "bad_length"),
        ((*split(BLOB), b""), "bad_length"),
        (split(BLOB)[::-1], "bad_magic"),
        ((BLOB[: HEADER_SIZE + 4 * len(TOKENS) + 1], split(BLOB)[1]), "bad_length"),
        ((split(BLOB)[0], split(BLOB)[1][:-1]), "bad_length"),
        ((split(BLOB)[0], split(BLOB)[1] + b"\0"), "bad_length"),
        ((split(BLOB)[0], None), "bad_type"),
        ((split(BLOB)[0], "text"), "bad_type"),
        ((None, split(BLOB)[1]), "bad_type"),
        ((split(BLOB)[0], np.frombuffer(STATE, dtype=np.uint8)[::2]), "bad_type"),
    ],
    ids=[
        "one-part",
        "three-parts",
        "swapped",
        "long-head",
        "short-state",
        "long-state",
        "state-none",
        "state-str",
        "head-none",
        "state-strided",
    ],  # fmt: skip
)
def test_hostile_parts_rejected(data: tuple, reason: str) -> None:
    with pytest.raises(BlobError) as info:
        decode_blob(data, key=KEY, fingerprint=FINGERPRINT, hasher=HASHER)
    assert info.value.reason == reason, str(info.value)


def test_retired_version_is_named() -> None:
    old = reseal(BLOB, version=1, digest=hashlib.sha256(BLOB[HEADER_SIZE:]).digest())
    with pytest.raises(BlobError, match="version 1 .*SHA-256.* no longer accepted"):
        decode_blob(old, key=KEY, fingerprint=FINGERPRINT)


def test_parts_travel_without_copying_the_state() -> None:
    state = np.frombuffer(STATE, dtype=np.uint8)
    head, view = encode_parts(
        fingerprint=FINGERPRINT,
        prefix_hash=HASHER.prefix_hash(TOKENS),
        tokens=TOKENS,
        state=state,
        key=KEY,
    )
    assert head + bytes(view) == BLOB
    assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), state)
    blob = decode_blob((head, state), key=KEY, fingerprint=FINGERPRINT, hasher=HASHER)
    assert np.shares_memory(np.frombuffer(blob.state, dtype=np.uint8), state)
    assert blob.tokens.tolist() == TOKENS and blob.state.readonly
    assert blob.digest == blake3.blake3(BLOB[HEADER_SIZE:]).digest()


def test_a_known_digest_is_used_not_recomputed() -> None:
    """An exporter passes its stored checkpoint's digest; a wrong one is caught on arrival."""
    digest = blake3.blake3(BLOB[HEADER_SIZE:]).digest()
    assert make_blob(digest=digest) == BLOB
    wrong = make_blob(digest=bytes(32))
    with pytest.raises(BlobError) as info:
        decode_blob(wrong, key=KEY, fingerprint=FINGERPRINT)
    assert info.value.reason == "bad_checksum"


def test_round_trip() -> None:
    blob = decode_blob(BLOB, key=KEY, fingerprint=FINGERPRINT, hasher=HASHER)
    assert blob.fingerprint == FINGERPRINT
    assert blob.prefix_hash == HASHER.prefix_hash(TOKENS)
    assert blob.n_tokens == len(TOKENS)
    assert blob.tokens.dtype == np.int32 and blob.tokens.tolist() == TOKENS
    assert bytes(blob.state) == STATE
    assert not blob.tokens.flags.writeable


def test_header_layout() -> None:
    assert HEADER_SIZE == LAYOUT.size == 136
    header = dict(zip(FIELDS, LAYOUT.unpack_from(BLOB), strict=True))
    assert header["magic"] == MAGIC
    assert header["version"] == FORMAT_VERSION
    assert header["flags"] == 0
    assert header["fingerprint"] == FINGERPRINT
    assert header["n_tokens"] == len(TOKENS)
    assert header["state_len"] == len(STATE)
    assert header["digest"] == blake3.blake3(BLOB[HEADER_SIZE:]).digest()
    assert header["hmac"] == hmac.new(KEY, BLOB[:SIGNED_SIZE], hashlib.sha256).digest()
    assert BLOB[HEADER_SIZE:] == np.array(TOKENS, dtype="<i4").tobytes() + STATE


@pytest.mark.parametrize(
    "wrap", [bytes, bytearray, memoryview, lambda b: np.frombuffer(b, dtype=np.uint8).copy()]
)
def test_accepts_buffers_without_copying(wrap: Any) -> None:
    data = wrap(BLOB)
    blob = decode_blob(data, key=KEY, fingerprint=FINGERPRINT)
    assert bytes(blob.state) == STATE and blob.tokens.tolist() == TOKENS
    whole = np.frombuffer(data, dtype=np.uint8)
    assert np.shares_memory(np.frombuffer(blob.state, dtype=np.uint8), whole)
    assert np.shares_memory(blob.tokens, whole)


def test_encode_accepts_arrays_and_views() -> None:
    blob = make_blob(tokens=np.array(TOKENS, dtype=np.int64), state=memoryview(bytearray(STATE)))
    assert blob == BLOB


def test_prefix_hash_unchecked_without_hasher() -> None:
    decode_blob(make_blob(prefix_hash=bytes(16)), key=KEY, fingerprint=FINGERPRINT)


@pytest.mark.parametrize(
    "overrides",
    [
        {"fingerprint": b"short"},
        {"fingerprint": FINGERPRINT + b"x"},
        {"prefix_hash": bytes(15)},
        {"prefix_hash": bytes(32)},
        {"tokens": []},
        {"tokens": [1, -2, 3]},
        {"tokens": [2**31]},
    ],
)
def test_encode_rejects_bad_arguments(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        make_blob(**overrides)


def test_encode_rejects_empty_key() -> None:
    with pytest.raises(BlobError) as info:
        make_blob(key=b"")
    assert info.value.reason == "no_key"


def test_decode_rejects_bad_expected_fingerprint() -> None:
    with pytest.raises(ValueError, match="fingerprint"):
        decode_blob(BLOB, key=KEY, fingerprint=b"short")
