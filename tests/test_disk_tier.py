"""The disk tier on real files: spilling, lookups across tiers, the budget, damaged files,
durable writes, a start that reads heads only, shared directories. The states are random
bytes in real signed blobs (the engine's own checks are in test_disk_restart.py)."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from baton_serve.cache_store.checkpoints.checkpoint_store import Checkpoint, CheckpointStore
from baton_serve.cache_store.checkpoints.disk_dir import PROBE_BYTES, DiskTierError
from baton_serve.cache_store.checkpoints.disk_tier import DiskEntry, DiskTier
from baton_serve.cache_store.checkpoints.state_blob import (
    BlobHead,
    decode_blob,
    decode_head,
    encode_blob,
)
from baton_serve.cache_store.prefix_hash import PrefixHasher

MODEL = b"m" * 32
OTHER_MODEL = b"o" * 32
KEY = b"disk-tier-test-key"
HASHER = PrefixHasher(MODEL, block_tokens=4)


def checkpoint(first: int, n_tokens: int = 8, state_bytes: int = 1_000) -> Checkpoint:
    tokens = list(range(first, first + n_tokens))
    state = np.random.default_rng(first).bytes(state_bytes)
    return Checkpoint(HASHER.prefix_hash(tokens), np.array(tokens), state)


def blob(cp: Checkpoint, key: bytes = KEY, model: bytes = MODEL) -> bytes:
    return encode_blob(
        fingerprint=model, prefix_hash=cp.prefix_hash, tokens=cp.tokens, state=cp.state, key=key
    )


def decode(data: bytes) -> Checkpoint:
    state = decode_blob(data, key=KEY, fingerprint=MODEL, hasher=HASHER)
    return Checkpoint(state.prefix_hash, state.tokens, bytes(state.state))


def decode_head_only(head: bytes) -> BlobHead:
    return decode_head(head, key=KEY, fingerprint=MODEL, hasher=HASHER)


def tier(root: Path, budget: int = 100_000) -> DiskTier:
    return DiskTier(root, MODEL, budget, encode=blob, decode=decode, decode_head=decode_head_only)


def wait_written(disk: DiskTier, count: int) -> None:
    deadline = time.monotonic() + 10
    while sum(isinstance(e, DiskEntry) for e in disk.entries()) < count:
        assert time.monotonic() < deadline, "the writer thread never wrote the files"
        time.sleep(0.01)


def files(disk: DiskTier) -> list[Path]:
    return sorted(disk.dir.glob("*.ckpt"))


def test_evicted_checkpoints_spill_to_disk_and_come_back(tmp_path: Path) -> None:
    evicted: list = []
    disk = tier(tmp_path)
    store = CheckpointStore(2_500, on_evict=evicted.append, disk=disk)  # two fit in RAM
    a, b, c = checkpoint(0), checkpoint(100), checkpoint(200)
    for cp in (a, b, c):
        store.put(cp)
    wait_written(disk, 1)
    assert [f.name for f in files(disk)] == [f"{a.prefix_hash.hex()}.ckpt"]
    assert evicted == [] and store.checkpoints() == [b, c]
    assert a.prefix_hash in store and len(store.entries()) == 3

    # a lookup that only estimates sees the file without reading it
    found = store.longest_match(HASHER, a.tokens.tolist() + [7, 7], 100, touch=False)
    assert isinstance(found, DiskEntry) and found.n_tokens == 8
    # a real lookup reads it back, bit-exact, into RAM (evicting b to disk)
    restored = store.longest_match(HASHER, a.tokens.tolist() + [7, 7], 100)
    assert isinstance(restored, Checkpoint) and restored.state == a.state
    assert [cp.prefix_hash for cp in store.checkpoints()] == [c.prefix_hash, a.prefix_hash]
    wait_written(disk, 2)
    assert store.get(b.prefix_hash).state == b.state  # get reads from disk too
    shared, n = store.longest_shared_prefix(c.tokens.tolist()[:5] + [0], 100)
    assert shared is not None and shared.prefix_hash == c.prefix_hash and n == 5
    assert evicted == []
    store.close()


def test_the_disk_budget_is_kept_and_only_what_leaves_both_tiers_is_evicted(
    tmp_path: Path,
) -> None:
    evicted: list = []
    file_bytes = len(blob(checkpoint(0)))
    disk = tier(tmp_path, budget=3 * file_bytes)
    store = CheckpointStore(1_100, on_evict=evicted.append, disk=disk)  # one in RAM
    made = [checkpoint(100 * i) for i in range(6)]
    for cp in made:
        store.put(cp)
        time.sleep(0.02)
    wait_written(disk, 3)
    deadline = time.monotonic() + 10
    while len(evicted) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert disk.used_bytes <= disk.budget_bytes
    assert sum(f.stat().st_size for f in files(disk)) <= 3 * file_bytes
    assert {e.prefix_hash for e in evicted} == {made[0].prefix_hash, made[1].prefix_hash}
    assert all(cp.prefix_hash in store for cp in made[2:])
    store.close()


@pytest.mark.parametrize(
    "damage",
    ["truncated", "bit_flipped", "foreign_key", "other_model", "not_a_blob", "misnamed"],
)
def test_damaged_or_foreign_files_are_deleted_with_a_log_line_never_loaded(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A damage the head shows is caught at the start; a flipped bit in the state only when
    the file is loaded (a start reads heads only): then the load is a miss."""
    good, bad = checkpoint(0), checkpoint(100)
    first = tier(tmp_path)
    first.spill(good)
    first.spill(bad)
    first.close()
    path = first.dir / f"{bad.prefix_hash.hex()}.ckpt"
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:-100])
    elif damage == "bit_flipped":
        flipped = bytearray(data)
        flipped[-10] ^= 0x01
        path.write_bytes(bytes(flipped))
    elif damage == "foreign_key":
        path.write_bytes(blob(bad, key=b"another-cluster-key"))
    elif damage == "other_model":
        path.write_bytes(blob(bad, model=OTHER_MODEL))
    elif damage == "not_a_blob":
        path.write_bytes(b"#!/bin/sh\nrm -rf /\n")
    else:
        path.rename(first.dir / f"{'00' * 16}.ckpt")
    (first.dir / "leftover.tmp").write_bytes(b"half a file")

    with caplog.at_level(logging.WARNING, logger="baton.disk"):
        adopted = tier(tmp_path)
        if damage == "bit_flipped":
            assert len(adopted.entries()) == 2 and "deleting" not in caplog.text
            dropped: list = []
            adopted.on_drop = dropped.append
            assert adopted.load(bad.prefix_hash) is None  # a miss: never handed out
            assert [e.prefix_hash for e in dropped] == [bad.prefix_hash]
    assert adopted.dir == first.dir
    assert [e.prefix_hash for e in adopted.entries()] == [good.prefix_hash]
    assert files(adopted) == [adopted.dir / f"{good.prefix_hash.hex()}.ckpt"]
    assert not list(adopted.dir.glob("*.tmp"))
    assert "deleting checkpoint file" in caplog.text
    assert adopted.load(good.prefix_hash).state == good.state
    adopted.close()


def test_a_file_and_its_directory_are_fsynced_before_its_entry_is_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """os.fsync is wrapped (and still called): a test cannot crash the machine to show the
    file survives, so it records what each fsync was for, and whether the entry that lookups
    and a restart's republishing see was already listed then."""
    disk = tier(tmp_path)  # its read-speed probe fsyncs too: before the wrapper
    cp = checkpoint(0)
    real_fsync, synced = os.fsync, []

    def fsync(fd: int) -> None:
        listed = any(isinstance(e, DiskEntry) for e in disk.entries())
        real_fsync(fd)
        synced.append((Path(os.readlink(f"/proc/self/fd/{fd}")), listed))

    monkeypatch.setattr(os, "fsync", fsync)
    disk.spill(cp)
    wait_written(disk, 1)
    name = cp.prefix_hash.hex()
    assert synced == [(disk.dir / f"{name}.tmp", False), (disk.dir, False)]
    assert files(disk) == [disk.dir / f"{name}.ckpt"]
    assert files(disk)[0].stat().st_mode & 0o777 == 0o600  # it holds a prompt's tokens
    disk.close()


def test_a_start_reads_each_files_head_not_its_state(tmp_path: Path) -> None:
    """Bytes this process read (/proc/self/io `rchar`) while a tier adopts three 16 MiB
    files: the heads and the fixed-size read-speed probe, not the states."""
    first = tier(tmp_path, budget=1 << 30)
    made = [checkpoint(100 * i, state_bytes=16 << 20) for i in range(3)]
    for cp in made:
        first.spill(cp)
    first.close()

    def bytes_read() -> int:
        io = Path("/proc/self/io").read_text().split()
        return int(io[io.index("rchar:") + 1])

    before = bytes_read()
    adopted = tier(tmp_path, budget=1 << 30)
    read = bytes_read() - before
    assert sorted(e.prefix_hash for e in adopted.entries()) == sorted(c.prefix_hash for c in made)
    assert read < PROBE_BYTES + (1 << 20), f"a start read {read} bytes"
    assert adopted.load(made[1].prefix_hash).state == made[1].state  # validated in full now
    adopted.close()


def test_a_file_damaged_after_adoption_is_deleted_when_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    evicted: list = []
    cp = checkpoint(0)
    first = tier(tmp_path)
    first.spill(cp)
    first.close()
    store = CheckpointStore(10_000, on_evict=evicted.append, disk=tier(tmp_path))
    path = files(store.disk)[0]
    path.write_bytes(path.read_bytes()[:-1])  # truncated while the replica runs
    with caplog.at_level(logging.WARNING, logger="baton.disk"):
        assert store.longest_match(HASHER, cp.tokens.tolist() + [1, 2], 100) is None
    assert not path.exists() and cp.prefix_hash not in store
    assert [e.prefix_hash for e in evicted] == [cp.prefix_hash]  # the index is told
    assert "deleting checkpoint file" in caplog.text
    store.close()


def test_replicas_sharing_a_directory_claim_their_own_and_a_restart_adopts_a_free_one(
    tmp_path: Path,
) -> None:
    one, two = tier(tmp_path), tier(tmp_path)
    assert one.dir != two.dir and one.dir.parent == two.dir.parent == tmp_path / MODEL.hex()[:16]
    cp = checkpoint(0)
    one.spill(cp)
    one.close()
    again = tier(tmp_path)  # `two` still holds its directory
    assert again.dir == one.dir and [e.prefix_hash for e in again.entries()] == [cp.prefix_hash]
    two.close()
    again.close()


def test_writes_happen_off_the_calling_thread(tmp_path: Path) -> None:
    writers: set[str] = set()

    def encode(cp: Checkpoint) -> bytes:
        writers.add(threading.current_thread().name)
        return blob(cp)

    disk = DiskTier(
        tmp_path, MODEL, 100_000, encode=encode, decode=decode, decode_head=decode_head_only
    )
    disk.spill(checkpoint(0))
    wait_written(disk, 1)
    disk.close()
    assert writers == {"baton-disk"}


def test_an_unusable_directory_is_one_clear_error(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(DiskTierError, match="cannot use checkpoint directory .*file"):
        tier(a_file / "sub")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(DiskTierError, match="Permission denied"):
            tier(locked)
    with pytest.raises(ValueError, match="disk budget"):
        tier(tmp_path, budget=-1)
