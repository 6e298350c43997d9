"""The disk tier's directory: checking it, claiming a subdirectory, measuring its speed,
writing a file durably, reading one back.

Whoever can write to a directory can plant a symbolic link where a file will be written
(making this process overwrite what the link points to) or swap the files. So every
directory the tier uses must be this user's own, not a link, and writable by nobody else
(`private_dir`: a start refuses anything else, naming the path and the problem); files are
created with `O_EXCL` and opened with `O_NOFOLLOW`, and one that is not a regular file is
never read.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import stat
import time
from pathlib import Path

LOCK_FILE = "lock"
MAX_SUBDIRS = 1024
PROBE_BYTES = 16 << 20
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600  # a file holds a prompt's tokens
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a planted FIFO must not wait for a writer (no effect on regular files).
_EXISTING_FILE = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class DiskTierError(ValueError):
    """The checkpoint directory cannot be used; the message says which and why."""


class NotRegularFile(OSError):
    """A path the tier would read or lock is not a regular file (a link, a FIFO...)."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(f"{path.name} is {what}")


def check_checkpoint_dir(path: str | Path) -> Path:
    """Create `path` (mode 0700) if needed, check that it is private (`private_dir`) and
    that a file can be written there; raise `DiskTierError`."""
    root = Path(path).expanduser().absolute()
    private_dir(root)
    probe = root / f".baton-probe-{os.getpid()}"
    try:
        probe.unlink(missing_ok=True)  # left by a crash (unlink never follows a link)
        os.close(create_file(probe))
        probe.unlink()
    except OSError as exc:
        raise _unusable(root, exc) from None
    return root


def private_dir(folder: Path) -> None:
    """Create `folder` (mode 0700, with any missing parents) unless it exists, and check
    that it is a directory, not a symbolic link, owned by this process's user and writable
    by nobody else; raise `DiskTierError` naming the path and the problem."""
    try:
        try:
            folder.mkdir(mode=PRIVATE_DIR_MODE, parents=True)
        except FileExistsError:
            pass
        info = os.lstat(folder)
    except OSError as exc:
        raise _unusable(folder, exc) from None
    problem = _unsafe_dir(info)
    if problem is not None:
        raise DiskTierError(f"cannot use checkpoint directory {folder}: {problem}")


def _unsafe_dir(info: os.stat_result) -> str | None:
    """What makes a directory with this `lstat` unsafe to keep checkpoints in, if anything."""
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link; give the directory itself"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory"
    if info.st_uid != os.geteuid():
        return (
            f"it belongs to uid {info.st_uid}, not to this process's uid {os.geteuid()};"
            " chown it or choose a directory of this user"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"it is writable by its group or by others (mode {stat.S_IMODE(info.st_mode):o});"
            " chmod go-w it"
        )
    return None


def _unusable(folder: Path, exc: OSError) -> DiskTierError:
    return DiskTierError(f"cannot use checkpoint directory {folder}: {exc.strerror or exc}")


def create_file(path: Path) -> int:
    """A new file at `path` (mode 0600), open for writing: never an existing one, never
    through a symbolic link (`FileExistsError` then)."""
    return os.open(path, _NEW_FILE, PRIVATE_FILE_MODE)


def open_regular(path: Path, flags: int = os.O_RDONLY) -> int:
    """`path` opened with `flags` if it is a regular file; `NotRegularFile` if it is not (a
    symbolic link is never followed)."""
    try:
        fd = os.open(path, flags | _EXISTING_FILE, PRIVATE_FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFile(path, "a symbolic link") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(path, "not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path) -> bytes:
    """The whole of the regular file at `path`, never read through a symbolic link."""
    with os.fdopen(open_regular(path), "rb") as file:
        return file.read()


def claim_subdir(model_dir: Path) -> tuple[Path, int]:
    """Lock the first free subdirectory `model_dir/<n>` (each checked by `private_dir`); its
    lock is held until closed."""
    private_dir(model_dir)
    for n in range(MAX_SUBDIRS):
        folder = model_dir / str(n)
        private_dir(folder)
        try:
            fd = open_regular(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise _unusable(folder, exc) from None
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
    path.unlink(missing_ok=True)  # left by a crash
    try:
        fd = create_file(path)
        try:
            os.write(fd, data)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drop it from the page cache
        finally:
            os.close(fd)
        started = time.perf_counter()
        hashlib.sha256(read_regular(path)).digest()
        seconds = time.perf_counter() - started
    finally:
        path.unlink(missing_ok=True)
    return PROBE_BYTES / max(seconds, 1e-6)


def write_durably(path: Path, data: bytes | memoryview) -> None:
    """Write `data` to `path` (mode 0600) so that it is there after a crash once this
    returns: to a new temporary file (`create_file`: whatever was planted at its name fails
    the write, and is removed), fsync'd, renamed over `path` (a link there is replaced, not
    followed), and the directory fsync'd (a rename is only durable once its directory is)."""
    temporary = path.with_suffix(".tmp")
    try:
        fd = create_file(temporary)
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
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
