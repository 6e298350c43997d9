"""A multimodal projector beside a text model, through llama.cpp's `mtmd` (the vendored
build's libmtmd): how many tokens and positions an image or audio clip takes, its
embeddings, and feeding them into a sequence at the positions its model family needs
(M-RoPE's 2-D grid for an image of the Qwen-VL line, one position a token otherwise), as
llama-server does with `--mmproj`.

The gateway asks for layouts only (its prompt threads, in parallel); the engine prepares
a request's media where it is submitted (off its loop; only what its cache likely lacks)
and encodes and feeds them on its loop, where the device is.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from baton_serve.cache_store.fingerprint import file_fingerprint
from baton_serve.cache_store.media_tokens import media_tokens
from baton_serve.replicas.engine.llama_model import LlamaModel, forward_llama_log
from baton_serve.replicas.engine.media_input import DecodedAudio, DecodedMedia

_MARKER = b"<__media__>"


@functools.cache  # once a process
def _forward_mtmd_logs(mtmd_cpp: Any) -> None:
    """mtmd's chatter dropped and its warnings logged, as llama.cpp's; at exit it logs to
    stderr again (a daemon thread must not call back into a Python that is shutting down)."""
    mtmd_cpp.mtmd_log_set(forward_llama_log, None)
    mtmd_cpp.mtmd_helper_log_set(forward_llama_log, None)

    def stop() -> None:
        default = llama_cpp.llama_log_callback()  # a null pointer: its own stderr logger
        mtmd_cpp.mtmd_log_set(default, None)
        mtmd_cpp.mtmd_helper_log_set(default, None)

    atexit.register(stop)


class ProjectorError(RuntimeError):
    """The projector would not load, or llama.cpp refused an image or clip."""


@dataclass(frozen=True)
class MediaLayout:
    """An image or clip in a prompt: the text tokens its projector puts before and after
    it, and the embeddings (`n_tokens`) and positions (`n_pos`) it takes."""

    before: tuple[int, ...]
    n_tokens: int
    n_pos: int
    after: tuple[int, ...]

    def tokens(self, identity: bytes) -> tuple[int, ...]:
        """The item's ids in a prompt (`identity`: `MediaProjector.identity`'s): its text,
        and a placeholder per embedding."""
        return self.before + media_tokens(identity, self.n_tokens, self.n_pos) + self.after


@dataclass(frozen=True)
class MediaChunk:
    """One of mtmd's chunks of an item: a long clip is cut into several (30 s each for a
    Whisper-style encoder), an image is one."""

    pointer: int
    n_tokens: int
    n_pos: int


class PreparedMedia:
    """An image or clip tokenised by the projector, ready to encode. It owns llama.cpp
    memory, freed by `close` or when it is dropped."""

    def __init__(
        self,
        mtmd: Any,
        chunks: int,
        layout: MediaLayout,
        parts: tuple[MediaChunk, ...],
        whole: bool,
    ) -> None:
        self._free = weakref.finalize(self, mtmd.mtmd_input_chunks_free, chunks)
        self.layout = layout
        self.parts = parts
        self.whole = whole  # its embeddings attend to each other: one llama_decode for all

    def close(self) -> None:
        self._free()


class MediaProjector:
    """The projector file at `path`, for `model`'s embeddings."""

    def __init__(self, path: str | Path, model: LlamaModel, *, use_gpu: bool, threads: int) -> None:
        from llama_cpp import mtmd_cpp  # libmtmd loads only where a projector is served

        self._mtmd = mtmd_cpp
        _forward_mtmd_logs(mtmd_cpp)
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = threads
        params.print_timings = False
        params.warmup = False
        params.media_marker = _MARKER
        self._pointer = mtmd_cpp.mtmd_init_from_file(str(path).encode(), model.pointer, params)
        if not self._pointer:
            raise ProjectorError(f"llama.cpp could not load the projector {path}")
        self.fingerprint = file_fingerprint(path)
        self.takes_images = bool(mtmd_cpp.mtmd_support_vision(self._pointer))
        rate = mtmd_cpp.mtmd_get_audio_sample_rate(self._pointer)
        self.audio_rate: int | None = rate if mtmd_cpp.mtmd_support_audio(self._pointer) else None
        self.uses_mrope = bool(mtmd_cpp.mtmd_decode_use_mrope(self._pointer))
        self._encoding = threading.Lock()  # one encode at a time: its output buffer is shared

    def identity(self, digest: bytes) -> bytes:
        """What an item's placeholders carry: its pixels' (or samples') digest and this
        projector's, so a state computed from one projector's embeddings never serves
        another's."""
        return hashlib.blake2b(self.fingerprint + digest, digest_size=32).digest()

    def prepare(self, item: DecodedMedia) -> PreparedMedia:
        """`item` tokenised (an image resized and cut to the projector's grid, a clip to
        its mel frames): any thread."""
        mtmd = self._mtmd
        bitmap = self._bitmap(item)
        if not bitmap:
            raise ProjectorError("llama.cpp refused the item's pixels or samples")
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            text = mtmd.mtmd_input_text(_MARKER, len(_MARKER), False, True)
            bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
            code = mtmd.mtmd_tokenize(self._pointer, chunks, ctypes.byref(text), bitmaps, 1)
            if code != 0:
                raise ProjectorError(f"llama.cpp could not tokenise the item (code {code})")
            return self._prepared(chunks)
        except BaseException:
            mtmd.mtmd_input_chunks_free(chunks)
            raise
        finally:
            mtmd.mtmd_bitmap_free(bitmap)

    def _bitmap(self, item: DecodedMedia) -> Any:
        mtmd = self._mtmd
        if isinstance(item, DecodedAudio):
            if item.sample_rate != self.audio_rate:
                raise ProjectorError(
                    f"the clip is at {item.sample_rate} Hz; this projector reads "
                    f"{self.audio_rate or 'no audio'}"
                )
            samples = (ctypes.c_float * item.n_samples).from_buffer_copy(item.samples)
            return mtmd.mtmd_bitmap_init_from_audio(item.n_samples, samples)
        pixels = (ctypes.c_uint8 * len(item.rgb)).from_buffer_copy(item.rgb)
        return mtmd.mtmd_bitmap_init(item.width, item.height, pixels)

    def _prepared(self, chunks: int) -> PreparedMedia:
        """The item's media chunks, one after another, and the text around them."""
        mtmd = self._mtmd
        before: list[int] = []
        after: list[int] = []
        parts: list[MediaChunk] = []
        media_kinds = (mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE, mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO)
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            kind = mtmd.mtmd_input_chunk_get_type(chunk)
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                count = ctypes.c_size_t()
                ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                (after if parts else before).extend(ids[: count.value])
            elif kind in media_kinds and not after:
                n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
                parts.append(MediaChunk(chunk, n_tokens, mtmd.mtmd_input_chunk_get_n_pos(chunk)))
            else:
                raise ProjectorError("the projector cut the item into parts with text between")
        if not parts:
            raise ProjectorError("the projector made no media chunk of the item")
        layout = MediaLayout(
            tuple(before),
            sum(part.n_tokens for part in parts),
            sum(part.n_pos for part in parts),
            tuple(after),
        )
        whole = any(mtmd.mtmd_decode_use_non_causal(self._pointer, p.pointer) for p in parts)
        return PreparedMedia(mtmd, chunks, layout, tuple(parts), whole)

    def layout(self, item: DecodedMedia) -> MediaLayout:
        """The tokens and positions `item` takes: any thread."""
        prepared = self.prepare(item)
        prepared.close()
        return prepared.layout

    def encode(self, prepared: PreparedMedia, n_embd: int) -> np.ndarray:
        """The item's embeddings, one row of `n_embd` per token (copies: the projector
        reuses its output buffer)."""
        rows = []
        with self._encoding:
            for part in prepared.parts:
                code = self._mtmd.mtmd_encode_chunk(self._pointer, part.pointer)
                if code != 0:
                    raise ProjectorError(f"llama.cpp could not encode the item (code {code})")
                output = self._mtmd.mtmd_get_output_embd(self._pointer)
                rows.append(np.ctypeslib.as_array(output, shape=(part.n_tokens * n_embd,)).copy())
        return np.concatenate(rows)

    def feed(
        self,
        context_pointer: int,
        prepared: PreparedMedia,
        embeddings: np.ndarray,
        *,
        seq_id: int,
        position: int,
        n_batch: int,
    ) -> None:
        """Decode `embeddings` into sequence `seq_id` from `position` on, chunk after chunk
        (the 2-D grid of M-RoPE for an image, non-causal attention where the model wants
        it; no logits)."""
        mtmd = self._mtmd
        n_embd = len(embeddings) // prepared.layout.n_tokens
        row = 0
        for part in prepared.parts:
            rows = embeddings[row * n_embd : (row + part.n_tokens) * n_embd]
            next_position = ctypes.c_int32()
            code = mtmd.mtmd_helper_decode_image_chunk(
                self._pointer,
                context_pointer,
                part.pointer,
                rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                position,
                seq_id,
                n_batch,
                ctypes.byref(next_position),
                mtmd.mtmd_helper_post_decode_callback(),
                None,
            )
            if code != 0:
                raise ProjectorError(f"llama.cpp could not decode the item (code {code})")
            position, row = next_position.value, row + part.n_tokens

    def close(self) -> None:
        if self._pointer:
            self._mtmd.mtmd_free(self._pointer)
            self._pointer = None
