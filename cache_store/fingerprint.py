"""Model fingerprints: the SHA-256 of the whole GGUF file.

Two replicas may exchange state blobs only when their fingerprints match, so two files that
differ anywhere — one byte in the middle of a tensor — must have different ones: the whole
file is hashed (what `sha256sum` prints). Hashing a multi-gigabyte file takes seconds, so
the result is cached under `$BATON_CACHE_DIR/fingerprints` (default ~/.cache/baton), keyed
by the file's path, size, mtime, ctime and inode: a restart reads a few bytes, and a file
that is rewritten (which changes its ctime, whatever its mtime says) is hashed again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

FINGERPRINT_BYTES = 32
_CHUNK_BYTES = 8 << 20  # hashlib releases the GIL on chunks this large


def fingerprint_cache_dir() -> Path:
    """Where computed fingerprints are kept."""
    base = Path(os.environ.get("BATON_CACHE_DIR", Path.home() / ".cache" / "baton"))
    return base / "fingerprints"


def file_fingerprint(path: str | os.PathLike[str], *, cache_dir: Path | None = None) -> bytes:
    """The 32-byte SHA-256 of the file at `path`, from the cache when it has not changed."""
    path = Path(path).resolve()
    cache = (cache_dir or fingerprint_cache_dir()) / _cache_name(path, path.stat())
    try:
        cached = bytes.fromhex(cache.read_text(encoding="ascii").strip())
        if len(cached) == FINGERPRINT_BYTES:
            return cached
    except (OSError, ValueError):
        pass
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK_BYTES):
            digest.update(chunk)
    fingerprint = digest.digest()
    if _cache_name(path, path.stat()) == cache.name:  # unchanged while it was read
        _store(cache, fingerprint)
    return fingerprint


def _cache_name(path: Path, stat: os.stat_result) -> str:
    key = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ctime_ns}\0{stat.st_ino}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _store(cache: Path, fingerprint: bytes) -> None:
    """Keep `fingerprint` in `cache` (atomically); a cache that cannot be written is skipped."""
    temporary = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(fingerprint.hex(), encoding="ascii")
        temporary.replace(cache)
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
