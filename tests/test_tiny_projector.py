"""Tiny random-weight vision projectors load in llama.cpp's mtmd, encode images and decode."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import gguf
import llama_cpp
import numpy as np
import pytest

from baton_serve.deploy.cli import main
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.models.tiny_model import write_tiny_model
from baton_serve.replicas.models.tiny_projector import IMAGE_TOKENS, write_tiny_projector

LIB = Path(llama_cpp.__file__).parent / "lib" / "libmtmd.so"
needs_mtmd = pytest.mark.skipif(not LIB.exists(), reason="llama-cpp-python built without libmtmd")

N_EMBD = 256
# arch → (tokens per image, positions per image, M-RoPE): Qwen's 3×3 grid of merged patches
# takes 3 positions; LLaVA's 16 tokens take 16.
EXPECTED = {
    "qwen35": (IMAGE_TOKENS["qwen35"], 3, True),
    "llama": (IMAGE_TOKENS["llama"], 16, False),
}


@pytest.fixture(scope="module")
def mtmd() -> ModuleType:
    from llama_cpp import mtmd_cpp  # loads libmtmd.so: only once `needs_mtmd` has passed

    return mtmd_cpp


@pytest.fixture(params=sorted(EXPECTED))
def models(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Any, Any]]:
    """(arch, llama_model pointer, llama_context pointer) of a tiny text model."""
    arch = request.param
    text = write_tiny_model(arch, tmp_path / "text.gguf", n_layers=4, n_embd=N_EMBD)
    model = LlamaModel(text)  # loads ggml's CPU backend first
    ctx_params = llama_cpp.llama_context_default_params()
    ctx_params.n_ctx = 512
    ctx_params.n_batch = 512
    ctx_params.n_threads = ctx_params.n_threads_batch = 2
    ctx = llama_cpp.llama_init_from_model(model.pointer, ctx_params)
    assert ctx
    yield arch, model.pointer, ctx
    llama_cpp.llama_free(ctx)
    model.close()


def test_projector_is_deterministic(tmp_path: Path) -> None:
    first = write_tiny_projector(tmp_path / "a.gguf", arch="qwen35", n_embd_text=N_EMBD)
    again = write_tiny_projector(tmp_path / "b.gguf", arch="qwen35", n_embd_text=N_EMBD)
    other = write_tiny_projector(tmp_path / "c.gguf", arch="qwen35", n_embd_text=N_EMBD, seed=1)
    assert first.read_bytes() == again.read_bytes() != other.read_bytes()
    with pytest.raises(ValueError, match="qwen35, llama"):
        write_tiny_projector(tmp_path / "d.gguf", arch="lfm2", n_embd_text=N_EMBD)


def test_make_model_writes_the_matching_projector(tmp_path: Path) -> None:
    out, mmproj = tmp_path / "m.gguf", tmp_path / "mmproj.gguf"
    argv = ["make-model", "--arch", "llama", "--out", str(out), "--embd", "96"]
    assert main([*argv, "--mmproj", str(mmproj)]) == 0
    fields = gguf.GGUFReader(mmproj).fields
    assert fields["clip.projector_type"].contents() == "mlp"
    assert fields["clip.vision.projection_dim"].contents() == 96
    assert main(["make-model", "--arch", "lfm2", "--out", str(out), "--mmproj", "x"]) == 2


@needs_mtmd
def test_image_encodes_and_decodes(
    mtmd: ModuleType, models: tuple[str, Any, Any], tmp_path: Path
) -> None:
    arch, model, ctx = models
    n_tokens, n_pos, mrope = EXPECTED[arch]
    mmproj = write_tiny_projector(tmp_path / "mmproj.gguf", arch=arch, n_embd_text=N_EMBD)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False
    params.n_threads = 2
    mctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), model, params)
    assert mctx, "mtmd_init_from_file failed (see stderr)"
    chunks = mtmd.mtmd_input_chunks_init()
    pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    bitmap = mtmd.mtmd_bitmap_init(64, 64, pixels.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
    try:
        assert mtmd.mtmd_support_vision(mctx)
        assert mtmd.mtmd_decode_use_mrope(mctx) is mrope
        prompt = b"Describe " + mtmd.mtmd_default_marker() + b" briefly."
        text = mtmd.mtmd_input_text(
            text=prompt, text_len=len(prompt), add_special=True, parse_special=True
        )
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mtmd.mtmd_tokenize(mctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
        kinds = [
            mtmd.mtmd_input_chunk_get_type(mtmd.mtmd_input_chunks_get(chunks, i))
            for i in range(mtmd.mtmd_input_chunks_size(chunks))
        ]
        assert kinds == [
            mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT,
            mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE,
            mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT,
        ]
        image = mtmd.mtmd_input_chunks_get(chunks, 1)
        assert mtmd.mtmd_input_chunk_get_n_tokens(image) == n_tokens
        assert mtmd.mtmd_input_chunk_get_n_pos(image) == n_pos

        assert mtmd.mtmd_encode_chunk(mctx, image) == 0
        embd = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(mctx), shape=(n_tokens, N_EMBD))
        assert np.isfinite(embd).all() and embd.std() > 0

        new_n_past = llama_cpp.llama_pos(0)
        # n_past 0, seq_id 0, n_batch 512, logits for the last token only
        status = mtmd.mtmd_helper_eval_chunks(
            mctx, ctx, chunks, 0, 0, 512, True, ctypes.byref(new_n_past)
        )
        assert status == 0
        n_text = mtmd.mtmd_helper_get_n_tokens(chunks) - n_tokens
        assert new_n_past.value == n_text + n_pos == mtmd.mtmd_helper_get_n_pos(chunks)
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        assert np.isfinite(logits).all()
    finally:
        mtmd.mtmd_bitmap_free(bitmap)
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_free(mctx)
