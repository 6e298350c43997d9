"""What the benchmark tests check of a plot file: a PNG with something in it."""

from __future__ import annotations

from pathlib import Path

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    assert path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC, path
