"""Download a model file and check its SHA-256: the Helm chart's model init container.

`python -m baton_serve.deploy.model_download URL SHA256 DEST` streams URL into `DEST.partial`, hashing as
it goes, and renames it to DEST only when the digest matches. A file already at DEST with the
right digest is kept (an init container that restarts does not download again).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

CHUNK_BYTES = 1 << 20
TIMEOUT_S = 60.0


class ModelDownloadError(RuntimeError):
    """The download failed or its content does not have the expected SHA-256."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def download_model(url: str, sha256: str, dest: Path, *, timeout_s: float = TIMEOUT_S) -> Path:
    """Make `dest` hold the content of `url` whose SHA-256 is `sha256` (hex); return `dest`."""
    expected = sha256.lower()
    if dest.is_file() and file_sha256(dest) == expected:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response, partial.open("wb") as out:
            while chunk := response.read(CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
    except OSError as exc:  # URLError and HTTPError are OSErrors
        partial.unlink(missing_ok=True)
        raise ModelDownloadError(f"cannot download {url}: {exc}") from None
    if digest.hexdigest() != expected:
        partial.unlink()
        raise ModelDownloadError(f"{url}: sha256 {digest.hexdigest()} != expected {expected}")
    partial.replace(dest)
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m baton_serve.deploy.model_download", description=__doc__
    )
    parser.add_argument("url")
    parser.add_argument("sha256", help="expected SHA-256 of the file, hex")
    parser.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    try:
        path = download_model(args.url, args.sha256, args.dest)
    except ModelDownloadError as exc:
        print(f"model_download: error: {exc}", file=sys.stderr)
        return 1
    print(f"{path}: {path.stat().st_size} bytes, sha256 verified")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
