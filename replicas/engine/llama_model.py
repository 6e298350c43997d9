"""A loaded GGUF model: its kind, fingerprint, vocabulary and chat template.

Thin, typed wrapper over llama.cpp's C API (through llama-cpp-python's ctypes bindings).
It owns the `llama_model` pointer; contexts are created by the engine.
"""

from __future__ import annotations

import atexit
import ctypes
import enum
import functools
import logging
import os
import threading
from pathlib import Path

import llama_cpp
import numpy as np

from baton_serve.cache_store.fingerprint import file_fingerprint
from baton_serve.replicas.engine import ggml_backends
from baton_serve.replicas.engine.prompt import PromptError

logger = logging.getLogger("baton.llama")

_backend_lock = threading.Lock()
_backend_ready = False
_GGML_LOG_LEVEL_WARN = 3
_GGML_LOG_LEVEL_ERROR = 4


# An image under M-RoPE takes fewer positions than cells: the text after it is expected to
# jump, and llama.cpp warns of each jump.
_EXPECTED = (b"find_slot: non-consecutive token position",)


@llama_cpp.llama_log_callback
def forward_llama_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    """Route llama.cpp's (and its mtmd's) warnings and errors to Python logging; drop its
    chatter."""
    if level in (_GGML_LOG_LEVEL_WARN, _GGML_LOG_LEVEL_ERROR) and text:
        if not text.startswith(_EXPECTED):
            logger.warning("%s", text.decode("utf-8", errors="replace").rstrip())


def _stop_forwarding() -> None:
    """At exit: llama.cpp logs to stderr again. A daemon thread still in llama.cpp would
    otherwise call `forward_llama_log` once Python has freed it (seen: a segfault at exit)."""
    llama_cpp.llama_log_set(llama_cpp.llama_log_callback(), ctypes.c_void_p(0))


def _init_backend() -> ggml_backends.CpuChoice:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            llama_cpp.llama_log_set(forward_llama_log, ctypes.c_void_p(0))
            atexit.register(_stop_forwarding)
            ggml_backends.ensure_loaded()
            llama_cpp.llama_backend_init()
            _backend_ready = True
    return ggml_backends.ensure_loaded()


class ModelKind(str, enum.Enum):
    """How a model's sequence state behaves under prefix reuse."""

    ATTENTION = "attention"  # KV cache only: can be truncated to any prefix
    HYBRID = "hybrid"  # attention + recurrent layers: state only at exact checkpoints
    RECURRENT = "recurrent"  # recurrent layers only

    @property
    def needs_checkpoints(self) -> bool:
        return self is not ModelKind.ATTENTION


class ModelLoadError(RuntimeError):
    """The model file could not be loaded."""


class ModelClosed(RuntimeError):
    """The model was freed; nothing can use it any more."""


class LlamaModel:
    """A GGUF model loaded with llama.cpp (weights, or only the vocabulary).

    Nothing about the vocabulary is assumed: BOS and EOS may be missing (None), generation
    ends on any of the model's end-of-generation tokens, and a vocabulary without text
    (llama.cpp's "none" type) serves token ids only.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        n_gpu_layers: int = 0,
        vocab_only: bool = False,
        cpu_repack: bool | None = None,
    ) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        backend = _init_backend()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.vocab_only = vocab_only
        # Weight repacking (AMX, interleaved CPU kernels): by default only where this
        # machine's backend test showed it runs.
        self.cpu_repack = backend.repack_safe if cpu_repack is None else cpu_repack
        params.use_extra_bufts = self.cpu_repack
        pointer = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not pointer:
            raise ModelLoadError(f"llama.cpp could not load {self.path} (not a valid GGUF model?)")
        self.pointer = pointer
        self.devices = () if vocab_only else self._offload_devices(n_gpu_layers)
        self._vocab = llama_cpp.llama_model_get_vocab(pointer)
        self.fingerprint = file_fingerprint(self.path)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.has_text = llama_cpp.llama_vocab_type(self.vocab) != llama_cpp.LLAMA_VOCAB_TYPE_NONE
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(pointer)
        self.n_embd_input = llama_cpp.llama_model_n_embd_inp(pointer)  # an image's row width
        self.bos_token = self._special(llama_cpp.llama_vocab_bos(self.vocab))
        self.eos_token = self._special(llama_cpp.llama_vocab_eos(self.vocab))
        self.add_bos = self.bos_token is not None and bool(
            llama_cpp.llama_vocab_get_add_bos(self.vocab)
        )
        self.sliding_window = 0 if vocab_only else llama_cpp.llama_model_n_swa(pointer)
        if llama_cpp.llama_model_is_recurrent(pointer):
            self.kind = ModelKind.RECURRENT
        elif llama_cpp.llama_model_is_hybrid(pointer):
            self.kind = ModelKind.HYBRID
        else:
            self.kind = ModelKind.ATTENTION

    def _offload_devices(self, n_gpu_layers: int) -> tuple[str, ...]:
        """The devices holding offloaded layers; says so when none takes the layers asked
        for (llama.cpp itself would run them on the CPU without a word)."""
        if n_gpu_layers == 0:
            return ()
        devices = tuple(ggml_backends.offload_devices())
        if devices:
            layers = llama_cpp.llama_model_n_layer(self.pointer) + 1  # + the output layer
            on_device = layers if n_gpu_layers < 0 else min(n_gpu_layers, layers)
            logger.info(
                "%s: %d/%d layers on %s", self.path.name, on_device, layers, ", ".join(devices)
            )
        else:
            logger.warning(
                "n_gpu_layers is %d but llama.cpp has no GPU device here: %s runs on the CPU",
                n_gpu_layers,
                self.path.name,
            )
        return devices

    @property
    def device(self) -> str:
        """Where the model's offloaded layers run: its devices, or "CPU"."""
        return ", ".join(self.devices) or "CPU"

    def _special(self, token: int) -> int | None:
        """A special token id, or None where the model has none (-1 or out of range)."""
        return token if 0 <= token < self.n_vocab else None

    @property
    def any_token(self) -> int:
        """A token id that is valid for this model (for measuring, never for text)."""
        return self.bos_token if self.bos_token is not None else 0

    @property
    def vocab(self) -> llama_cpp.llama_vocab_p:
        """The vocabulary pointer; raises once the model is closed (never a dangling pointer)."""
        if not self.pointer:
            raise ModelClosed(f"model {self.path.name} is closed")
        return self._vocab

    @property
    def name(self) -> str:
        return self.path.stem

    def close(self) -> None:
        if self.pointer:
            llama_cpp.llama_model_free(self.pointer)
            self.pointer = None

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as text, or None."""
        if not self.pointer:
            raise ModelClosed(f"model {self.path.name} is closed")
        buf = ctypes.create_string_buffer(1 << 20)
        n = llama_cpp.llama_model_meta_val_str(self.pointer, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace") if n >= 0 else None

    @property
    def chat_template(self) -> str | None:
        return self.metadata("tokenizer.chat_template")

    def tokenize(
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        """Text → token ids. Special tokens written in the text (e.g. ``<|im_start|>``) are parsed."""
        if not self.has_text:
            raise PromptError(
                f"model {self.name} has no tokenizer (its vocabulary has no text): "
                "send prompts as token ids"
            )
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate, e.g. JSON's "\ud800"
            raise PromptError(
                f"the text is not valid Unicode: a lone surrogate at character {exc.start}"
            ) from None
        capacity = len(data) + 8
        while True:
            out = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(
                self.vocab, data, len(data), out, capacity, add_special, parse_special
            )
            if n >= 0:
                return list(out[:n])
            capacity = -n

    def token_bytes(self, token: int, *, special: bool = True) -> bytes:
        """The bytes one token stands for (control tokens rendered as their text, or as
        nothing unless `special`); nothing for a vocabulary without text or an id outside
        the vocabulary."""
        if not self.has_text or not 0 <= token < self.n_vocab:
            return b""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int] | np.ndarray) -> str:
        return b"".join(self.token_bytes(int(t)) for t in tokens).decode("utf-8", errors="replace")

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    @functools.cached_property
    def end_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation token id (found once, on first use)."""
        return tuple(t for t in range(self.n_vocab) if self.is_end_of_generation(t))

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def __enter__(self) -> LlamaModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
