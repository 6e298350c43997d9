"""Tiny random-weight projectors load in llama.cpp's mtmd and encode images and audio clips."""

from __future__ import annotations

from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest

from baton_serve.deploy.cli import main
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.media_input import DecodedAudio, DecodedImage, image_digest
from baton_serve.replicas.engine.media_projector import MediaProjector
from baton_serve.replicas.models.tiny_model import write_tiny_model
from baton_serve.replicas.models.tiny_projector import (
    AUDIO_TOKENS,
    IMAGE_TOKENS,
    write_tiny_projector,
)

LIB = Path(llama_cpp.__file__).parent / "lib" / "libmtmd.so"
needs_mtmd = pytest.mark.skipif(not LIB.exists(), reason="llama-cpp-python built without libmtmd")

N_EMBD = 256
# arch → (tokens per image, positions per image, M-RoPE): Qwen's 3×3 grid of merged patches
# takes 3 positions; LLaVA's 16 tokens take 16.
EXPECTED = {
    "qwen35": (IMAGE_TOKENS["qwen35"], 3, True),
    "llama": (IMAGE_TOKENS["llama"], 16, False),
}


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
    assert fields["clip.vision.projector_type"].contents() == "mlp"
    assert fields["clip.audio.projector_type"].contents() == "ultravox"
    assert fields["clip.vision.projection_dim"].contents() == 96
    assert main(["make-model", "--arch", "lfm2", "--out", str(out), "--mmproj", "x"]) == 2


@needs_mtmd
@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_an_image_and_a_clip_encode_to_finite_embeddings(arch: str, tmp_path: Path) -> None:
    """Through Baton's wrapper of mtmd (`media_projector`); `test_images.py` and
    `test_audio.py` decode them. A clip takes one position a token, under M-RoPE too."""
    n_tokens, n_pos, mrope = EXPECTED[arch]
    text = write_tiny_model(arch, tmp_path / "text.gguf", n_layers=4, n_embd=N_EMBD)
    mmproj = write_tiny_projector(tmp_path / "mmproj.gguf", arch=arch, n_embd_text=N_EMBD)
    pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    image = DecodedImage(64, 64, pixels.tobytes(), b"", image_digest(64, 64, pixels.tobytes()))
    samples = np.random.default_rng(1).standard_normal(16000).astype(np.float32) * 0.1
    clip = DecodedAudio(samples.tobytes(), 16000, b"", "wav", b"")
    with LlamaModel(text) as model:
        projector = MediaProjector(mmproj, model, use_gpu=False, threads=2)
        try:
            assert projector.takes_images and projector.uses_mrope is mrope
            assert projector.audio_rate == 16000
            for item, shape in ((image, (n_tokens, n_pos)), (clip, (AUDIO_TOKENS, AUDIO_TOKENS))):
                prepared = projector.prepare(item)
                assert (prepared.layout.n_tokens, prepared.layout.n_pos) == shape
                embeddings = projector.encode(prepared, model.n_embd_input).reshape(shape[0], -1)
                assert embeddings.shape[1] == N_EMBD
                assert np.isfinite(embeddings).all() and embeddings.std() > 0
                prepared.close()
        finally:
            projector.close()
