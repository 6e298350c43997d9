"""Download a file once, resumably, and verified: the chart's model init container for a URL.

`fetch` streams a URL (http(s) or file) into `DEST.partial` — resuming a partial file an
interrupted run left, with an HTTP `Range` request — checks its SHA-256 and renames it to
DEST. `DEST.sha256` (the `sha256sum` format) records the verified digest, so a later run trusts
DEST without hashing it again (unless DEST is newer than the record). `file_lock` keeps the
processes and pods sharing one directory from downloading the same file at once
(`fcntl.flock` on `DEST.lock`). Hugging Face files go through `huggingface_hub` instead
(`hf_hub`), which reuses `verified_sha256` and `record_sha256` for its blobs.
"""

from __future__ import annotations

import fcntl
import hashlib
import http.client
import logging
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHUNK_BYTES = 1 << 20
TIMEOUT_S = 60.0
ATTEMPTS = 3  # requests per fetch: a dropped connection is resumed up to twice
RETRY_DELAY_S = 2.0  # times the attempt number
SHA256_HEX = re.compile(r"[0-9a-f]{64}")

log = logging.getLogger(__name__)


class ModelDownloadError(ValueError):
    """A model file that cannot be downloaded, or whose content has not the expected SHA-256."""


class HTTPStatusError(ModelDownloadError):
    """The server answered an error status."""

    def __init__(self, url: str, status: int, reason: str) -> None:
        super().__init__(f"{url}: HTTP {status} {reason}")
        self.status = status


def file_sha256(path: Path, digest: hashlib._Hash | None = None) -> hashlib._Hash:
    """`digest` (a new SHA-256 by default) updated with the content of `path`."""
    digest = digest or hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest


def _sibling(dest: Path, suffix: str) -> Path:
    return dest.with_name(dest.name + suffix)


def verified_sha256(dest: Path) -> str | None:
    """The SHA-256 of `dest` (hex): its record if `dest` is not newer, else hashed; None when
    there is no `dest`."""
    if not dest.is_file():
        return None
    record = _sibling(dest, ".sha256")
    try:
        if dest.stat().st_mtime_ns <= record.stat().st_mtime_ns:
            recorded = record.read_text().split(maxsplit=1)[0].lower()
            if SHA256_HEX.fullmatch(recorded):
                return recorded
    except (OSError, IndexError):
        pass
    return file_sha256(dest).hexdigest()


@contextmanager
def file_lock(dest: Path) -> Iterator[None]:
    """Hold an exclusive lock on `dest.lock`, waiting while another process or thread holds it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _sibling(dest, ".lock").open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another download of %s", dest)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def record_sha256(path: Path, digest: str) -> None:
    """Record `digest` as the verified SHA-256 of `path` (see `verified_sha256`)."""
    _sibling(path, ".sha256").write_text(f"{digest}  {path.name}\n")


def fetch(url: str, dest: Path, sha256: str, *, timeout_s: float = TIMEOUT_S) -> str:
    """Download `url` into `dest` through `dest.partial` (resumed if there is one), verify
    its SHA-256 is `sha256` and record it; return the digest. The caller holds
    `file_lock(dest)`."""
    partial = _sibling(dest, ".partial")
    sha256 = sha256.lower()
    failure = "no attempt"
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(RETRY_DELAY_S * attempt)
        try:
            digest, resumed = _fetch_once(url, partial, timeout_s)
        except HTTPStatusError as exc:
            if exc.status < 500 and exc.status not in (408, 416, 429):
                raise
            if exc.status == 416:  # the partial file is not a prefix of this content
                partial.unlink(missing_ok=True)
            failure = str(exc)
            continue
        except (OSError, http.client.HTTPException) as exc:  # the partial file is kept
            failure = reason(exc)
            log.warning("download of %s interrupted: %s", url, failure)
            continue
        if digest == sha256:
            partial.replace(dest)
            record_sha256(dest, digest)
            return digest
        partial.unlink()
        mismatch = f"{url}: sha256 {digest} != expected {sha256}"
        if not resumed:
            raise ModelDownloadError(mismatch)
        failure = mismatch + " (after resuming a partial file)"  # stale: start again
    raise ModelDownloadError(f"cannot download {url}: {failure}")


def _fetch_once(url: str, partial: Path, timeout_s: float) -> tuple[str, bool]:
    """One request: append to `partial` (or rewrite it); return (digest of the whole partial
    file, whether it was resumed)."""
    offset = partial.stat().st_size if partial.is_file() else 0
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    try:
        response = urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=timeout_s
        )
    except urllib.error.HTTPError as exc:
        with exc:
            raise HTTPStatusError(url, exc.code, exc.reason) from None
    with response:
        start = _range_start(response)
        if start is not None and start != offset:
            partial.unlink()
            raise ConnectionError(f"asked for bytes from {offset}, got them from {start}")
        resumed = offset > 0 and start is not None
        if not resumed:
            offset = 0  # 200: the whole file again
        total = _total_bytes(response, offset)
        digest = file_sha256(partial) if resumed else hashlib.sha256()
        if not resumed:
            log.info("downloading %s (%s bytes)", url, total)
        with partial.open("ab" if resumed else "wb") as out:
            while chunk := response.read(CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
                offset += len(chunk)
    if total is not None and offset < total:
        raise ConnectionError(f"connection closed after {offset} of {total} bytes")
    return digest.hexdigest(), resumed


def _range_start(response: http.client.HTTPResponse) -> int | None:
    """Where a 206 answer's `Content-Range: bytes START-END/TOTAL` starts; None for others."""
    match = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", response.headers.get("Content-Range", ""))
    return int(match[1]) if getattr(response, "status", None) == 206 and match else None


def _total_bytes(response: http.client.HTTPResponse, offset: int) -> int | None:
    length = response.headers.get("Content-Length")
    return offset + int(length) if length and length.isdigit() else None


def reason(exc: BaseException) -> str:
    """What went wrong, in a few words."""
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return str(exc) or type(exc).__name__
