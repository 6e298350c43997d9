"""Model fingerprints: the whole file's SHA-256, cached by the file's identity."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from baton_serve.cache_store.checkpoints.state_blob import BlobError, decode_blob, encode_blob
from baton_serve.cache_store.fingerprint import file_fingerprint
from baton_serve.cache_store.prefix_hash import PrefixHasher

KEY = b"fingerprint-test-key"


def test_models_differing_in_one_middle_byte_never_accept_each_others_states(
    tmp_path: Path,
) -> None:
    """48 MiB "models" that differ in one byte 300 KiB past the first 16 MiB: between two of
    the 64 KiB samples a sampled fingerprint read, so only hashing everything tells them apart."""
    data = bytearray(os.urandom(48 << 20))
    one, other = tmp_path / "one.gguf", tmp_path / "other.gguf"
    one.write_bytes(data)
    data[(16 << 20) + (300 << 10)] ^= 0x01
    other.write_bytes(data)
    a = file_fingerprint(one, cache_dir=tmp_path / "cache")
    b = file_fingerprint(other, cache_dir=tmp_path / "cache")
    assert a != b
    tokens = list(range(1, 33))
    blob = encode_blob(
        fingerprint=a,
        prefix_hash=PrefixHasher(a, block_tokens=16).prefix_hash(tokens),
        tokens=tokens,
        state=os.urandom(4096),
        key=KEY,
    )
    assert decode_blob(blob, key=KEY, fingerprint=a).n_tokens == 32
    with pytest.raises(BlobError) as refused:
        decode_blob(blob, key=KEY, fingerprint=b)
    assert refused.value.reason == "wrong_model"


def test_the_fingerprint_is_the_files_sha256_and_a_restart_reads_it_from_the_cache(
    tmp_path: Path,
) -> None:
    model, cache = tmp_path / "m.gguf", tmp_path / "cache"
    model.write_bytes(b"GGUF" + os.urandom(1 << 20))
    expected = hashlib.sha256(model.read_bytes()).digest()
    assert file_fingerprint(model, cache_dir=cache) == expected
    (entry,) = cache.iterdir()
    assert entry.read_text() == expected.hex()
    # The cached value is what a second call returns: it did not read the model again.
    entry.write_text("ab" * 32)
    assert file_fingerprint(model, cache_dir=cache) == bytes.fromhex("ab" * 32)
    # Rewritten in place with its old mtime restored: its ctime changed, so it is hashed again.
    stat = model.stat()
    time.sleep(0.02)  # file times tick once per kernel tick (a few ms)
    model.write_bytes(b"GGUF" + os.urandom(1 << 20))
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    rewritten = hashlib.sha256(model.read_bytes()).digest()
    assert file_fingerprint(model, cache_dir=cache) == rewritten
    # A cache that cannot be written only costs the hashing.
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert file_fingerprint(model, cache_dir=blocked / "sub") == rewritten
