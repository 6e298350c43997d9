"""Download a model file and check its SHA-256: the Helm chart's model init container.

    python -m baton_serve.deploy.model_download URL SHA256 DEST
    python -m baton_serve.deploy.model_download hf://ORG/REPO/PATH[@REV] [--revision REV]
        [--sha256 HEX] [--cache DIR] [--link PATH]

A URL is streamed into `DEST.partial`, hashing as it goes, and renamed to DEST only when the
digest matches; a file already at DEST with that digest is kept. A Hugging Face reference is
found in the user's Hugging Face cache, else downloaded with `huggingface_hub` into the shared
cache `DIR/hf` (the hub's cache layout; default `$BATON_CACHE_DIR/models`, where
`baton serve --model hf://...` looks) and checked against the hub's SHA-256 or `--sha256`;
`--link` points a symlink at the cached file. Both resume an interrupted download and wait for
another process downloading the same file.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from baton_serve.replicas.models.download import (
    TIMEOUT_S,
    ModelDownloadError,
    fetch,
    file_lock,
    verified_sha256,
)
from baton_serve.replicas.models.hf_hub import HF_PREFIX, hub_download, parse_hf_ref
from baton_serve.replicas.models.model_source import model_cache_dir

__all__ = ["ModelDownloadError", "download_model", "main"]


def download_model(url: str, sha256: str, dest: Path, *, timeout_s: float = TIMEOUT_S) -> Path:
    """Make `dest` hold the content of `url` whose SHA-256 is `sha256` (hex); return `dest`."""
    with file_lock(dest):
        if verified_sha256(dest) != sha256.lower():
            fetch(url, dest, sha256, timeout_s=timeout_s)
    return dest


def link_to(target: Path, link: Path) -> None:
    """Make `link` a symlink to `target`, replacing whatever is there in one rename."""
    link.parent.mkdir(parents=True, exist_ok=True)
    staged = link.with_name(f".{link.name}.{os.getpid()}.link")
    staged.unlink(missing_ok=True)
    staged.symlink_to(target.absolute())
    staged.replace(link)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m baton_serve.deploy.model_download",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", metavar="URL|hf://ORG/REPO/PATH[@REV]")
    parser.add_argument("sha256_arg", nargs="?", metavar="SHA256", help="a URL's SHA-256, hex")
    parser.add_argument("dest", nargs="?", type=Path, metavar="DEST", help="where a URL goes")
    hub = parser.add_argument_group("hf:// references")
    hub.add_argument("--revision", help="branch, tag or commit (default: @REV, else main)")
    hub.add_argument("--sha256", help="expected SHA-256 (default: the hub's; wins over it)")
    hub.add_argument(
        "--cache", type=Path, default=model_cache_dir(), help="shared cache (default: %(default)s)"
    )
    hub.add_argument("--link", type=Path, help="a symlink to make, pointing at the cached file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    is_hub = args.source.startswith(HF_PREFIX)
    if is_hub and (args.sha256_arg or args.dest):
        parser.error("an hf:// reference takes --sha256, --cache and --link, not SHA256 DEST")
    if not is_hub and not (args.sha256_arg and args.dest):
        parser.error("a URL needs SHA256 and DEST")
    if not is_hub and (args.revision or args.sha256 or args.link):
        parser.error("--revision, --sha256 and --link are for hf:// references")
    try:
        if is_hub:
            ref = parse_hf_ref(args.source, args.revision)
            path = hub_download(ref, args.cache, sha256=args.sha256)
        else:
            path = download_model(args.source, args.sha256_arg, args.dest)
    except (ValueError, OSError) as exc:  # ModelDownloadError is a ValueError
        print(f"model_download: error: {exc}", file=sys.stderr)
        return 1
    print(f"{path}: {path.stat().st_size} bytes, sha256 verified")
    if is_hub and args.link:
        link_to(path, args.link)
        print(f"{args.link} -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
