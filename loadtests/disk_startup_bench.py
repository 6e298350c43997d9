"""`baton bench disk --startup-gib 1 16`: how long a disk tier takes to start on a directory
holding that many GiB of checkpoint files.

The files are real signed blobs of one random 64 MiB state, sealed once (each file has its
own tokens and prefix hash, so each is valid in full), written, fsync'd and dropped from the
page cache, so that a start reads from the device. A start reads and authenticates each
file's head (a few KB) and measures the device's read speed once (a 16 MiB probe). For
comparison, reading and validating every file in full — what a start did before — is timed
too. The directory grows from one size to the next and is deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import secrets
import tempfile
import time
from pathlib import Path

import numpy as np

from baton_serve.cache_store.checkpoints.checkpoint import Checkpoint
from baton_serve.cache_store.checkpoints.disk_tier import SUFFIX, DiskTier
from baton_serve.cache_store.checkpoints.state_blob import (
    decode_blob,
    decode_head,
    encode_parts,
    seal_payload,
)
from baton_serve.cache_store.prefix_hash import PrefixHasher
from baton_serve.loadtests.bench_common import bench_progress, print_report
from baton_serve.loadtests.progress import SILENT, Progress

STATE_BYTES = 64 << 20
TOKENS_PER_FILE = 512


class _Blobs:
    """Valid checkpoint files of one model and key, made cheaply (one sealed state)."""

    def __init__(self) -> None:
        self.key, self.fingerprint = secrets.token_bytes(32), secrets.token_bytes(32)
        self.hasher = PrefixHasher(self.fingerprint, block_tokens=16)
        self.state = np.random.default_rng(0).bytes(STATE_BYTES)
        self.seal = seal_payload(self.key, self.state)

    def write(self, folder: Path, index: int) -> int:
        tokens = np.arange(index * TOKENS_PER_FILE, (index + 1) * TOKENS_PER_FILE, dtype=np.int32)
        prefix_hash = self.hasher.prefix_hash(tokens)
        head, state = encode_parts(
            fingerprint=self.fingerprint,
            prefix_hash=prefix_hash,
            tokens=tokens,
            state=self.state,
            key=self.key,
            seal=self.seal,
        )
        fd = os.open(folder / f"{prefix_hash.hex()}{SUFFIX}", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for part in (memoryview(head), state):
                while part:
                    part = part[os.write(fd, part) :]
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the device later
        finally:
            os.close(fd)
        return len(head) + len(state)

    def tier(self, root: Path, budget: int) -> DiskTier:
        return DiskTier(
            root,
            self.fingerprint,
            budget,
            encode=lambda checkpoint: b"",  # never writes
            decode=self.decode,
            decode_head=lambda head: decode_head(
                head, key=self.key, fingerprint=self.fingerprint, hasher=self.hasher
            ),
        )

    def decode(self, data: bytes) -> Checkpoint:
        blob = decode_blob(data, key=self.key, fingerprint=self.fingerprint, hasher=self.hasher)
        return Checkpoint(blob.prefix_hash, blob.tokens, blob.state)


def _drop_page_cache(folder: Path) -> None:
    for path in folder.glob(f"*{SUFFIX}"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _full_validation_s(blobs: _Blobs, folder: Path) -> float:
    """Read and validate every file in full (what a start did before heads-only starts)."""
    started = time.perf_counter()
    for path in folder.glob(f"*{SUFFIX}"):
        blobs.decode(path.read_bytes())
    return time.perf_counter() - started


def startup_benchmark(
    sizes_gib: list[float],
    root: str | None = None,
    progress: Progress = SILENT,
    *,
    full: bool = True,
) -> dict:
    """Start-up seconds of a disk tier on `sizes_gib` GiB of files each (under `root`);
    with `full`, also the seconds to read and validate every file in full."""
    blobs, rows, written, count, file_bytes = _Blobs(), [], 0, 0, 0
    progress.start(len(sizes_gib))
    with tempfile.TemporaryDirectory(prefix="baton-startup-bench-", dir=root) as temporary:
        top = Path(temporary)
        blobs.tier(top, 0).close()  # claims and releases the directory a start adopts
        (folder,) = (top / blobs.fingerprint.hex()[:16]).iterdir()
        for gib in sorted(sizes_gib):
            progress.step(f"writing {gib:g} GiB of checkpoint files", done=len(rows))
            while written < gib * (1 << 30):
                file_bytes = blobs.write(folder, count)
                written, count = written + file_bytes, count + 1
            _drop_page_cache(folder)
            progress.step(f"starting on {gib:g} GiB, then reading it all")
            started = time.perf_counter()
            tier = blobs.tier(top, written)
            start_s = time.perf_counter() - started
            files = len(tier.entries())
            tier.close()
            _drop_page_cache(folder)
            full_s = _full_validation_s(blobs, folder) if full else None
            rows.append(
                {
                    "gib": written / (1 << 30),
                    "files": files,
                    "start_s": start_s,
                    "full_validation_s": full_s,
                }
            )
    return {"file_bytes": file_bytes, "rows": rows}


def format_startup_report(result: dict) -> str:
    lines = [
        f"disk tier start-up, files of {result['file_bytes'] / (1 << 20):.0f} MiB "
        "(page cache dropped)",
        f"{'GiB':>6} {'files':>6} {'start s':>8} {'full read + validate s':>23}",
    ]
    for row in result["rows"]:
        full = row["full_validation_s"]
        lines.append(
            f"{row['gib']:>6.1f} {row['files']:>6} {row['start_s']:>8.3f}"
            f" {'' if full is None else f'{full:.3f}':>23}"
        )
    lines.append(
        "a start reads each file's head and probes the read speed once; the state is "
        "validated in full when a file is loaded"
    )
    return "\n".join(lines)


def run_startup_bench(args: argparse.Namespace) -> int:
    """`baton bench disk --startup-gib ... [--startup-dir DIR] [--json]`."""
    with bench_progress(args, "disk") as progress:
        result = startup_benchmark(args.startup_gib, args.startup_dir, progress)
    print_report(args, result, format_startup_report(result), [])
    return 0
