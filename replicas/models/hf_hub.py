"""Hugging Face model references, `hf://ORG/REPO/PATH[@REVISION]`, downloaded once into a cache.

A reference resolves like the hub's own clients: `{HF_ENDPOINT}/ORG/REPO/resolve/REVISION/PATH`
(`HF_ENDPOINT` defaults to https://huggingface.co, REVISION to `main`), with `HF_TOKEN` — else
the token in the file `HF_TOKEN_PATH` (default `$HF_HOME/token`, as `huggingface-cli login`
writes it; a mounted Secret) — sent as a bearer token to the endpoint's host only, not to the
CDN the hub redirects LFS files to. The hub's `X-Linked-Etag` of an LFS file is its SHA-256:
the download is checked against it, or against an explicit `sha256`, which wins.

The file lands in `CACHE/hf/ORG/REPO/REVISION/PATH`, shared by the processes and pods that
mount CACHE (see `download`). A commit hash or an explicit `sha256` pins the content: a cached,
verified file is used without any request. Any other revision (`main`, a tag) may move: one
HEAD request compares the hub's SHA-256 with the cached file's, and the file is downloaded
again only when it changed; when the hub cannot be reached, the cached file is used.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from baton_serve.replicas.models.download import (
    SHA256_HEX,
    TIMEOUT_S,
    HTTPStatusError,
    ModelDownloadError,
    Source,
    fetch,
    file_lock,
    head,
    verified_sha256,
)

HF_PREFIX = "hf://"
DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"
COMMIT = re.compile(r"[0-9a-f]{40}")
FORMAT = "hf://ORG/REPO/PATH/FILE.gguf[@REVISION]"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HfRef:
    """A file in a Hugging Face model repository, at a revision (branch, tag or commit)."""

    org: str
    repo: str
    path: str
    revision: str = DEFAULT_REVISION

    @property
    def repo_id(self) -> str:
        return f"{self.org}/{self.repo}"

    @property
    def pinned(self) -> bool:
        """Whether the revision is a commit hash: its content never changes."""
        return COMMIT.fullmatch(self.revision) is not None

    def __str__(self) -> str:
        return f"{HF_PREFIX}{self.repo_id}/{self.path}@{self.revision}"

    def url(self, endpoint: str) -> str:
        revision = quote(self.revision, safe="")
        return f"{endpoint.rstrip('/')}/{self.repo_id}/resolve/{revision}/{quote(self.path)}"

    def cache_path(self, cache_dir: Path) -> Path:
        return cache_dir / "hf" / self.org / self.repo / quote(self.revision, safe="") / self.path


def parse_hf_ref(spec: str, revision: str | None = None) -> HfRef:
    """`hf://ORG/REPO/PATH[@REVISION]` → `HfRef`; `revision` is the same as an `@REVISION`."""
    if not spec.startswith(HF_PREFIX):
        raise ValueError(f"{spec!r} is not a Hugging Face reference ({FORMAT})")
    body, at, inline = spec[len(HF_PREFIX) :].partition("@")
    if at and revision and inline != revision:
        raise ValueError(f"{spec!r}: revision {inline!r} in the reference, {revision!r} given")
    revision = inline if at else (revision or DEFAULT_REVISION)
    parts = body.split("/")
    if len(parts) < 3 or any(p in ("", ".", "..") or "\\" in p for p in parts):
        raise ValueError(f"{spec!r}: expected {FORMAT}")
    if revision in ("", ".", ".."):
        raise ValueError(f"{spec!r}: invalid revision {revision!r}")
    return HfRef(parts[0], parts[1], "/".join(parts[2:]), revision)


def hf_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT


def hf_token() -> str | None:
    """`HF_TOKEN`, else the content of the file `HF_TOKEN_PATH` (default `$HF_HOME/token`)."""
    if token := os.environ.get("HF_TOKEN", "").strip():
        return token
    if explicit := os.environ.get("HF_TOKEN_PATH"):
        path = Path(explicit).expanduser()
        try:
            return path.read_text().strip() or None
        except OSError as exc:
            raise ModelDownloadError(f"cannot read HF_TOKEN_PATH {path}: {exc.strerror}") from None
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    try:
        return (home / "token").read_text().strip() or None
    except OSError:
        return None


def hub_download(
    ref: HfRef, cache_dir: Path, *, sha256: str | None = None, timeout_s: float = TIMEOUT_S
) -> Path:
    """The cached file of `ref` under `cache_dir`, downloaded and verified if needed."""
    expected = sha256.lower() if sha256 else None
    if expected and not SHA256_HEX.fullmatch(expected):
        raise ValueError(f"sha256 must be 64 hex digits, got {sha256!r}")
    dest = ref.cache_path(cache_dir)
    endpoint = hf_endpoint().rstrip("/")
    source = Source(ref.url(endpoint), token=hf_token(), etag_sha256=True)
    try:
        with file_lock(dest):
            cached = verified_sha256(dest)
            if cached is None or not _current(ref, source, cached, expected, timeout_s):
                fetch(source, dest, expected, timeout_s=timeout_s)
    except HTTPStatusError as exc:
        if not exc.url.startswith(endpoint + "/"):  # the CDN's answer, not the hub's
            raise
        raise _hub_error(ref, exc) from None
    return dest


def _current(
    ref: HfRef, source: Source, cached: str, expected: str | None, timeout_s: float
) -> bool:
    """Whether the cached file (SHA-256 `cached`) is the content `ref` names now."""
    if expected:
        return cached == expected
    if ref.pinned:
        return True
    try:
        headers = head(source, timeout_s=timeout_s)
    except HTTPStatusError:
        raise
    except ModelDownloadError as exc:
        log.warning("%s: %s; using the cached file", ref, exc)
        return True
    return source.server_sha256(headers) == cached


def _hub_error(ref: HfRef, exc: HTTPStatusError) -> ModelDownloadError:
    """One line on what the hub's error status means for `ref`."""
    code = exc.headers.get("X-Error-Code", "")
    if code == "GatedRepo":
        problem = (
            f"{ref.repo_id} is gated: accept its conditions on the hub with the token's account"
        )
    elif exc.status in (401, 403):
        problem = f"needs a token (HF_TOKEN) or the token cannot read {ref.repo_id}"
    elif exc.status == 404 and code == "RevisionNotFound":
        problem = f"no revision {ref.revision} in {ref.repo_id}"
    elif exc.status == 404:
        problem = f"no file {ref.path} in {ref.repo_id} at revision {ref.revision}"
    else:
        return exc
    return ModelDownloadError(f"{ref}: {problem} (HTTP {exc.status})")
