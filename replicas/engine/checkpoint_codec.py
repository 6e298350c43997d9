"""Signed state blobs of one engine's checkpoints (`state_blob`), and their last check.

A checkpoint's state is sealed once — in the background after it is saved, or by its
first export — so an export signs only a header and the token ids. A blob is validated
completely (the blob's own checks, then the exact state size this engine measured) before
llama.cpp sees a byte of it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from baton_serve.cache_store.checkpoints.checkpoint import Checkpoint
from baton_serve.cache_store.checkpoints.state_blob import (
    ALL_CORES,
    BlobError,
    BlobHead,
    BlobParts,
    Buffer,
    byte_view,
    decode_blob,
    decode_head,
    encode_blob,
    encode_parts,
    seal_payload,
)
from baton_serve.cache_store.prefix_hash import PrefixHasher
from baton_serve.replicas.engine.stats import EngineStats

logger = logging.getLogger(__name__)


class CheckpointCodec:
    """Encodes and checks the blobs of one model's checkpoints (thread-safe)."""

    def __init__(
        self,
        fingerprint: bytes,
        hasher: PrefixHasher,
        hmac_key: bytes,
        state_size: tuple[int, int] | None,
        stats: EngineStats,
    ) -> None:
        self.fingerprint = fingerprint
        self.hasher = hasher
        self.state_size = state_size  # (fixed, per token); None where it is not linear
        self.stats = stats
        self._key = hmac_key
        # Off the engine thread: sealing releases the GIL.
        self._sealer = ThreadPoolExecutor(1, thread_name_prefix="baton-blob-seal")
        # Where a replica can share states with peers without a copy per export (Ray's
        # object store): sets a new checkpoint's `shared` and `state`, in the background.
        self.share: Callable[[Checkpoint], None] | None = None

    def seal_later(self, checkpoint: Checkpoint) -> None:
        """Seal a new checkpoint's state in the background (on one core: the engine's own
        threads come first) and share it, ready for its exports."""
        self._sealer.submit(self._prepare_export, checkpoint)

    def _prepare_export(self, checkpoint: Checkpoint) -> None:
        try:
            _fill_seal(checkpoint, self._key, 1)
            if self.share is not None:
                self.share(checkpoint)
        except Exception:  # its exports seal it or copy it then: slower, still correct
            logger.exception("preparing a checkpoint for export failed")

    def parts(self, checkpoint: Checkpoint) -> tuple[bytes, memoryview]:
        """The signed blob of `checkpoint` as `(head, state)`, the state not copied."""
        started = time.perf_counter()
        parts = encode_parts(**self._fields(checkpoint))
        self.stats.blobs_exported += 1
        self.stats.exported_bytes += len(parts[0]) + parts[1].nbytes
        self.stats.blob_export_seconds += time.perf_counter() - started
        return parts

    def blob(self, checkpoint: Checkpoint) -> bytes:
        """The signed blob of `checkpoint` in one piece (a disk tier's file)."""
        return encode_blob(**self._fields(checkpoint))

    def _fields(self, checkpoint: Checkpoint) -> dict[str, Any]:
        _fill_seal(checkpoint, self._key)  # usually done already, in the background
        return {
            "fingerprint": self.fingerprint,
            "prefix_hash": checkpoint.prefix_hash,
            "tokens": checkpoint.tokens,
            "state": checkpoint.state,
            "key": self._key,
            "seal": checkpoint.seal,
        }

    def checked(self, blob: Buffer | BlobParts) -> Checkpoint:
        """The checkpoint in `blob` (contiguous, or its two parts); `BlobError` for anything
        that is not an authentic, intact blob of this model."""
        started = time.perf_counter()
        state = decode_blob(blob, key=self._key, fingerprint=self.fingerprint, hasher=self.hasher)
        self._check_state_size(state.n_tokens, len(state.state))
        self.stats.blob_validate_seconds += time.perf_counter() - started
        return Checkpoint(
            prefix_hash=state.prefix_hash,
            tokens=state.tokens,
            state=state.state,
            seal=state.seal,
        )

    def checked_head(self, head: Buffer) -> BlobHead:
        """A blob's head (header and token ids) checked as far as it can be without its
        state: what a disk tier's start reads. `checked` must still pass before use."""
        found = decode_head(head, key=self._key, fingerprint=self.fingerprint, hasher=self.hasher)
        self._check_state_size(found.n_tokens, found.state_len)
        return found

    def _check_state_size(self, n_tokens: int, state_len: int) -> None:
        if self.state_size is not None:
            fixed, per_token = self.state_size
            expected = fixed + per_token * n_tokens
            if state_len != expected:
                raise BlobError(
                    "bad_state_size",
                    f"a {n_tokens}-token state of this model is {expected} bytes, "
                    f"the blob carries {state_len}",
                )


def _fill_seal(checkpoint: Checkpoint, key: bytes, threads: int = ALL_CORES) -> None:
    if checkpoint.seal is None:
        checkpoint.seal = seal_payload(key, checkpoint.state, threads=threads)


def frozen(blob: Buffer | BlobParts) -> Buffer | BlobParts:
    """`blob` where it is read-only; a private copy of each writable part otherwise (so that
    nobody can change it after it was checked)."""
    try:
        if isinstance(blob, tuple):
            return tuple(part if byte_view(part).readonly else bytes(part) for part in blob)
        return blob if byte_view(blob).readonly else bytes(blob)
    except (TypeError, ValueError):
        return blob  # not a buffer at all: `decode_blob` says so
