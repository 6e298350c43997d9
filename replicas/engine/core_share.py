"""Cores shared by the replicas on one machine (`engine.node_cores`).

Replicas that split a machine's cores (`baton serve`'s local cluster: two replicas on two
cores get one thread each) leave a core idle whenever one of them has nothing to compute.
Each sharing replica publishes in a small file of a per-machine directory when its current
step started and its last step ended (`time.monotonic`, one clock for the whole machine).
Before a prompt step a replica counts the neighbours computing now or within
`IDLE_AFTER_S`, and computes on every core they leave: `node_cores` minus their threads,
never fewer than its own (`LlamaContext.decode`; decode steps keep their own threads). A
replica that gets work while a neighbour's step runs on its core shares the core until
that step ends; the neighbour's next step gives it back.

Files are named ``PID-THREADS-TAG``; a file whose process is gone is removed by the next
replica that scans the directory (a process that died in a step and whose PID was taken
since counts as busy until then). A directory that goes away (an operator's cleanup) ends the
sharing of every replica that finds it gone: it computes on its own threads from then on.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

STEP_TIMES = struct.Struct("<dd")  # step started, step ended (time.monotonic())
# A busy engine starts its next step ~1 ms after the last one; a stream's next request takes
# longer to arrive, so a neighbour idle for 50 ms lends its cores until it computes again.
IDLE_AFTER_S = 0.05
RESCAN_S = 1.0  # how often the directory is read again for replicas that came or went


def shared_directory() -> Path:
    """Where this machine's sharing replicas (of this user) publish their steps."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"baton-cores-{os.getuid()}"


class CoreShare:
    """One replica's part of the machine's cores: `own_threads`, and up to `node_cores`
    where the other sharing replicas are idle."""

    def __init__(self, own_threads: int, node_cores: int, directory: Path | None = None) -> None:
        self.own_threads = own_threads
        self.node_cores = node_cores
        self._directory = directory or shared_directory()
        self._directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._path = self._directory / f"{os.getpid()}-{own_threads}-{secrets.token_hex(4)}"
        self._mine = _map(self._path, writable=True)
        self._neighbours: dict[str, tuple[int, mmap.mmap]] = {}  # file name: threads, times
        self._scanned_at = -RESCAN_S

    def threads(self) -> int:
        """Threads for the next step: `node_cores` less the threads of busy neighbours."""
        now = time.monotonic()
        if now - self._scanned_at >= RESCAN_S:
            self._rescan()
            self._scanned_at = now
        busy = 0
        for threads, times in self._neighbours.values():
            started, ended = STEP_TIMES.unpack_from(times)
            if started > ended or now - ended < IDLE_AFTER_S:
                busy += threads
        return max(self.own_threads, self.node_cores - busy)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Publish a step's start and end."""
        _, ended = STEP_TIMES.unpack_from(self._mine)
        STEP_TIMES.pack_into(self._mine, 0, time.monotonic(), ended)
        try:
            yield
        finally:
            started, _ = STEP_TIMES.unpack_from(self._mine)
            STEP_TIMES.pack_into(self._mine, 0, started, time.monotonic())

    def close(self) -> None:
        for _, times in self._neighbours.values():
            times.close()
        self._neighbours.clear()
        self._mine.close()
        self._path.unlink(missing_ok=True)

    def _rescan(self) -> None:
        try:
            paths = list(self._directory.iterdir())
        except OSError:  # removed: the neighbours cannot be seen, nor see this replica
            paths = []
            self.node_cores = self.own_threads  # so lend nothing and borrow nothing
        present = set()
        for path in paths:
            if path == self._path or not (owner := _owner(path.name)):
                continue
            pid, threads = owner
            if not _alive(pid):
                path.unlink(missing_ok=True)
                continue
            present.add(path.name)
            if path.name not in self._neighbours:
                with contextlib.suppress(OSError, ValueError):  # gone, or not yet sized
                    self._neighbours[path.name] = (threads, _map(path, writable=False))
        for name in set(self._neighbours) - present:
            self._neighbours.pop(name)[1].close()


def _map(path: Path, *, writable: bool) -> mmap.mmap:
    if writable:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, STEP_TIMES.size)  # zeros: no step yet
    else:
        fd = os.open(path, os.O_RDONLY)
    try:
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        return mmap.mmap(fd, STEP_TIMES.size, access=access)
    finally:
        os.close(fd)


def _owner(name: str) -> tuple[int, int] | None:
    """(pid, threads) from a file name ``PID-THREADS-TAG``; None for any other name."""
    pid, threads, *_ = [*name.split("-"), "", ""]
    if not (pid.isdigit() and threads.isdigit()):
        return None
    return int(pid), int(threads)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
