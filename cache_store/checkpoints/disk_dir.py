"""The disk tier's directory: checking it, claiming a subdirectory, measuring its speed,
writing a file durably."""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from pathlib import Path

LOCK_FILE = "lock"
MAX_SUBDIRS = 1024
PROBE_BYTES = 16 << 20


class DiskTierError(ValueError):
    """The checkpoint directory cannot be used; the message says which and why."""


def check_checkpoint_dir(path: str | Path) -> Path:
    """Create `path` if needed and check a file can be written there; raise `DiskTierError`."""
    root = Path(path).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".baton-probe-{os.getpid()}"
        probe.write_bytes(b"baton")
        probe.unlink()
    except OSError as exc:
        raise DiskTierError(
            f"cannot use checkpoint directory {root}: {exc.strerror or exc}"
        ) from None
    return root.absolute()


def claim_subdir(model_dir: Path) -> tuple[Path, int]:
    """Lock the first free subdirectory `model_dir/<n>`; its lock is held until closed."""
    for n in range(MAX_SUBDIRS):
        folder = model_dir / str(n)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise DiskTierError(
                f"cannot use checkpoint directory {folder}: {exc.strerror or exc}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return folder, fd
    raise DiskTierError(f"all {MAX_SUBDIRS} subdirectories of {model_dir} are in use")


def probe_read_speed(folder: Path) -> float:
    """Bytes per second of reading (from the device, not the page cache) and hashing a file:
    what restoring a checkpoint file costs besides the restore itself."""
    path = folder / ".read-probe"
    data = os.urandom(PROBE_BYTES)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drop it from the page cache
        finally:
            os.close(fd)
        started = time.perf_counter()
        hashlib.sha256(path.read_bytes()).digest()
        seconds = time.perf_counter() - started
    finally:
        path.unlink(missing_ok=True)
    return PROBE_BYTES / max(seconds, 1e-6)


def write_durably(path: Path, data: bytes | memoryview) -> None:
    """Write `data` to `path` (mode 0600) so that it is there after a crash once this
    returns: to a temporary name, fsync'd, renamed over `path`, and the directory fsync'd
    (a rename is only durable once its directory is)."""
    temporary = path.with_suffix(".tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make the directory entries of `folder` (a new or renamed file) durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
