"""Download a file once, resumably, and verified: under `hf://` models and the chart's model
init container.

`fetch` streams a URL into `DEST.partial` — resuming a partial file an interrupted run left,
with an HTTP `Range` request — checks its SHA-256 and renames it to DEST. `DEST.sha256` (the
`sha256sum` format) records the verified digest, so a later run trusts DEST without hashing it
again (unless DEST is newer than the record). `file_lock` keeps the processes and pods sharing
one directory from downloading the same file at once (`fcntl.flock` on `DEST.lock`).
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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from urllib.parse import urljoin, urlsplit

CHUNK_BYTES = 1 << 20
TIMEOUT_S = 60.0
ATTEMPTS = 3  # requests per fetch: a dropped connection is resumed up to twice
RETRY_DELAY_S = 2.0  # times the attempt number
MAX_REDIRECTS = 10
REDIRECTS = frozenset({301, 302, 303, 307, 308})
SHA256_HEX = re.compile(r"[0-9a-f]{64}")

log = logging.getLogger(__name__)


class ModelDownloadError(ValueError):
    """A model file that cannot be downloaded, or whose content has not the expected SHA-256."""


class HTTPStatusError(ModelDownloadError):
    """The server answered an error status."""

    def __init__(self, url: str, status: int, reason: str, headers: Message) -> None:
        super().__init__(f"{url}: HTTP {status} {reason}")
        self.url = url
        self.status = status
        self.headers = headers


@dataclass(frozen=True)
class Source:
    """Where a file comes from. `token` goes as a bearer token to `url`'s own host only, never
    to another host a redirect leads to; with `etag_sha256`, the first answer's `X-Linked-Etag`
    (else `ETag`), when it is 64 hex digits, is the content's SHA-256 (the Hugging Face hub's
    LFS files)."""

    url: str
    token: str | None = None
    etag_sha256: bool = False

    def server_sha256(self, headers: Message) -> str | None:
        if not self.etag_sha256:
            return None
        etag = headers.get("X-Linked-Etag") or headers.get("ETag") or ""
        etag = etag.removeprefix("W/").strip('"').lower()
        return etag if SHA256_HEX.fullmatch(etag) else None


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # a redirect is an HTTPError: `open_url` follows it itself


_OPENER = urllib.request.build_opener(_NoRedirects)


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc.lower()


def open_url(
    source: Source,
    *,
    method: str = "GET",
    headers: Mapping[str, str] | None = None,
    follow: bool = True,
    timeout_s: float = TIMEOUT_S,
) -> tuple[Message, http.client.HTTPResponse]:
    """Open `source`, following redirects if `follow`; return the first answer's headers and
    the last answer. An error status raises `HTTPStatusError`; no answer, an `OSError`."""
    url, first = source.url, None
    for _ in range(MAX_REDIRECTS + 1):
        request = urllib.request.Request(url, method=method, headers=dict(headers or {}))
        if source.token and _origin(url) == _origin(source.url):
            request.add_unredirected_header("Authorization", f"Bearer {source.token}")
        try:
            response = _OPENER.open(request, timeout=timeout_s)
        except urllib.error.HTTPError as exc:
            with exc:
                if exc.code not in REDIRECTS or not exc.headers.get("Location"):
                    raise HTTPStatusError(url, exc.code, exc.reason, exc.headers) from None
                first = first or exc.headers
                if not follow:
                    return first, exc
                url = urljoin(url, exc.headers["Location"])
            continue
        return first or response.headers, response
    raise ModelDownloadError(f"{source.url}: more than {MAX_REDIRECTS} redirects")


def head(source: Source, *, timeout_s: float = TIMEOUT_S) -> Message:
    """The headers of a HEAD request's first answer (no redirect followed)."""
    try:
        headers, response = open_url(source, method="HEAD", follow=False, timeout_s=timeout_s)
    except (OSError, http.client.HTTPException) as exc:
        raise ModelDownloadError(f"cannot reach {source.url}: {_reason(exc)}") from None
    response.close()
    return headers


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


def fetch(
    source: Source, dest: Path, sha256: str | None = None, *, timeout_s: float = TIMEOUT_S
) -> str:
    """Download `source` into `dest` through `dest.partial` (resumed if there is one), verify
    its SHA-256 — `sha256` if given, else the server's — and record it; return the digest.
    The caller holds `file_lock(dest)`."""
    partial = _sibling(dest, ".partial")
    sha256 = sha256.lower() if sha256 else None
    failure = "no attempt"
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(RETRY_DELAY_S * attempt)
        try:
            digest, expected, resumed = _fetch_once(source, partial, sha256, timeout_s)
        except HTTPStatusError as exc:
            if exc.status < 500 and exc.status not in (408, 416, 429):
                raise
            if exc.status == 416:  # the partial file is not a prefix of this content
                partial.unlink(missing_ok=True)
            failure = str(exc)
            continue
        except (OSError, http.client.HTTPException) as exc:  # the partial file is kept
            failure = _reason(exc)
            log.warning("download of %s interrupted: %s", source.url, failure)
            continue
        if digest == expected:
            partial.replace(dest)
            _sibling(dest, ".sha256").write_text(f"{digest}  {dest.name}\n")
            return digest
        partial.unlink()
        mismatch = f"{source.url}: sha256 {digest} != expected {expected}"
        if not resumed:
            raise ModelDownloadError(mismatch)
        failure = mismatch + " (after resuming a partial file)"  # stale: start again
    raise ModelDownloadError(f"cannot download {source.url}: {failure}")


def _fetch_once(
    source: Source, partial: Path, sha256: str | None, timeout_s: float
) -> tuple[str, str, bool]:
    """One request: append to `partial` (or rewrite it); return (digest of the whole partial
    file, the expected digest, whether it was resumed)."""
    offset = partial.stat().st_size if partial.is_file() else 0
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    first, response = open_url(source, headers=headers, timeout_s=timeout_s)
    with response:
        server = source.server_sha256(first)
        if sha256 and server and server != sha256:
            raise ModelDownloadError(
                f"{source.url}: the server's sha256 {server} != expected {sha256}"
            )
        expected = sha256 or server
        if not expected:
            raise ModelDownloadError(
                f"{source.url}: the server gives no SHA-256 of the file (X-Linked-Etag/ETag); "
                "pass the expected one (--sha256)"
            )
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
            log.info("downloading %s (%s bytes)", source.url, total)
        with partial.open("ab" if resumed else "wb") as out:
            while chunk := response.read(CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
                offset += len(chunk)
    if total is not None and offset < total:
        raise ConnectionError(f"connection closed after {offset} of {total} bytes")
    return digest.hexdigest(), expected, resumed


def _range_start(response: http.client.HTTPResponse) -> int | None:
    """Where a 206 answer's `Content-Range: bytes START-END/TOTAL` starts; None for others."""
    match = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", response.headers.get("Content-Range", ""))
    return int(match[1]) if getattr(response, "status", None) == 206 and match else None


def _total_bytes(response: http.client.HTTPResponse, offset: int) -> int | None:
    length = response.headers.get("Content-Length")
    return offset + int(length) if length and length.isdigit() else None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return str(exc) or type(exc).__name__
