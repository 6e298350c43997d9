"""Model fingerprints: a cheap, stable identity of a GGUF file.

Two replicas may exchange state blobs only when their fingerprints match. Hashing a
multi-gigabyte file on every start would be slow, so the fingerprint covers the file
size, its head (the GGUF metadata and tensor table), its tail, and evenly spaced samples
of the tensor data in between.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

FINGERPRINT_BYTES = 32
_HEAD_BYTES = 16 << 20
_TAIL_BYTES = 1 << 20
_SAMPLE_BYTES = 64 << 10
_SAMPLES = 64


def file_fingerprint(path: str | os.PathLike[str]) -> bytes:
    """Return a 32-byte SHA-256 fingerprint of the model file at `path`."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(b"baton-model-v1")
    digest.update(size.to_bytes(8, "little"))
    with path.open("rb") as f:
        digest.update(f.read(_HEAD_BYTES))
        if size > _HEAD_BYTES:
            span = size - _HEAD_BYTES
            for i in range(_SAMPLES):
                f.seek(_HEAD_BYTES + span * i // _SAMPLES)
                digest.update(f.read(_SAMPLE_BYTES))
            f.seek(max(_HEAD_BYTES, size - _TAIL_BYTES))
            digest.update(f.read())
    return digest.digest()
