"""Tiny random-weight GGUF models load and run in llama.cpp, deterministically."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest

from baton_serve.replicas.engine import ggml_backends
from baton_serve.replicas.models.model_shapes import REAL_SHAPES, ModelShape
from baton_serve.replicas.models.tiny_model import (
    ARCHITECTURES,
    HYBRID_ARCHITECTURES,
    write_tiny_model,
    write_tokenizer,
)

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time")

ggml_backends.ensure_loaded()  # llama.cpp's CPU backend, as the engine loads it


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One default-sized model per architecture, written once for this module."""
    arch = request.param
    return write_tiny_model(arch, tmp_path_factory.mktemp(arch) / f"{arch}.gguf")


@pytest.fixture(scope="module")
def llm(model_path: Path) -> Iterator[llama_cpp.Llama]:
    """The model on 2 CPU threads, keeping logits of the last token only."""
    model = llama_cpp.Llama(
        model_path=str(model_path), n_ctx=2048, n_threads=2, verbose=False, logits_all=False
    )
    yield model
    model.close()


def _greedy(llm: llama_cpp.Llama, prompt: str, n: int = 6) -> list[int]:
    """Greedy continuation of ``prompt``, checking every step's logits are finite."""
    llm.reset()
    llm.eval(llm.tokenize(prompt.encode()))
    out = []
    for _ in range(n):
        logits_ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        logits = np.ctypeslib.as_array(logits_ptr, shape=(llm.n_vocab(),))
        assert np.isfinite(logits).all()
        out.append(int(logits.argmax()))
        llm.eval([out[-1]])
    return out


def test_model_kind(model_path: Path, llm: llama_cpp.Llama) -> None:
    arch = model_path.stem
    assert llama_cpp.llama_model_is_hybrid(llm.model) == (arch in HYBRID_ARCHITECTURES)
    assert llama_cpp.llama_model_is_recurrent(llm.model) == (arch == "mamba2")
    assert llm.n_vocab() == 49152


def test_greedy_generations_are_finite_and_varied(llm: llama_cpp.Llama) -> None:
    outs = [_greedy(llm, prompt) for prompt in PROMPTS]
    assert len({tuple(o) for o in outs}) == len(PROMPTS)
    assert all(len(set(o)) > 1 for o in outs)


def test_chat_completion_returns_text(llm: llama_cpp.Llama) -> None:
    reply = llm.create_chat_completion(
        messages=[{"role": "user", "content": "Hello, who are you?"}], max_tokens=8, temperature=0
    )
    assert reply["choices"][0]["message"]["content"].strip()


def test_deterministic(model_path: Path, tmp_path: Path) -> None:
    arch = model_path.stem
    again = write_tiny_model(arch, tmp_path / "again.gguf")
    other = write_tiny_model(arch, tmp_path / "other.gguf", seed=1)
    assert again.read_bytes() == model_path.read_bytes()
    assert other.read_bytes() != model_path.read_bytes()


@pytest.mark.parametrize("arch", sorted(HYBRID_ARCHITECTURES))
def test_hybrids_alternate_recurrent_and_attention_layers(arch: str, tmp_path: Path) -> None:
    reader = gguf.GGUFReader(write_tiny_model(arch, tmp_path / "m.gguf", n_layers=3))
    names = {t.name for t in reader.tensors}
    assert [f"blk.{il}.attn_k.weight" in names for il in range(3)] == [False, True, False]


def test_rejects_unknown_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama, qwen35, lfm2, granitehybrid, mamba2"):
        write_tiny_model("gpt2", tmp_path / "m.gguf")


@pytest.mark.parametrize("arch", sorted(HYBRID_ARCHITECTURES))
def test_rejects_single_layer_hybrid(arch: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="n_layers"):
        write_tiny_model(arch, tmp_path / "m.gguf", n_layers=1)


# Qwen3.5-9B's head sizes and layer mix (`REAL_SHAPES`), two heads wide: cheap to run here
NARROW_QWEN35 = ModelShape(
    n_embd=512,
    head_dim=256,
    n_head=2,
    n_head_kv=1,
    n_ff=1536,
    attention_interval=4,
    rope_dims=64,
    rope_sections=(11, 11, 10, 0),
    linear_head_dim=128,
    linear_k_heads=2,
    linear_v_heads=4,
)


def test_a_shaped_model_has_its_head_sizes_and_layer_mix_and_runs(tmp_path: Path) -> None:
    path = write_tiny_model("qwen35", tmp_path / "m.gguf", n_layers=4, shape=NARROW_QWEN35)
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in gguf.GGUFReader(path).tensors}
    assert [f"blk.{il}.attn_k.weight" in shapes for il in range(4)] == [False] * 3 + [True]
    assert shapes["blk.3.attn_q.weight"] == (512, 2 * 256 * 2)  # gated: queries and gates
    assert shapes["blk.3.attn_k.weight"] == (512, 256)
    assert shapes["blk.0.attn_qkv.weight"] == (512, 2 * 2 * 128 + 4 * 128)
    assert shapes["blk.0.ssm_norm.weight"] == (128,)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False)
    try:
        assert len(set(_greedy(llm, PROMPTS[0]))) > 1
    finally:
        llm.close()


def test_real_shapes_are_ones_llama_cpp_reads_and_only_for_their_architectures(
    tmp_path: Path,
) -> None:
    REAL_SHAPES["qwen3.5-9b"].check("qwen35")
    REAL_SHAPES["llama-3-8b"].check("llama")
    with pytest.raises(ValueError, match="a shape is written for llama and qwen35, not lfm2"):
        write_tiny_model("lfm2", tmp_path / "m.gguf", shape=NARROW_QWEN35)
    with pytest.raises(ValueError, match="rope sections"):
        REAL_SHAPES["llama-3-8b"].check("qwen35")
    with pytest.raises(ValueError, match="qwen35 needs n_layers >= 4"):
        write_tiny_model("qwen35", tmp_path / "m.gguf", n_layers=2, shape=NARROW_QWEN35)


def test_a_tokenizer_file_alone_gives_the_same_model(tmp_path: Path) -> None:
    tokenizer = write_tokenizer(tmp_path / "tokenizer.gguf")  # what travels to a GPU machine
    assert tokenizer.stat().st_size < 4 << 20 and not gguf.GGUFReader(tokenizer).tensors
    default = write_tiny_model("qwen35", tmp_path / "a.gguf")
    from_file = write_tiny_model("qwen35", tmp_path / "b.gguf", tokenizer_from=tokenizer)
    assert from_file.read_bytes() == default.read_bytes()
