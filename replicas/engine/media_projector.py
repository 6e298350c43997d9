"""An image projector beside a text model, through llama.cpp's `mtmd` (the vendored build's
libmtmd): how many tokens and positions an image takes, its embeddings, and feeding them
into a sequence at the positions its model family needs (M-RoPE's 2-D grid for Qwen-VL,
one position a token otherwise), as llama-server does with `--mmproj`.

The gateway asks for layouts only (its prompt threads, in parallel); the engine prepares
a request's images where it is submitted (off its loop; only those its cache likely lacks)
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
from baton_serve.replicas.engine.media_input import DecodedImage

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
    """The projector would not load, or llama.cpp refused an image."""


@dataclass(frozen=True)
class MediaLayout:
    """An image in a prompt: the text tokens its projector puts before and after it, and
    the embeddings (`n_tokens`) and positions (`n_pos`) it takes."""

    before: tuple[int, ...]
    n_tokens: int
    n_pos: int
    after: tuple[int, ...]

    def tokens(self, identity: bytes) -> tuple[int, ...]:
        """The image's ids in a prompt (`identity`: `MediaProjector.identity`'s): its text,
        and a placeholder per embedding."""
        return self.before + media_tokens(identity, self.n_tokens, self.n_pos) + self.after


class PreparedImage:
    """An image tokenised by the projector, ready to encode. It owns llama.cpp memory, freed
    by `close` or when it is dropped."""

    def __init__(
        self, mtmd: Any, chunks: int, layout: MediaLayout, image_chunk: int, whole: bool
    ) -> None:
        self._free = weakref.finalize(self, mtmd.mtmd_input_chunks_free, chunks)
        self.layout = layout
        self.chunk = image_chunk
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
        self.uses_mrope = bool(mtmd_cpp.mtmd_decode_use_mrope(self._pointer))
        self._encoding = threading.Lock()  # one encode at a time: its output buffer is shared

    def identity(self, digest: bytes) -> bytes:
        """What an image's placeholders carry: its pixels' digest and this projector's, so a
        state computed from one projector's embeddings never serves another's."""
        return hashlib.blake2b(self.fingerprint + digest, digest_size=32).digest()

    def prepare(self, image: DecodedImage) -> PreparedImage:
        """`image` tokenised (resized and cut to the projector's grid): any thread."""
        mtmd = self._mtmd
        pixels = (ctypes.c_uint8 * len(image.rgb)).from_buffer_copy(image.rgb)
        bitmap = mtmd.mtmd_bitmap_init(image.width, image.height, pixels)
        if not bitmap:
            raise ProjectorError("llama.cpp refused the image's pixels")
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            text = mtmd.mtmd_input_text(_MARKER, len(_MARKER), False, True)
            bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
            code = mtmd.mtmd_tokenize(self._pointer, chunks, ctypes.byref(text), bitmaps, 1)
            if code != 0:
                raise ProjectorError(f"llama.cpp could not tokenise the image (code {code})")
            return self._prepared(chunks)
        except BaseException:
            mtmd.mtmd_input_chunks_free(chunks)
            raise
        finally:
            mtmd.mtmd_bitmap_free(bitmap)

    def _prepared(self, chunks: int) -> PreparedImage:
        mtmd = self._mtmd
        before: list[int] = []
        after: list[int] = []
        image_chunk = None
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            kind = mtmd.mtmd_input_chunk_get_type(chunk)
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                count = ctypes.c_size_t()
                ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                (after if image_chunk else before).extend(ids[: count.value])
            elif image_chunk is None and kind == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                image_chunk = chunk
            else:
                raise ProjectorError("the projector cut one image into several parts")
        if image_chunk is None:
            raise ProjectorError("the projector made no image of the image")
        layout = MediaLayout(
            tuple(before),
            mtmd.mtmd_input_chunk_get_n_tokens(image_chunk),
            mtmd.mtmd_input_chunk_get_n_pos(image_chunk),
            tuple(after),
        )
        whole = bool(mtmd.mtmd_decode_use_non_causal(self._pointer, image_chunk))
        return PreparedImage(mtmd, chunks, layout, image_chunk, whole)

    def layout(self, image: DecodedImage) -> MediaLayout:
        """The tokens and positions `image` takes: any thread."""
        prepared = self.prepare(image)
        prepared.close()
        return prepared.layout

    def encode(self, prepared: PreparedImage, n_embd: int) -> np.ndarray:
        """The image's embeddings, one row of `n_embd` per token (a copy: the projector
        reuses its output buffer)."""
        with self._encoding:
            code = self._mtmd.mtmd_encode_chunk(self._pointer, prepared.chunk)
            if code != 0:
                raise ProjectorError(f"llama.cpp could not encode the image (code {code})")
            rows = prepared.layout.n_tokens
            output = self._mtmd.mtmd_get_output_embd(self._pointer)
            return np.ctypeslib.as_array(output, shape=(rows * n_embd,)).copy()

    def feed(
        self,
        context_pointer: int,
        prepared: PreparedImage,
        embeddings: np.ndarray,
        *,
        seq_id: int,
        position: int,
        n_batch: int,
    ) -> None:
        """Decode `embeddings` into sequence `seq_id` from `position` on (the 2-D grid of
        M-RoPE, non-causal attention where the model wants it; no logits)."""
        mtmd = self._mtmd
        data = embeddings.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        next_position = ctypes.c_int32()
        code = mtmd.mtmd_helper_decode_image_chunk(
            self._pointer,
            context_pointer,
            prepared.chunk,
            data,
            position,
            seq_id,
            n_batch,
            ctypes.byref(next_position),
            mtmd.mtmd_helper_post_decode_callback(),
            None,
        )
        if code != 0:
            raise ProjectorError(f"llama.cpp could not decode the image (code {code})")

    def close(self) -> None:
        if self._pointer:
            self._mtmd.mtmd_free(self._pointer)
            self._pointer = None
