"""The disk tier against a planted directory or planted files, on real files: a directory
that is a link, someone else's, or writable by others is refused at start, naming the path
and the problem; a link planted where a file will be written or read is never followed (its
target untouched); what is not a regular file is skipped with a log line."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_disk_tier import MODEL, blob, checkpoint, decode, decode_head_only, wait_written

from baton_serve.cache_store.checkpoints.disk_dir import DiskTierError
from baton_serve.cache_store.checkpoints.disk_tier import DiskTier

PRECIOUS = b"what the planted link points to"


def tier(root: Path) -> DiskTier:
    return DiskTier(root, MODEL, 100_000, encode=blob, decode=decode, decode_head=decode_head_only)


def precious(tmp_path: Path, name: str = "target") -> Path:
    target = tmp_path / name
    target.write_bytes(PRECIOUS)
    return target


def test_new_directories_are_private(tmp_path: Path) -> None:
    root = tmp_path / "new" / "checkpoints"
    disk = tier(root)
    for folder in (root, disk.dir.parent, disk.dir):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    disk.close()


@pytest.mark.parametrize(
    ("make_unsafe", "problem"),
    [
        (lambda d: d.chmod(0o777), r"it is writable by its group or by others \(mode 777\)"),
        (lambda d: d.chmod(0o770), r"it is writable by its group or by others \(mode 770\)"),
        (lambda d: os.chown(d, 65534, 65534), "it belongs to uid 65534, not to this process's uid"),
    ],
    ids=["world-writable", "group-writable", "foreign-owned"],
)
def test_an_unsafe_directory_is_refused_naming_it_and_the_problem(
    tmp_path: Path, make_unsafe, problem: str
) -> None:
    """The configured directory, and one the tier would use inside it (a planted model
    directory), each refused; the same directory made private is used."""
    if "uid" in problem and os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user")
    root = tmp_path / "checkpoints"
    root.mkdir(mode=0o700)
    make_unsafe(root)
    with pytest.raises(DiskTierError, match=f"checkpoint directory {root}: {problem}"):
        tier(root)
    os.chown(root, os.geteuid(), os.getegid())
    root.chmod(0o755)
    model_dir = root / MODEL.hex()[:16]
    model_dir.mkdir()
    make_unsafe(model_dir)  # planted before the tier made it
    with pytest.raises(DiskTierError, match=f"checkpoint directory {model_dir}: {problem}"):
        tier(root)
    os.chown(model_dir, os.geteuid(), os.getegid())
    model_dir.chmod(0o700)
    tier(root).close()


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    link = tmp_path / "checkpoints"
    link.symlink_to(elsewhere)
    with pytest.raises(DiskTierError, match=f"{link}: it is a symbolic link"):
        tier(link)
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    with pytest.raises(DiskTierError, match="dangling: it is a symbolic link"):
        tier(tmp_path / "dangling")
    root = tmp_path / "real"
    tier(root).close()
    subdir = root / MODEL.hex()[:16] / "0"
    os.rename(subdir, tmp_path / "moved")
    subdir.symlink_to(tmp_path / "moved")  # a subdirectory swapped for a link
    with pytest.raises(DiskTierError, match=f"{subdir}: it is a symbolic link"):
        tier(root)
    assert not list(elsewhere.iterdir())


def test_a_link_planted_where_a_file_will_be_written_is_not_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At a temporary file's name the write fails (and the link is removed: the next one
    succeeds); at a checkpoint file's name the link is replaced; at the read-speed probe's
    name it is removed. No target is written."""
    disk = tier(tmp_path / "checkpoints")
    first, second = checkpoint(0), checkpoint(100)
    at_temporary = disk.dir / f"{first.prefix_hash.hex()}.tmp"
    at_temporary.symlink_to(precious(tmp_path, "one"))
    at_file = disk.dir / f"{second.prefix_hash.hex()}.ckpt"
    at_file.symlink_to(precious(tmp_path, "two"))
    dropped: list = []
    disk.on_drop = dropped.append
    with caplog.at_level(logging.WARNING, logger="baton.disk"):
        disk.spill(first)
        disk.spill(second)
        wait_written(disk, 1)
        deadline = time.monotonic() + 10
        while not dropped and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [c.prefix_hash for c in dropped] == [first.prefix_hash]
    assert "could not write checkpoint file" in caplog.text and "File exists" in caplog.text
    assert not at_temporary.is_symlink() and not at_temporary.exists()
    assert not at_file.is_symlink() and stat.S_ISREG(at_file.lstat().st_mode)
    disk.spill(first)  # nothing planted now
    wait_written(disk, 2)
    assert disk.load(first.prefix_hash).state == first.state
    disk.close()

    probe = disk.dir / ".read-probe"
    probe.symlink_to(precious(tmp_path, "three"))
    lock = disk.dir / "lock"
    restarted = tier(tmp_path / "checkpoints")
    assert not probe.exists() and not probe.is_symlink()
    restarted.close()
    lock.unlink()
    lock.symlink_to(precious(tmp_path, "four"))
    with pytest.raises(DiskTierError, match="lock is a symbolic link"):
        tier(tmp_path / "checkpoints")
    for name in ("one", "two", "three", "four"):
        assert (tmp_path / name).read_bytes() == PRECIOUS


def test_entries_that_are_not_regular_files_are_skipped_never_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A link to a valid checkpoint file, a FIFO and a directory in the tier's directory: a
    start skips each with a log line (it does not hang on the FIFO) and adopts the rest; an
    adopted file swapped for a link is deleted when read, its target untouched."""
    first = tier(tmp_path / "checkpoints")
    kept, linked, swapped = checkpoint(0), checkpoint(100), checkpoint(200)
    for cp in (kept, swapped):
        first.spill(cp)
    first.close()
    folder = first.dir
    outside = tmp_path / "outside.ckpt"
    valid = blob(linked)  # adopted if the link to it were followed
    outside.write_bytes(valid)
    (folder / f"{linked.prefix_hash.hex()}.ckpt").symlink_to(outside)
    os.mkfifo(folder / f"{'ab' * 16}.ckpt")
    (folder / "leftover.tmp").mkdir()
    with caplog.at_level(logging.WARNING, logger="baton.disk"):
        adopted = tier(tmp_path / "checkpoints")
    assert sorted(e.prefix_hash for e in adopted.entries()) == sorted(
        [kept.prefix_hash, swapped.prefix_hash]
    )
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 3 and any("a symbolic link" in line for line in skipped)
    assert (folder / f"{linked.prefix_hash.hex()}.ckpt").is_symlink()  # left alone

    swapped_path = folder / f"{swapped.prefix_hash.hex()}.ckpt"
    swapped_path.unlink()
    swapped_path.symlink_to(outside)
    with caplog.at_level(logging.WARNING, logger="baton.disk"):
        assert adopted.load(swapped.prefix_hash) is None
    assert "is a symbolic link" in caplog.text and not swapped_path.is_symlink()
    assert outside.read_bytes() == valid
    assert adopted.load(kept.prefix_hash).state == kept.state
    adopted.close()


def test_baton_serve_refuses_an_unsafe_directory_in_one_line(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    done = subprocess.run(
        [sys.executable, "-m", "baton_serve.deploy.cli", "serve", "--model", "tiny:llama"]
        + ["--checkpoint-dir", str(shared)],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "BATON_CACHE_DIR": str(tmp_path),
            "BATON_HMAC_KEY": "a-fixed-cluster-key-for-tests",
        },
        timeout=300,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        f"baton: error: cannot use checkpoint directory {shared}: it is writable by its group"
        " or by others (mode 777); chmod go-w it"
    )
