"""The emulated engine's compute: the model's vocabulary and the `LlamaContext` methods the
engine calls, with only the arithmetic replaced by time from a measured profile.

Like llm-d's inference simulator, but under the real `Engine`: its step planning, prefix
cache, checkpoints, signed blobs, index publishing and stats all run as they do over
llama.cpp. What is emulated is `llama_decode`: a step sleeps for what the profile says
it costs (a prefill piece at `prefill_tokens_per_s`, a decode step between one stream's
and a full batch's pace, with the profile's host noise), and each logits row puts all
its weight on one token derived from the sequence's contents — so the reply is
deterministic and equal wherever the same tokens were computed, restored or copied.

A sequence's state is its tokens behind a header holding their digest: a restore checks
the digest, so a state that is not what it claims is refused as llama.cpp refuses one.
It is `STATE_FIXED + STATE_PER_TOKEN` bytes a token, far less than the profile's (no
replica could hold thousands of real states here); a restore sleeps for the profile's
bytes. The tokenizer and chat template are the model file's own, loaded vocabulary only.
"""

from __future__ import annotations

import functools
import random
import struct
import time

import numpy as np

from baton_serve.replicas.engine.emulated_timing import EmulatedTiming
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_context import (
    BatchEntry,
    ContextParams,
    DecodeError,
    LlamaContext,
    StateRestoreError,
)
from baton_serve.replicas.engine.llama_model import LlamaModel

_HEAD = struct.Struct("<4sIQ")  # magic, tokens, digest
_MAGIC = b"BTEM"
_PARTIAL_MAGIC = b"BTEP"
STATE_FIXED = _HEAD.size
STATE_PER_TOKEN = 4  # one int32 token id
OTHER_LOGIT = -40.0  # every token but the chosen one: e^-40 is never drawn
_MASK = (1 << 64) - 1
_FNV = 0x100000001B3


class EmulatedModel(LlamaModel):
    """A model file's vocabulary and chat template (no weights), named as emulated.

    Its fingerprint is the file's, as the gateway hashes prompts and the index is keyed by
    it; blobs still never cross between real and emulated engines: each refuses the
    other's states by their exact size (and an emulated state by its digest).
    """

    def __init__(self, path: str, timing: EmulatedTiming) -> None:
        super().__init__(path, vocab_only=True)
        self.timing = timing

    @property
    def device(self) -> str:
        return f"emulated:{self.timing.name}"

    @functools.cached_property
    def word_tokens(self) -> tuple[int, ...]:
        """Tokens a reply is made of: whole words (" word") that a tokenizer reading the
        reply's text gives back as the same ids, as a real model's replies mostly are; any
        token where the vocabulary has no such words (found once, on first use)."""
        words = []
        for token in range(self.n_vocab) if self.has_text else ():
            text = self.token_bytes(token, special=False)
            if len(text) > 2 and text[:1] == b" " and text[1:].isalpha() and text.isascii():
                if self.tokenize(text.decode(), parse_special=False) == [token]:
                    words.append(token)
        return tuple(words) or tuple(range(self.n_vocab))


def _digest(previous: int, token: int) -> int:
    return ((previous ^ (token + 1)) * _FNV) & _MASK


class EmulatedContext:
    """`LlamaContext`'s methods over emulated sequences (engine thread only)."""

    def __init__(self, model: EmulatedModel, params: ContextParams, seed: int = 0) -> None:
        self.model = model
        self.params = params
        self.timing = model.timing
        self.n_ctx_per_seq = params.n_ctx_per_seq
        # Per sequence: its tokens and, for each, the digest of the sequence up to it.
        self._seq_tokens: list[list[int]] = [[] for _ in range(params.n_seqs)]
        self._digests: list[list[int]] = [[] for _ in range(params.n_seqs)]
        self._noise = random.Random(seed)
        self._words = model.word_tokens
        self._row = np.full(model.n_vocab, OTHER_LOGIT, dtype=np.float32)
        self.busy_s = 0.0  # emulated compute time slept

    def close(self) -> None:
        """Nothing to free."""

    # ---- decoding ------------------------------------------------------------------------

    def decode(self, entries: list[BatchEntry]) -> None:
        """Append `entries` to their sequences (checked as llama.cpp checks a batch) and
        sleep for the step's cost."""
        if not 0 < len(entries) <= self.params.n_batch:
            raise ValueError(f"batch of {len(entries)} tokens (limit {self.params.n_batch})")
        added: dict[int, list[BatchEntry]] = {}
        for entry in entries:
            if not 0 <= entry.seq_id < len(self._seq_tokens):
                raise DecodeError(-1)
            added.setdefault(entry.seq_id, []).append(entry)
        for seq_id, batch in added.items():
            held = len(self._seq_tokens[seq_id])
            if [e.pos for e in batch] != list(range(held, held + len(batch))):
                raise DecodeError(-1)  # positions must continue the sequence
            if held + len(batch) > self.n_ctx_per_seq:
                raise DecodeError(1)
        for seq_id, batch in added.items():
            tokens, digests = self._seq_tokens[seq_id], self._digests[seq_id]
            for entry in batch:
                digests.append(_digest(digests[-1] if digests else 0, entry.token))
                tokens.append(entry.token)
        self._sleep(self._step_s(added))

    def _step_s(self, added: dict[int, list[BatchEntry]]) -> float:
        """A step: a token for each decoding sequence (one row), prompt pieces."""
        streams = sum(len(batch) == 1 for batch in added.values())
        prompt_tokens = sum(len(batch) for batch in added.values() if len(batch) > 1)
        seconds = self.timing.step_s(streams, prompt_tokens)
        sigma = self.timing.step_noise
        if sigma:
            seconds *= self._noise.lognormvariate(-sigma * sigma / 2, sigma)  # mean 1
        return seconds

    def _sleep(self, seconds: float) -> None:
        self.busy_s += seconds
        time.sleep(seconds)

    def decode_rows(self, entries: list[BatchEntry]) -> dict[int, np.ndarray]:
        """Decode `entries`; the logits rows they asked for, by batch index."""
        self.decode(entries)
        return {i: self._logits(e.seq_id, e.pos) for i, e in enumerate(entries) if e.want_logits}

    def _logits(self, seq_id: int, pos: int) -> np.ndarray:
        """All weight on the token the sequence's first `pos + 1` tokens choose."""
        row = self._row.copy()
        row[next_token(self._digests[seq_id][pos], self._words)] = 0.0
        return row

    # ---- memory --------------------------------------------------------------------------

    def clear(self, seq_id: int) -> None:
        self._seq_tokens[seq_id], self._digests[seq_id] = [], []

    def truncate(self, seq_id: int, n_tokens: int) -> bool:
        """Drop positions ≥ n_tokens; False (nothing dropped) where the model's memory is
        recurrent and would have to be cut inside, as llama.cpp answers."""
        held = len(self._seq_tokens[seq_id])
        if self.model.kind.needs_checkpoints and 0 < n_tokens < held:
            return False
        del self._seq_tokens[seq_id][n_tokens:], self._digests[seq_id][n_tokens:]
        return True

    def copy_sequence(self, source: int, target: int) -> None:
        self.restore_state(target, self.save_state(source))

    # ---- states --------------------------------------------------------------------------

    def save_state(self, seq_id: int) -> memoryview:
        tokens, digests = self._seq_tokens[seq_id], self._digests[seq_id]
        head = _HEAD.pack(_MAGIC, len(tokens), digests[-1] if digests else 0)
        body = np.asarray(tokens, dtype=np.int32).tobytes()
        return memoryview(head + body).toreadonly()

    def save_partial(self, seq_id: int) -> memoryview:
        """A partial state: where the sequence is and its digest there (a real model's
        recurrent state, which costs no restore time in the profile)."""
        digests = self._digests[seq_id]
        head = _HEAD.pack(_PARTIAL_MAGIC, len(digests), digests[-1] if digests else 0)
        return memoryview(head).toreadonly()

    def rewind(self, seq_id: int, n_tokens: int, partial: memoryview) -> None:
        """Cut the sequence back to `n_tokens`, as `save_partial` saw it then."""
        magic, held, digest = _HEAD.unpack_from(partial)
        digests = self._digests[seq_id]
        if magic != _PARTIAL_MAGIC or held != n_tokens or len(digests) < n_tokens:
            self.clear(seq_id)
            raise StateRestoreError("not a partial state of this sequence")
        if n_tokens and digests[n_tokens - 1] != digest:
            self.clear(seq_id)
            raise StateRestoreError("the sequence has changed under its partial state")
        del self._seq_tokens[seq_id][n_tokens:], digests[n_tokens:]

    def state_size_line(self, seq_id: int, token: int) -> tuple[int, int]:
        """(fixed, per_token) byte sizes of a sequence state."""
        return STATE_FIXED, STATE_PER_TOKEN

    def restore_state(self, seq_id: int, state: bytes | memoryview | np.ndarray) -> None:
        """Load a state `save_state` made; `StateRestoreError` if it is not one (its size,
        magic or digest), the sequence left empty. Sleeps for the profile's restore."""
        self.clear(seq_id)
        data = memoryview(np.frombuffer(state, dtype=np.uint8)).cast("B")
        if len(data) < STATE_FIXED:
            raise StateRestoreError("the emulated state is shorter than its header")
        magic, n_tokens, digest = _HEAD.unpack_from(data)
        if magic != _MAGIC or len(data) != STATE_FIXED + STATE_PER_TOKEN * n_tokens:
            raise StateRestoreError("not an emulated sequence state of its stated size")
        tokens = np.frombuffer(data, dtype=np.int32, offset=STATE_FIXED).tolist()
        digests, running = [], 0
        for token in tokens:
            running = _digest(running, token)
            digests.append(running)
        if running != digest or n_tokens > self.n_ctx_per_seq:
            raise StateRestoreError("the emulated state's digest does not match its tokens")
        self._seq_tokens[seq_id], self._digests[seq_id] = tokens, digests
        self._sleep(self.timing.restore_s(n_tokens))

    def held(self, seq_id: int) -> tuple[int, ...]:
        """The tokens a sequence holds (for tests)."""
        return tuple(self._seq_tokens[seq_id])


def next_token(digest: int, words: tuple[int, ...]) -> int:
    """The token a sequence of this digest generates next."""
    return words[(digest >> 17) % len(words)]


def load_model(path: str, config: EngineConfig) -> LlamaModel:
    """The engine's model: loaded by llama.cpp, or its vocabulary only when `config` says
    the compute is emulated."""
    if config.emulated is not None:
        return EmulatedModel(path, config.emulated)
    return LlamaModel(path, n_gpu_layers=config.n_gpu_layers, cpu_repack=config.cpu_repack)


def open_context(model: LlamaModel, params: ContextParams) -> LlamaContext | EmulatedContext:
    """The engine's context: llama.cpp's, or an emulated one for an `EmulatedModel`."""
    if isinstance(model, EmulatedModel):
        return EmulatedContext(model, params)
    return LlamaContext(model, params)
