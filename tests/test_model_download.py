"""The Helm chart's model init container: download a file, keep it only if its SHA-256 matches."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from baton_serve.deploy.model_download import ModelDownloadError, download_model, main

CONTENT = b"GGUF" + bytes(range(256)) * 4096


@pytest.fixture
def source(tmp_path: Path) -> tuple[str, str]:
    """A file:// URL of the content, and its SHA-256."""
    path = tmp_path / "source.gguf"
    path.write_bytes(CONTENT)
    return path.as_uri(), hashlib.sha256(CONTENT).hexdigest()


def test_downloads_and_verifies(tmp_path: Path, source: tuple[str, str]) -> None:
    url, sha256 = source
    dest = tmp_path / "models" / "model.gguf"
    assert download_model(url, sha256.upper(), dest) == dest
    assert dest.read_bytes() == CONTENT
    assert not dest.with_name("model.gguf.partial").exists()


def test_a_verified_file_is_kept(tmp_path: Path, source: tuple[str, str]) -> None:
    url, sha256 = source
    dest = tmp_path / "model.gguf"
    dest.write_bytes(CONTENT)
    download_model("file:///nonexistent/never-read.gguf", sha256, dest)
    assert dest.read_bytes() == CONTENT


def test_a_wrong_checksum_leaves_no_file(tmp_path: Path, source: tuple[str, str]) -> None:
    url, _ = source
    dest = tmp_path / "model.gguf"
    dest.write_bytes(b"a stale, different file")
    with pytest.raises(ModelDownloadError, match="sha256"):
        download_model(url, "0" * 64, dest)
    assert dest.read_bytes() == b"a stale, different file"
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_command_line(
    tmp_path: Path, source: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    url, sha256 = source
    dest = tmp_path / "model.gguf"
    assert main([url, sha256, str(dest)]) == 0
    assert "sha256 verified" in capsys.readouterr().out
    assert main([(tmp_path / "missing").as_uri(), sha256, str(tmp_path / "other.gguf")]) == 1
    assert "cannot download" in capsys.readouterr().err
