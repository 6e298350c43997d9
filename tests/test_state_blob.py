import hashlib
import hmac
import random
import struct
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from baton_serve.cache_store.checkpoints.state_blob import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    BlobError,
    PayloadSeal,
    decode_blob,
    encode_blob,
    encode_parts,
    seal_payload,
)
from baton_serve.cache_store.prefix_hash import PrefixHasher

# The wire format, spelled out independently of the implementation: the state is cut into
# `lanes` equal lanes, each GMAC'd (AES-256-GCM, no plaintext) under a key derived from the
# HMAC key, IV = nonce + the lane's index; `digest` is the SHA-256 of the lanes' tags;
# `hmac` is HMAC-SHA256 of the header before it and the token ids.
LAYOUT = struct.Struct("<8sHH32sI16sQ16sB32s32s")
FIELDS = ("magic", "version", "flags", "fingerprint", "n_tokens", "prefix_hash", "state_len",
          "nonce", "lanes", "digest", "hmac")  # fmt: skip
SIGNED_SIZE = LAYOUT.size - 32
GMAC_LABEL = b"baton state blob GMAC key, format 3"


def lanes_digest(key: bytes, nonce: bytes, lanes: int, state: bytes) -> bytes:
    gmac = AESGCM(hmac.new(key, GMAC_LABEL, hashlib.sha256).digest())
    size = len(state)
    tags = [
        gmac.encrypt(
            nonce + i.to_bytes(4, "big"), b"", state[i * size // lanes : (i + 1) * size // lanes]
        )
        for i in range(lanes)
    ]
    return hashlib.sha256(b"".join(tags)).digest()


RNG = random.Random(20240601)
KEY = RNG.randbytes(32)
OTHER_KEY = RNG.randbytes(32)
FINGERPRINT = hashlib.sha256(b"model-a").digest()
OTHER_FINGERPRINT = hashlib.sha256(b"model-b").digest()
HASHER = PrefixHasher(FINGERPRINT, block_tokens=8)
TOKENS = [RNG.randrange(50_000) for _ in range(50)]
STATE = RNG.randbytes(1000)
NONCE = RNG.randbytes(16)
SEAL = seal_payload(KEY, STATE, nonce=NONCE)


def blob_fields(**overrides: Any) -> dict[str, Any]:
    """The encoder's arguments for the test blob, with `overrides`."""
    fields: dict[str, Any] = {
        "fingerprint": FINGERPRINT,
        "prefix_hash": HASHER.prefix_hash(TOKENS),
        "tokens": TOKENS,
        "state": STATE,
        "key": KEY,
        "seal": SEAL,
    }
    return fields | overrides


def make_blob(**overrides: Any) -> bytes:
    return encode_blob(**blob_fields(**overrides))


BLOB = make_blob()


def reseal(blob: bytes, *, key: bytes = KEY, payload: bytes | None = None, **fields: Any) -> bytes:
    """Rewrite header fields (and optionally the payload: token ids, then the state) and
    sign the result validly."""
    header = dict(zip(FIELDS, LAYOUT.unpack_from(blob), strict=True))
    token_bytes = 4 * header["n_tokens"]
    header.update(fields)
    if payload is None:
        payload = blob[HEADER_SIZE:]
    else:
        state = payload[token_bytes:]
        header["digest"] = lanes_digest(key, header["nonce"], header["lanes"], state)
    signed = LAYOUT.pack(*header.values())[:SIGNED_SIZE]
    mac = hmac.new(key, signed + payload[: 4 * min(header["n_tokens"], 2**20)], hashlib.sha256)
    return signed + mac.digest() + payload


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
        "version-2-blake3": (reseal(BLOB, version=2), "bad_version", {}),
        "version-next": (reseal(BLOB, version=FORMAT_VERSION + 1), "bad_version", {}),
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
        "lanes-0": (reseal(BLOB, lanes=0), "bad_lanes", {}),
        "lanes-9": (reseal(BLOB, lanes=9), "bad_lanes", {}),
        "lanes-2-not-resealed": (reseal(BLOB, lanes=2), "bad_checksum", {}),
        "other-nonce": (reseal(BLOB, nonce=bytes(16)), "bad_checksum", {}),
        "digest-of-other-key": (
            reseal(BLOB, digest=lanes_digest(OTHER_KEY, NONCE, 1, STATE)),
            "bad_checksum",
            {},
        ),
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


def test_retired_versions_are_named() -> None:
    old = reseal(BLOB, version=1, digest=hashlib.sha256(BLOB[HEADER_SIZE:]).digest())
    with pytest.raises(BlobError, match="version 1 .*SHA-256.* no longer accepted"):
        decode_blob(old, key=KEY, fingerprint=FINGERPRINT)
    with pytest.raises(BlobError, match="version 2 .*BLAKE3.* no longer accepted"):
        decode_blob(reseal(BLOB, version=2), key=KEY, fingerprint=FINGERPRINT)


def test_parts_travel_without_copying_the_state() -> None:
    state = np.frombuffer(STATE, dtype=np.uint8)
    head, view = encode_parts(**blob_fields(state=state))
    assert head + bytes(view) == BLOB
    assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), state)
    blob = decode_blob((head, state), key=KEY, fingerprint=FINGERPRINT, hasher=HASHER)
    assert np.shares_memory(np.frombuffer(blob.state, dtype=np.uint8), state)
    assert blob.tokens.tolist() == TOKENS and blob.state.readonly
    assert blob.seal == SEAL


def test_a_known_seal_is_used_not_recomputed() -> None:
    """An exporter passes its stored checkpoint's seal; a wrong one is caught on arrival."""
    assert SEAL == PayloadSeal(NONCE, 1, lanes_digest(KEY, NONCE, 1, STATE))
    wrong = make_blob(seal=PayloadSeal(NONCE, 1, bytes(32)))
    with pytest.raises(BlobError) as info:
        decode_blob(wrong, key=KEY, fingerprint=FINGERPRINT)
    assert info.value.reason == "bad_checksum"


def test_each_seal_has_its_own_nonce() -> None:
    first, second = make_blob(seal=None), make_blob(seal=None)
    assert first != second  # a random nonce each time
    for blob in (first, second):
        assert bytes(decode_blob(blob, key=KEY, fingerprint=FINGERPRINT).state) == STATE


@pytest.mark.parametrize(
    ("state_bytes", "lanes"), [(1000, 1), (2 << 20, 2), ((5 << 20) + 7, 5), (40 << 20, 8)]
)
def test_a_big_state_is_sealed_in_lanes_on_every_core(state_bytes: int, lanes: int) -> None:
    """One lane per MiB, up to 8: the receiver checks them on several cores at once. The
    seal is the same whichever number of threads computes it."""
    state = np.random.default_rng(state_bytes).integers(0, 256, state_bytes, dtype=np.uint8)
    seal = seal_payload(KEY, state, nonce=NONCE)
    assert seal.lanes == lanes
    assert seal == seal_payload(KEY, state, nonce=NONCE, threads=1)
    assert seal.digest == lanes_digest(KEY, NONCE, lanes, state.tobytes())
    blob = encode_parts(**blob_fields(state=state, seal=seal))
    decoded = decode_blob(blob, key=KEY, fingerprint=FINGERPRINT, threads=2)
    assert decoded.seal == seal
    damaged = state.copy()
    damaged[-1] ^= 1  # the last lane's last byte
    with pytest.raises(BlobError) as info:
        decode_blob((blob[0], damaged), key=KEY, fingerprint=FINGERPRINT)
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
    assert HEADER_SIZE == LAYOUT.size == 153
    header = dict(zip(FIELDS, LAYOUT.unpack_from(BLOB), strict=True))
    assert header["magic"] == MAGIC
    assert header["version"] == FORMAT_VERSION
    assert header["flags"] == 0
    assert header["fingerprint"] == FINGERPRINT
    assert header["n_tokens"] == len(TOKENS)
    assert header["state_len"] == len(STATE)
    assert header["nonce"] == NONCE and header["lanes"] == 1
    assert header["digest"] == lanes_digest(KEY, NONCE, 1, STATE)
    token_ids = np.array(TOKENS, dtype="<i4").tobytes()
    signed = BLOB[:SIGNED_SIZE] + token_ids
    assert header["hmac"] == hmac.new(KEY, signed, hashlib.sha256).digest()
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
