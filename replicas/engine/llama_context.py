"""A llama.cpp context with several sequence slots: batched decode, memory edits, state I/O.

Everything here calls into llama.cpp and must run on the one thread that owns the context
(the engine loop).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import llama_cpp
import numpy as np

from baton_serve.replicas.engine.core_share import CoreShare
from baton_serve.replicas.engine.llama_model import LlamaModel

logger = logging.getLogger("baton.engine")


class DecodeError(RuntimeError):
    """llama_decode failed; `code` is its return value (1: no room in the KV cache)."""

    def __init__(self, code: int) -> None:
        reasons = {1: "no free KV cache slot for the batch", 2: "aborted", -1: "invalid batch"}
        super().__init__(f"llama_decode failed ({code}: {reasons.get(code, 'internal error')})")
        self.code = code


class StateRestoreError(RuntimeError):
    """llama.cpp refused a sequence state (for instance one from another model)."""


@dataclass(frozen=True)
class BatchEntry:
    """One token of a batch: which sequence, which position, whether its logits are needed."""

    seq_id: int
    token: int
    pos: int
    want_logits: bool


@dataclass(frozen=True)
class ContextParams:
    n_ctx_per_seq: int
    n_seqs: int
    n_batch: int
    n_threads: int
    flash_attn: bool | None = False  # None: llama.cpp's auto
    node_cores: int | None = None  # more than n_threads: share the machine's (`core_share`)


def context_params(params: ContextParams) -> llama_cpp.llama_context_params:
    """llama.cpp's context parameters for `params` (also used to measure a context
    before creating it: `device_memory`)."""
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = params.n_ctx_per_seq * params.n_seqs
    cparams.n_batch = params.n_batch
    # One physical batch per decode: llama.cpp never splits our batch into a 1-row tail.
    cparams.n_ubatch = params.n_batch
    cparams.n_seq_max = params.n_seqs
    cparams.n_threads = params.n_threads
    cparams.n_threads_batch = params.n_threads
    cparams.kv_unified = False
    cparams.flash_attn_type = {
        True: llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
        False: llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        None: llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
    }[params.flash_attn]
    cparams.no_perf = True
    return cparams


def _core_share(params: ContextParams) -> CoreShare | None:
    """The machine's cores to share, where `params` asks and the shared directory works."""
    if params.node_cores is None or params.node_cores <= params.n_threads:
        return None
    try:
        return CoreShare(params.n_threads, params.node_cores)
    except OSError as exc:
        logger.warning("not sharing the machine's idle cores: %s", exc)
        return None


class LlamaContext:
    """One `llama_context` holding `n_seqs` independent sequences (one KV stream each)."""

    def __init__(self, model: LlamaModel, params: ContextParams) -> None:
        self.model = model
        self.params = params
        cparams = context_params(params)
        pointer = llama_cpp.llama_init_from_model(model.pointer, cparams)
        if not pointer:
            raise RuntimeError("llama.cpp could not create a context (out of memory?)")
        self.pointer = pointer
        self.memory = llama_cpp.llama_get_memory(pointer)
        self.n_ctx_per_seq = llama_cpp.llama_n_ctx_seq(pointer)
        self._batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
        self._threads = params.n_threads
        self._cores = _core_share(params)

    def close(self) -> None:
        if self.pointer:
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self.pointer)
            self.pointer = None
        if self._cores is not None:
            self._cores.close()
            self._cores = None

    def decode(self, entries: list[BatchEntry]) -> None:
        """Run one `llama_decode` over `entries` (at most n_batch of them). Where the
        context shares the machine's cores, a prompt step (more tokens than sequences)
        computes on every core the other replicas leave idle; a decode step keeps its own."""
        if not 0 < len(entries) <= self.params.n_batch:
            raise ValueError(f"batch of {len(entries)} tokens (limit {self.params.n_batch})")
        if self._cores is None:
            self._decode_batch(entries)
            return
        prompt = len(entries) > len({entry.seq_id for entry in entries})
        threads = self._cores.threads() if prompt else self.params.n_threads
        if threads != self._threads:
            llama_cpp.llama_set_n_threads(self.pointer, threads, threads)
            self._threads = threads
        with self._cores.step():
            self._decode_batch(entries)

    @property
    def threads(self) -> int:
        """The threads the last batch computed on."""
        return self._threads

    def _decode_batch(self, entries: list[BatchEntry]) -> None:
        batch = self._batch
        for i, entry in enumerate(entries):
            batch.token[i] = entry.token
            batch.pos[i] = entry.pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = entry.seq_id
            batch.logits[i] = entry.want_logits
        batch.n_tokens = len(entries)
        code = llama_cpp.llama_decode(self.pointer, batch)
        if code != 0:
            raise DecodeError(code)

    def decode_rows(self, entries: list[BatchEntry]) -> dict[int, np.ndarray]:
        """Decode `entries`; return the logits rows they asked for, by batch index. When the
        KV cache has no room for the whole batch, it is retried as two smaller ones."""
        return self._decode_split(entries, 0)

    def _decode_split(self, entries: list[BatchEntry], offset: int) -> dict[int, np.ndarray]:
        try:
            self.decode(entries)
        except DecodeError as exc:
            if exc.code != 1 or len(entries) < 2:
                raise
            half = len(entries) // 2
            return self._decode_split(entries[:half], offset) | self._decode_split(
                entries[half:], offset + half
            )
        return {offset + i: self.logits(i) for i, e in enumerate(entries) if e.want_logits}

    def logits(self, batch_index: int) -> np.ndarray:
        """A copy of the logits row of the batch entry at `batch_index`."""
        row = llama_cpp.llama_get_logits_ith(self.pointer, batch_index)
        return np.ctypeslib.as_array(row, shape=(self.model.n_vocab,)).copy()

    def clear(self, seq_id: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    def copy_sequence(self, source: int, target: int) -> None:
        """Make `target` hold exactly `source`'s state (KV cells, recurrent state), now.

        Through a state copy, not `llama_memory_seq_cp`: with one KV stream per sequence that
        copy is deferred to the next `llama_decode`, and a state saved, restored or cut in
        either sequence before then is corrupted (measured: logits off by up to 2.4) — which
        a choice that ends at its first token, its slot reused at once, would do.
        """
        self.restore_state(target, self.save_state(source))

    def truncate(self, seq_id: int, position: int) -> bool:
        """Drop positions ≥ `position` (a token count where no image came before). False
        where what is left is not the exact state of the tokens before it: recurrent
        memory, or a sliding window that dropped some of the positions they attend to."""
        if not llama_cpp.llama_memory_seq_rm(self.memory, seq_id, position, -1):
            return False
        window = self.model.sliding_window
        if window and position > 0:
            oldest = llama_cpp.llama_memory_seq_pos_min(self.memory, seq_id)
            return 0 <= oldest <= max(0, position - window)
        return True

    def save_state(self, seq_id: int) -> memoryview:
        """The full state (KV and recurrent) of one sequence, in a buffer of its own."""
        size = llama_cpp.llama_state_seq_get_size(self.pointer, seq_id)
        buf = np.empty(size, dtype=np.uint8)  # llama.cpp writes all of it: no zero-fill
        target = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        written = llama_cpp.llama_state_seq_get_data(self.pointer, target, size, seq_id)
        return buf[:written].data.toreadonly()

    def save_partial(self, seq_id: int) -> memoryview:
        """The part of a sequence's state that a cut cannot give back (recurrent and
        sliding-window memory; llama.cpp's `PARTIAL_ONLY`), without its attention KV."""
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = llama_cpp.llama_state_seq_get_size_ext(self.pointer, seq_id, flags)
        buf = np.empty(size, dtype=np.uint8)
        target = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        written = llama_cpp.llama_state_seq_get_data_ext(self.pointer, target, size, seq_id, flags)
        return buf[:written].data.toreadonly()

    def rewind(self, seq_id: int, position: int, partial: memoryview) -> None:
        """Bring a sequence back to before `position`: load `partial` (what `save_partial`
        gave at that point; its attention cells below it are still those) and drop the
        attention cells from there on. The attention KV stays where it is: nothing of it is
        copied. Only in this order: a hybrid memory refuses to cut its recurrent part."""
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        data = np.frombuffer(partial, dtype=np.uint8)
        source = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        loaded = llama_cpp.llama_state_seq_set_data_ext(
            self.pointer, source, data.size, seq_id, flags
        )
        if not loaded or not llama_cpp.llama_memory_seq_rm(self.memory, seq_id, position, -1):
            self.clear(seq_id)
            raise StateRestoreError("llama.cpp could not rewind the sequence to its anchor")
        # an image's cells under M-RoPE share its first position: the last cell may be below
        last = llama_cpp.llama_memory_seq_pos_max(self.memory, seq_id)
        if last >= position or (position > 0 and last < 0):
            self.clear(seq_id)
            raise StateRestoreError(f"the rewound sequence does not end before {position}")

    def state_size_line(self, seq_id: int, token: int) -> tuple[int, int]:
        """(fixed, per_token) byte sizes of a sequence state, measured on an empty sequence.

        A sequence state is a fixed part (headers, recurrent state) plus one KV row per
        token, so its exact size for n tokens is ``fixed + n * per_token``.
        """
        sizes = []
        done = 0
        # Measured on the caller's thread, not the engine loop's, so on one thread: llama.cpp's
        # OpenMP build gives each thread that computes with several threads a team of its own,
        # and once a process holds more team threads than cores, OpenMP stops spinning at
        # ggml's barriers and sleeps at each one (measured: SmolLM2 decode at 2 threads on 2
        # cores 37 ms a token with a second team, 16 ms without).
        llama_cpp.llama_set_n_threads(self.pointer, 1, 1)
        try:
            for n in (2, 4, 8):
                self._decode_batch([BatchEntry(seq_id, token, p, False) for p in range(done, n)])
                done = n
                sizes.append(llama_cpp.llama_state_seq_get_size(self.pointer, seq_id))
        finally:
            llama_cpp.llama_set_n_threads(self.pointer, self._threads, self._threads)
        self.clear(seq_id)
        per_token = (sizes[1] - sizes[0]) // 2
        if sizes[2] - sizes[1] != 4 * per_token:
            raise RuntimeError(f"sequence state sizes {sizes} for 2/4/8 tokens are not linear")
        return sizes[0] - 2 * per_token, per_token

    def restore_state(self, seq_id: int, state: bytes | memoryview | np.ndarray) -> None:
        """Load a state saved by `save_state` into `seq_id`.

        The caller must have validated `state` (length, checksum, model): llama.cpp trusts
        it, and a truncated state crashes the process. `state` is read in place (a view
        of Ray's object store, say): never copied.
        """
        self.clear(seq_id)
        data = np.frombuffer(state, dtype=np.uint8)  # zero-copy, works for read-only buffers
        source = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if llama_cpp.llama_state_seq_set_data(self.pointer, source, data.size, seq_id) == 0:
            self.clear(seq_id)
            raise StateRestoreError("llama.cpp refused the sequence state")

    def __enter__(self) -> LlamaContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
