"""`hf://` models (huggingface_hub) against a local fake hub over real HTTP: redirects, tokens,
the hub's SHA-256, resumed downloads, one download per shared cache, the user's own HF cache,
and the hub's errors as one line."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_hub import COMMIT, TOKEN, FakeHub, serve_hub
from huggingface_hub import constants as hf_constants

from baton_serve.deploy.config import BatonConfig, ConfigError, load_config
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.models import download
from baton_serve.replicas.models.download import ModelDownloadError
from baton_serve.replicas.models.hf_hub import hub_download, parse_hf_ref
from baton_serve.replicas.models.model_source import resolve_model
from baton_serve.replicas.models.tiny_model import write_tiny_model

CONTENT = b"GGUF" + bytes(range(256)) * 4096
SHA = hashlib.sha256(CONTENT).hexdigest()
RESOLVE = "/org/repo/resolve/"
CHUNK = 1 << 16
REPO = "hf/models--org--repo"  # the hub's cache layout, under Baton's cache


def snapshot(cache: Path, commit: str, path: str = "model.gguf") -> Path:
    return cache / REPO / "snapshots" / commit / path


def blob(cache: Path, suffix: str = "") -> Path:
    return cache / REPO / "blobs" / (SHA + suffix)


@pytest.fixture(autouse=True)
def hub_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("HF_TOKEN", "HF_TOKEN_PATH", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token file of the user's
    # nor a cache of the user's (huggingface_hub reads HF_HOME once, at import)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    monkeypatch.setattr(download, "RETRY_DELAY_S", 0.0)
    # the library writes whole chunks (10 MiB): smaller ones, so that a cut file has a part
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    fake = FakeHub()
    fake.add("org/repo/model.gguf", CONTENT)
    with serve_hub(fake):
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


def get(ref: str, cache: Path, **kwargs: str) -> Path:
    return hub_download(parse_hf_ref(ref), cache, **kwargs)


def test_downloads_into_the_cache_and_verifies(hub: FakeHub, tmp_path: Path) -> None:
    path = get("hf://org/repo/model.gguf", tmp_path)
    assert path == snapshot(tmp_path, hub.head)
    assert path.read_bytes() == CONTENT and path.resolve() == blob(tmp_path)
    assert not blob(tmp_path, ".incomplete").exists()
    assert [(s.method, s.path) for s in hub.seen] == [
        ("HEAD", f"{RESOLVE}main/model.gguf"),
        ("GET", f"/cdn/{SHA}"),
    ]


def test_nested_path_and_revision(hub: FakeHub, tmp_path: Path) -> None:
    hub.add("org/repo/q4/model-q4.gguf", b"quantised")
    path = get(f"hf://org/repo/q4/model-q4.gguf@{COMMIT}", tmp_path)
    assert path == snapshot(tmp_path, COMMIT, "q4/model-q4.gguf")
    assert parse_hf_ref("hf://org/repo/m.gguf", "v1") == parse_hf_ref("hf://org/repo/m.gguf@v1")


@pytest.mark.parametrize(
    "spec", ["hf://org/model.gguf", "hf://org/repo/../x.gguf", "hf://org//x.gguf", "hf://o/r/x@"]
)
def test_malformed_references(spec: str) -> None:
    with pytest.raises(ValueError, match="hf://"):
        parse_hf_ref(spec)
    with pytest.raises(ValueError, match="revision 'a' in the reference, 'b' given"):
        parse_hf_ref("hf://org/repo/x.gguf@a", "b")


def test_token_goes_to_the_hub_not_to_the_cdn(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.private.add("org/repo")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert get("hf://org/repo/model.gguf", tmp_path).read_bytes() == CONTENT
    (resolve,) = hub.requests("HEAD", RESOLVE)
    (cdn,) = hub.requests("GET", "/cdn/")
    assert resolve.headers["Authorization"] == f"Bearer {TOKEN}"
    assert "Authorization" not in cdn.headers


def test_token_from_a_file(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.private.add("org/repo")
    secret = tmp_path / "secret" / "token"
    secret.parent.mkdir()
    secret.write_text(TOKEN + "\n")
    monkeypatch.setenv("HF_TOKEN_PATH", str(secret))
    assert get("hf://org/repo/model.gguf", tmp_path / "cache").read_bytes() == CONTENT
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "missing"))
    with pytest.raises(ModelDownloadError, match="cannot read HF_TOKEN_PATH"):
        get("hf://org/repo/model.gguf", tmp_path / "other")


def test_hub_errors_are_one_line(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.private.add("org/repo")
    with pytest.raises(ModelDownloadError) as caught:
        get("hf://org/repo/model.gguf", tmp_path)
    assert str(caught.value) == (
        "hf://org/repo/model.gguf@main: needs a token (HF_TOKEN) or the token cannot read "
        "org/repo (HTTP 401)"
    )
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(ModelDownloadError, match="the token cannot read org/repo"):
        get("hf://org/repo/model.gguf", tmp_path)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(ModelDownloadError) as caught:
        get("hf://org/repo/nope.gguf", tmp_path)
    assert str(caught.value) == (
        "hf://org/repo/nope.gguf@main: no file nope.gguf in org/repo at revision main (HTTP 404)"
    )
    with pytest.raises(ModelDownloadError, match="no revision v9 in org/repo"):
        get("hf://org/repo/model.gguf@v9", tmp_path)
    assert not list(tmp_path.rglob("*.gguf"))


def test_no_network_names_the_url_and_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with serve_hub(FakeHub()) as closed:
        url = closed.url
    monkeypatch.setenv("HF_ENDPOINT", url)
    with pytest.raises(ModelDownloadError) as caught:
        get("hf://org/repo/model.gguf", tmp_path)
    message = str(caught.value)
    assert message.startswith(f"cannot download {url}/org/repo/resolve/main/model.gguf: ")
    assert "refused" in message


def test_resumes_a_dropped_download_with_range(hub: FakeHub, tmp_path: Path) -> None:
    hub.cut_after = 300_000
    assert get("hf://org/repo/model.gguf", tmp_path).read_bytes() == CONTENT
    first, second = hub.requests("GET", "/cdn/")
    assert "Range" not in first.headers
    assert second.headers["Range"] == f"bytes={300_000 // CHUNK * CHUNK}-"


def test_resumes_after_a_restart(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An init container killed mid-file: the next run hashes the partial file and asks for
    the rest."""
    monkeypatch.setattr(download, "ATTEMPTS", 1)
    hub.cut_after = 123_456
    with pytest.raises(ModelDownloadError, match="cannot download .*: peer closed connection"):
        get("hf://org/repo/model.gguf", tmp_path)
    partial = blob(tmp_path, ".incomplete")
    kept = partial.stat().st_size
    assert kept == 123_456 // CHUNK * CHUNK
    path = get("hf://org/repo/model.gguf", tmp_path)
    assert path.read_bytes() == CONTENT
    assert hub.requests("GET", "/cdn/")[-1].headers["Range"] == f"bytes={kept}-"
    assert not partial.exists()


def test_a_server_ignoring_range_restarts_from_zero(hub: FakeHub, tmp_path: Path) -> None:
    hub.ranges = False
    partial = blob(tmp_path, ".incomplete")
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"stale bytes of an older attempt")
    assert get("hf://org/repo/model.gguf", tmp_path).read_bytes() == CONTENT


def test_a_stale_partial_file_is_dropped(hub: FakeHub, tmp_path: Path) -> None:
    partial = blob(tmp_path, ".incomplete")
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"bytes of another version of the file")
    assert get("hf://org/repo/model.gguf", tmp_path).read_bytes() == CONTENT
    assert len(hub.requests("GET", "/cdn/")) == 2  # resumed, mismatched, then from zero


def test_wrong_checksums_leave_no_file(hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(ModelDownloadError) as caught:
        get("hf://org/repo/model.gguf", tmp_path, sha256="0" * 64)
    assert f"sha256 {SHA} != expected {'0' * 64}" in str(caught.value)
    hub.corrupt = True
    with pytest.raises(ModelDownloadError) as caught:
        get("hf://org/repo/model.gguf", tmp_path)
    corrupted = hashlib.sha256(b"X" + CONTENT[1:]).hexdigest()
    assert f"sha256 {corrupted} != expected {SHA}" in str(caught.value)
    assert not snapshot(tmp_path, hub.head).exists()
    assert not list((tmp_path / REPO / "blobs").iterdir())


def test_without_the_hubs_digest_an_explicit_one_is_required(hub: FakeHub, tmp_path: Path) -> None:
    hub.etag = False  # a file outside LFS: its ETag is a git blob id
    with pytest.raises(ModelDownloadError, match=r"gives no SHA-256.*--sha256"):
        get("hf://org/repo/model.gguf", tmp_path)
    assert get("hf://org/repo/model.gguf", tmp_path, sha256=SHA.upper()).read_bytes() == CONTENT


def test_concurrent_downloads_of_one_file_download_once(hub: FakeHub, tmp_path: Path) -> None:
    hub.delay_s = 0.3
    paths: list[Path] = []
    threads = [
        threading.Thread(target=lambda: paths.append(get("hf://org/repo/model.gguf", tmp_path)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(paths) == 3 and len(set(paths)) == 1
    assert paths[0].read_bytes() == CONTENT
    assert len(hub.requests("GET", "/cdn/")) == 1


def test_a_cached_file_is_reused(hub: FakeHub, tmp_path: Path) -> None:
    get(f"hf://org/repo/model.gguf@{COMMIT}", tmp_path)
    get("hf://org/repo/model.gguf", tmp_path)
    hub.seen.clear()
    get(f"hf://org/repo/model.gguf@{COMMIT}", tmp_path)  # pinned: no request at all
    get("hf://org/repo/model.gguf", tmp_path, sha256=SHA)  # pinned by its digest
    assert hub.seen == []
    get("hf://org/repo/model.gguf", tmp_path)  # main may move: one HEAD, no GET
    assert [s.method for s in hub.seen] == ["HEAD"]


def test_a_moved_branch_is_downloaded_again(hub: FakeHub, tmp_path: Path) -> None:
    get("hf://org/repo/model.gguf", tmp_path)
    hub.add("org/repo/model.gguf", b"a newer version")
    assert get("hf://org/repo/model.gguf", tmp_path).read_bytes() == b"a newer version"


def test_an_unreachable_hub_keeps_the_cached_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with serve_hub(FakeHub()) as hub:
        hub.add("org/repo/model.gguf", CONTENT)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        get("hf://org/repo/model.gguf", tmp_path)
    assert get("hf://org/repo/model.gguf", tmp_path).read_bytes() == CONTENT


def users_cache(hub_cache: Path, commit: str = COMMIT) -> Path:
    """`hf://org/repo/model.gguf` as `hf download` leaves it in a user's cache."""
    repo = hub_cache / "models--org--repo"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / SHA).write_bytes(CONTENT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    link = repo / "snapshots" / commit / "model.gguf"
    link.parent.mkdir(parents=True)
    link.symlink_to(Path("../../blobs") / SHA)
    return link


def test_the_users_hf_cache_is_used_without_a_request(hub: FakeHub, tmp_path: Path) -> None:
    link = users_cache(tmp_path / "hf-home" / "hub")
    assert get("hf://org/repo/model.gguf", tmp_path / "baton") == link
    assert get(f"hf://org/repo/model.gguf@{COMMIT}", tmp_path / "baton", sha256=SHA) == link
    assert hub.seen == [] and not (tmp_path / "baton").exists()
    hub.add("org/repo/other.gguf", b"not in the user's cache")
    assert (
        get("hf://org/repo/other.gguf", tmp_path / "baton").read_bytes()
        == b"not in the user's cache"
    )


def test_a_model_in_the_users_hf_cache_needs_no_network(tmp_path: Path) -> None:
    """As a user runs it: HF_HOME set before the process starts, no hub to be reached."""
    link = users_cache(tmp_path / "home" / "hub")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(
        HF_HOME=str(tmp_path / "home"),
        HF_ENDPOINT="http://127.0.0.1:9",  # the discard port: nothing answers
        BATON_CACHE_DIR=str(tmp_path / "baton"),
    )
    code = "from baton_serve.replicas.models.model_source import resolve_model as r; "
    code += "print(r('hf://org/repo/model.gguf'))"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(link)
    assert not (tmp_path / "baton").exists()


def test_resolve_model_downloads_a_model_llama_cpp_loads(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = write_tiny_model("llama", tmp_path / "tiny.gguf")
    hub.add("org/repo/gguf/tiny-llama.gguf", tiny.read_bytes())
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "baton"))
    spec = "hf://org/repo/gguf/tiny-llama.gguf"
    assert BatonConfig(model=spec).model == spec
    path = resolve_model(spec)
    assert path == snapshot(tmp_path / "baton/models", hub.head, "gguf/tiny-llama.gguf")
    with LlamaModel(path) as model:
        assert model.n_vocab > 0
    assert resolve_model(spec) == path


def test_the_config_checks_the_reference_without_downloading() -> None:
    assert (
        load_config(env={}, overrides={"model": "hf://org/repo/m.gguf@v1"}).model
        == "hf://org/repo/m.gguf@v1"
    )
    with pytest.raises(ConfigError, match=r"model: .*expected hf://ORG/REPO/PATH"):
        load_config(env={}, overrides={"model": "hf://org/m.gguf"})
