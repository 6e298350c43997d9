"""Hugging Face model references, `hf://ORG/REPO/PATH[@REVISION]`, fetched with `huggingface_hub`.

A file the user already has in their Hugging Face cache (`HF_HUB_CACHE`, default
`$HF_HOME/hub`, read by huggingface_hub at import: what `hf download` and the HF libraries
fill) is used as it is, without any request. Otherwise `hf_hub_download` fetches it into
Baton's shared cache `CACHE/hf`, in the hub's cache layout (`models--ORG--REPO/snapshots/
COMMIT/PATH`, a link to `blobs/ETAG`): resuming an `.incomplete` blob, one download per blob
under a file lock across processes and pods, the token sent to the hub's host only, never to
the CDN it redirects to. A commit revision is answered from the cache without a request;
`main` or a tag costs one HEAD (downloaded again only when the file changed; when the hub
cannot be reached, the cached file is used).

What Baton adds to the library: the endpoint and token are read when called (`HF_ENDPOINT`;
`HF_TOKEN`, else the file `HF_TOKEN_PATH`, else `$HF_HOME/token` — the library reads these
once at import and passes over an unreadable token file, which would then look like a missing
token); every download is checked against its SHA-256 — an explicit `sha256`, which wins, else
the hub's (an LFS blob's ETag is its SHA-256) — where the library only checks the size; a
dropped connection is resumed up to `ATTEMPTS` times; and the hub's errors are one line.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from huggingface_hub import (
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    try_to_load_from_cache,
)
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name

from baton_serve.replicas.models import download
from baton_serve.replicas.models.download import (
    SHA256_HEX,
    TIMEOUT_S,
    ModelDownloadError,
    file_sha256,
    reason,
    record_sha256,
    verified_sha256,
)

HF_PREFIX = "hf://"
DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"
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

    def __str__(self) -> str:
        return f"{HF_PREFIX}{self.repo_id}/{self.path}@{self.revision}"


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
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


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
    """The file `ref` names: the user's cached copy, else Baton's under `cache_dir/hf`,
    downloaded and verified if needed."""
    expected = sha256.lower() if sha256 else None
    if expected and not SHA256_HEX.fullmatch(expected):
        raise ValueError(f"sha256 must be 64 hex digits, got {sha256!r}")
    if found := _cached(ref, None, expected):  # the user's own HF cache
        return found
    hub_cache = cache_dir / "hf"
    if expected and (found := _cached(ref, hub_cache, expected)):
        return found  # pinned by its digest: no request
    url = hf_hub_url(ref.repo_id, ref.path, revision=ref.revision, endpoint=hf_endpoint())
    token = hf_token() or False  # False: no token, not the one the library finds itself
    try:
        if expected:
            _check_hub_digest(url, token, expected, timeout_s)
        return _fetch(ref, hub_cache, url, token, expected, timeout_s)
    except (HfHubHTTPError, LocalEntryNotFoundError) as exc:
        raise _hub_error(ref, url, exc) from None


def _cached(ref: HfRef, hub_cache: Path | None, expected: str | None) -> Path | None:
    """`ref`'s file in a hub cache (None: the user's), if there and of SHA-256 `expected`."""
    found = try_to_load_from_cache(
        ref.repo_id, ref.path, cache_dir=hub_cache, revision=ref.revision
    )
    if not isinstance(found, str):
        return None
    path = Path(found)
    if expected and _content_sha256(path, trust_name=hub_cache is None) != expected:
        return None
    return path


def _content_sha256(path: Path, *, trust_name: bool) -> str:
    """A cached file's SHA-256: in the user's cache, its LFS blob's name; in Baton's, the
    digest recorded when it was verified (else hashed)."""
    blob = path.resolve()
    if not trust_name:
        return verified_sha256(blob) or ""
    return blob.name if SHA256_HEX.fullmatch(blob.name) else file_sha256(blob).hexdigest()


def _check_hub_digest(url: str, token: str | bool, expected: str, timeout_s: float) -> None:
    """Refuse before downloading when the hub's SHA-256 is not `expected`."""
    try:
        etag = get_hf_file_metadata(url, token=token, timeout=timeout_s).etag or ""
    except httpx.TransportError:
        return  # `_fetch` tells what is wrong with the connection
    if SHA256_HEX.fullmatch(etag) and etag != expected:
        raise ModelDownloadError(f"{url}: the server's sha256 {etag} != expected {expected}")


def _fetch(
    ref: HfRef,
    hub_cache: Path,
    url: str,
    token: str | bool,
    expected: str | None,
    timeout_s: float,
) -> Path:
    """`hf_hub_download` into `hub_cache`, retried and verified."""
    blobs = hub_cache / repo_folder_name(repo_id=ref.repo_id, repo_type="model") / "blobs"
    failure = "no attempt"
    for attempt in range(download.ATTEMPTS):
        if attempt:
            time.sleep(download.RETRY_DELAY_S * attempt)
        resumed = any(blobs.glob("*.incomplete"))
        try:
            path = Path(
                hf_hub_download(
                    ref.repo_id,
                    ref.path,
                    revision=ref.revision,
                    cache_dir=hub_cache,
                    endpoint=hf_endpoint(),
                    token=token,
                    etag_timeout=timeout_s,
                )
            )
        except RuntimeError as exc:
            if "client has been closed" not in str(exc):
                raise
            # huggingface_hub < 1.27 retries an unreachable hub on the HTTP client it has just
            # closed; the dev extra holds it there (guidellm 0.3 pins click < 8.2).
            raise ModelDownloadError(f"cannot download {url}: {_unreachable(url)}") from None
        except HfHubHTTPError as exc:
            if exc.response.status_code != 416:  # 416: the partial blob is longer than the file
                raise
            for partial in blobs.glob("*.incomplete"):
                partial.unlink()
            failure = str(exc).splitlines()[0]
            continue
        except (httpx.TransportError, OSError) as exc:  # the `.incomplete` blob is kept
            if isinstance(exc, LocalEntryNotFoundError):
                raise  # the library has retried reaching the hub already
            failure = reason(exc)
            log.warning("download of %s interrupted: %s", url, failure)
            continue
        mismatch = _verify(path, url, expected)
        if mismatch is None:
            return path
        if not resumed:
            raise ModelDownloadError(mismatch)
        failure = mismatch + " (after resuming a partial file)"  # stale: start again
    raise ModelDownloadError(f"cannot download {url}: {failure}")


def _unreachable(url: str) -> str:
    """Why the hub at `url` cannot be reached, asked again."""
    try:
        get_hf_file_metadata(url, token=False)
    except httpx.TransportError as exc:
        return reason(exc)
    except HfHubHTTPError:
        pass
    return "the hub could not be reached"


def _verify(path: Path, url: str, expected: str | None) -> str | None:
    """None when the downloaded `path` has the expected SHA-256 (recorded then); else why
    not, with the file gone from the cache."""
    blob = path.resolve()
    want = expected or (blob.name if SHA256_HEX.fullmatch(blob.name) else None)
    got = verified_sha256(blob) if want else None
    if want and got == want:
        record_sha256(blob, got)
        return None
    blob.unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    if not want:
        raise ModelDownloadError(
            f"{url}: the server gives no SHA-256 of the file (X-Linked-Etag/ETag); "
            "pass the expected one (--sha256)"
        )
    return f"{url}: sha256 {got} != expected {want}"


def _hub_error(ref: HfRef, url: str, exc: HfHubHTTPError | LocalEntryNotFoundError) -> Exception:
    """One line on what the hub's answer means for `ref`."""
    if isinstance(exc, LocalEntryNotFoundError):  # the hub could not be reached
        return ModelDownloadError(f"cannot download {url}: {reason(exc.__cause__ or exc)}")
    status = exc.response.status_code
    if isinstance(exc, GatedRepoError):
        problem = (
            f"{ref.repo_id} is gated: accept its conditions on the hub with the token's account"
        )
    elif isinstance(exc, RevisionNotFoundError):
        problem = f"no revision {ref.revision} in {ref.repo_id}"
    elif isinstance(exc, RemoteEntryNotFoundError):
        problem = f"no file {ref.path} in {ref.repo_id} at revision {ref.revision}"
    elif status in (401, 403) or isinstance(exc, RepositoryNotFoundError):
        problem = f"needs a token (HF_TOKEN) or the token cannot read {ref.repo_id}"
    else:
        return ModelDownloadError(f"cannot download {url}: {str(exc).splitlines()[0]}")
    return ModelDownloadError(f"{ref}: {problem} (HTTP {status})")
