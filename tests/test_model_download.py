"""The Helm chart's model init container: download a file (a URL, or an hf:// reference into a\nshared cache), keep it only if its SHA-256 matches."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_hub import COMMIT, FakeHub, serve_hub

from baton_serve.deploy.model_download import ModelDownloadError, download_model, main
from baton_serve.replicas.models import download

CONTENT = b"GGUF" + bytes(range(256)) * 4096


@pytest.fixture(autouse=True)
def no_retry_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(download, "RETRY_DELAY_S", 0.0)


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


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    fake = FakeHub()
    fake.add("org/repo/model.gguf", CONTENT)
    with serve_hub(fake):
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield fake


def test_command_line_hf_reference(
    tmp_path: Path, hub: FakeHub, capsys: pytest.CaptureFixture[str]
) -> None:
    """The chart's form: into a shared cache, with a link where the replicas load the model."""
    cache, link = tmp_path / "cache", tmp_path / "models" / "model.gguf"
    args = ["hf://org/repo/model.gguf", "--cache", str(cache), "--link", str(link)]
    assert main([*args, "--revision", "main"]) == 0
    cached = cache / "hf/models--org--repo/snapshots" / hub.head / "model.gguf"
    assert f"{cached}: {len(CONTENT)} bytes, sha256 verified" in capsys.readouterr().out
    assert link.is_symlink() and link.resolve() == cached.resolve()
    assert link.read_bytes() == CONTENT
    assert main([*args, "--sha256", "0" * 64]) == 1
    assert "!= expected 0000" in capsys.readouterr().err
    assert link.read_bytes() == CONTENT  # a failed run leaves the link as it was
    assert main(["hf://org/repo/missing.gguf", "--cache", str(cache)]) == 1
    assert "no file missing.gguf in org/repo at revision main" in capsys.readouterr().err


def test_command_line_default_cache(
    tmp_path: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    assert main(["hf://org/repo/model.gguf@" + COMMIT]) == 0
    cached = tmp_path / "models/hf/models--org--repo/snapshots" / COMMIT / "model.gguf"
    assert cached.read_bytes() == CONTENT


@pytest.mark.parametrize(
    "argv",
    [
        ["hf://org/repo/model.gguf", "0" * 64, "dest.gguf"],
        ["https://example.com/model.gguf", "0" * 64],
        ["https://example.com/model.gguf", "0" * 64, "dest.gguf", "--revision", "v1"],
    ],
)
def test_command_line_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2


def test_command_line_conflicting_revisions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hf://org/repo/model.gguf@a", "--revision", "b"]) == 1
    assert "revision 'a' in the reference, 'b' given" in capsys.readouterr().err


def test_a_partial_url_download_is_resumed(tmp_path: Path, hub: FakeHub) -> None:
    """The URL form shares the machinery: an interrupted download goes on from its partial file."""
    dest = tmp_path / "model.gguf"
    dest.with_name("model.gguf.partial").write_bytes(CONTENT[:1000])
    url = f"{hub.url}/cdn/{hashlib.sha256(CONTENT).hexdigest()}"
    assert download_model(url, hashlib.sha256(CONTENT).hexdigest(), dest).read_bytes() == CONTENT
    (request,) = hub.requests("GET", "/cdn/")
    assert request.headers["Range"] == "bytes=1000-"
