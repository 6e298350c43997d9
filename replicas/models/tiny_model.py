"""Write tiny, deterministic, random-weight GGUF models that llama.cpp loads and runs.

Each architecture gets the hyper-parameters and tensors llama.cpp requires (optional ones
left out), every dimension scaled from ``n_embd``, and the full SmolLM2 tokenizer so that
text prompts and chat templates work. Hybrids alternate a recurrent layer with an
attention layer (the last of every pair is attention).

A `ModelShape` (`model_shapes`) gives a real model's widths instead, for GPU benchmarks.

A `ModelVariant` changes what real GGUF files differ in and the engine must not assume:
no BOS or EOS token, special ids outside the vocabulary, no chat template, an extra
end-of-generation token, a short training context, llama.cpp's token-id-only test
vocabulary, a mixture-of-experts feed-forward, a sliding attention window, quantized weights.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gguf
import numpy as np

from baton_serve.replicas.models.model_shapes import ModelShape
from baton_serve.replicas.models.model_vocabulary import vocabulary_kv

ARCHITECTURES: tuple[str, ...] = ("llama", "qwen35", "lfm2", "granitehybrid", "mamba2")
HYBRID_ARCHITECTURES = frozenset({"qwen35", "lfm2", "granitehybrid"})
SHAPED_ARCHITECTURES = ("llama", "qwen35")  # the ones a `ModelShape` is written for

RMS_EPS = 1e-5
DEFAULT_EMBD = 64  # `tiny:ARCH` models' width
MAMBA_HEAD_DIM = 32  # mamba2 mixer: d_inner = 2 * n_embd split into heads of this size
MAMBA_STATE = 16
MAMBA_GROUPS = 2
CONV_KERNEL = 4
SHORTCONV_L_CACHE = 3

N_EXPERTS = 4  # MoE variant: experts per layer, two used per token
N_EXPERTS_USED = 2
TILE = 1_000_003  # draws a tiled matrix repeats (a prime: its rows differ)
SWA_ARCHITECTURES = frozenset({"lfm2"})  # loaders that read `<arch>.attention.sliding_window`
WEIGHT_TYPES = {
    "f16": None,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
}


@dataclass(frozen=True)
class ModelVariant:
    """Metadata and structure choices that real models differ in (the defaults: none)."""

    bos: bool = True  # False: no `bos_token_id` (llama.cpp falls back to its own default)
    eos: bool = True  # False: no `eos_token_id`
    special_ids_out_of_vocab: bool = False  # BOS/EOS ids past the end of the vocabulary
    chat_template: bool = True  # False: no `tokenizer.chat_template`
    extra_eog: int | None = None  # one more end-of-generation token (`eot_token_id`)
    ctx_train: int = 8192  # the model's training context
    # "test": llama.cpp's test vocabulary (text ↔ token ids by hashing / hex, no real words);
    # "none": no vocabulary at all, token ids only
    vocab: Literal["smollm2", "test", "none"] = "smollm2"
    moe: bool = False  # llama: a mixture-of-experts feed-forward
    sliding_window: int = 0  # lfm2: attention over the last N tokens only
    weights: Literal["f16", "q8_0", "q4_0"] = "f16"

    def check(self, arch: str) -> None:
        """Raise `ValueError` for a variant llama.cpp's loader for `arch` would not read."""
        if self.moe and arch != "llama":
            raise ValueError(f"a mixture-of-experts variant is written for llama, not {arch}")
        if self.sliding_window and arch not in SWA_ARCHITECTURES:
            raise ValueError(f"a sliding window is written for lfm2, not {arch}")
        if self.sliding_window < 0 or self.ctx_train < 16:
            raise ValueError("sliding_window must be >= 0 and ctx_train >= 16")
        if self.weights not in WEIGHT_TYPES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_TYPES)}")

    @property
    def label(self) -> str:
        """A short name of the non-default fields, e.g. ``no-bos+ctx-train-512``."""
        parts = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value != field.default:
                name = field.name.replace("_", "-")
                parts.append(
                    f"no-{name}" if value is False else name if value is True else f"{name}-{value}"
                )
        return "+".join(parts) or "default"


class _Tensors:
    """Named tensors in insertion order, drawn from one seeded generator. ``tiled``: each
    matrix repeats one block of `TILE` draws (a real-width model has billions of weights,
    which take minutes to draw one by one; no kernel's speed depends on their values)."""

    def __init__(
        self, seed: int, weights: gguf.GGMLQuantizationType | None = None, *, tiled: bool = False
    ) -> None:
        self.rng = np.random.default_rng(seed)
        self.weights = weights
        self.tiled = tiled
        self.items: list[tuple[str, np.ndarray, gguf.GGMLQuantizationType | None]] = []

    def write(self, writer: gguf.GGUFWriter) -> None:
        """Add every tensor to `writer`, write the file and close it."""
        for name, data, raw_dtype in self.items:
            writer.add_tensor(name, data, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    def matrix(
        self, name: str, n_in: int, n_out: int, std: float | None = None, *, experts: int = 0
    ) -> None:
        """A weight of GGUF shape [n_in, n_out] (× ``experts``), normal with std 1/sqrt(n_in)
        by default: F16, or quantized where the model's weights are."""
        scale = n_in**-0.5 if std is None else std
        shape = (experts, n_out, n_in) if experts else (n_out, n_in)
        if self.tiled and math.prod(shape) > TILE:
            values = np.resize(self.rng.standard_normal(TILE) * scale, shape)
        else:
            values = self.rng.standard_normal(shape) * scale
        if self.weights is None:
            self.items.append((name, values.astype(np.float16), None))
        else:
            quantized = gguf.quants.quantize(values.astype(np.float32), self.weights)
            self.items.append((name, quantized, self.weights))

    def f32(self, name: str, values: np.ndarray) -> None:
        """An F32 tensor; ``values`` is in numpy order (the reverse of GGUF's)."""
        self.items.append((name, np.asarray(values, dtype=np.float32), None))

    def ones(self, name: str, *shape: int) -> None:
        """An F32 tensor of ones, e.g. a norm weight."""
        self.f32(name, np.ones(shape))

    def conv(self, name: str, channels: int, kernel: int) -> None:
        """An F32 depthwise-convolution weight of GGUF shape [kernel, channels]."""
        self.f32(name, self.rng.standard_normal((channels, kernel)) * kernel**-0.5)

    def ssm_decay(self, p: str, *shape: int) -> None:
        """Negative ``ssm_a`` and a softplus-inverse ``ssm_dt.bias`` for ``shape[0]`` heads."""
        self.f32(p + "ssm_a", -self.rng.uniform(1.0, 16.0, shape))
        self.f32(p + "ssm_dt.bias", np.log(np.expm1(self.rng.uniform(1e-3, 0.1, shape[0]))))


def _attention(t: _Tensors, p: str, shape: ModelShape, *, gated_q: bool, qk_norm: bool) -> None:
    """Grouped-query attention (by default half as many KV heads as query heads)."""
    n_embd, head = shape.n_embd, shape.head_dim
    n_q, n_kv = shape.n_head * head, shape.n_head_kv * head
    t.matrix(p + "attn_q.weight", n_embd, n_q * (2 if gated_q else 1))
    t.matrix(p + "attn_k.weight", n_embd, n_kv)
    t.matrix(p + "attn_v.weight", n_embd, n_kv)
    t.matrix(p + "attn_output.weight", n_q, n_embd)
    if qk_norm:
        t.ones(p + "attn_q_norm.weight", head)
        t.ones(p + "attn_k_norm.weight", head)


def _gated_delta_net(t: _Tensors, p: str, shape: ModelShape) -> None:
    """Qwen3.5 linear attention: value heads, key heads sharing them, one head size."""
    n_embd, head = shape.n_embd, shape.linear_head_dim
    value_dim = shape.v_heads * head
    conv_dim = 2 * shape.k_heads * head + value_dim
    t.matrix(p + "attn_qkv.weight", n_embd, conv_dim)
    t.matrix(p + "attn_gate.weight", n_embd, value_dim)
    t.conv(p + "ssm_conv1d.weight", conv_dim, CONV_KERNEL)
    t.ssm_decay(p, shape.v_heads)
    t.matrix(p + "ssm_beta.weight", n_embd, shape.v_heads)
    t.matrix(p + "ssm_alpha.weight", n_embd, shape.v_heads)
    t.ones(p + "ssm_norm.weight", head)
    t.matrix(p + "ssm_out.weight", value_dim, n_embd)


def _short_conv(t: _Tensors, p: str, n_embd: int) -> None:
    """LFM2 gated short convolution."""
    t.matrix(p + "shortconv.in_proj.weight", n_embd, 3 * n_embd)
    t.conv(p + "shortconv.conv.weight", n_embd, SHORTCONV_L_CACHE)
    t.matrix(p + "shortconv.out_proj.weight", n_embd, n_embd)


def _mamba2(t: _Tensors, p: str, n_embd: int) -> None:
    """Mamba2 mixer with d_inner = 2 * n_embd (the only expansion granitehybrid accepts)."""
    d_inner = 2 * n_embd
    n_head = d_inner // MAMBA_HEAD_DIM
    conv_dim = d_inner + 2 * MAMBA_GROUPS * MAMBA_STATE
    t.matrix(p + "ssm_in.weight", n_embd, d_inner + conv_dim + n_head)
    t.conv(p + "ssm_conv1d.weight", conv_dim, CONV_KERNEL)
    t.f32(p + "ssm_conv1d.bias", np.zeros(conv_dim))
    t.ssm_decay(p, n_head, 1)
    t.ones(p + "ssm_d", n_head, 1)
    t.ones(p + "ssm_norm.weight", MAMBA_GROUPS, d_inner // MAMBA_GROUPS)
    t.matrix(p + "ssm_out.weight", d_inner, n_embd)


def _recurrent_mixer(t: _Tensors, arch: str, p: str, shape: ModelShape) -> None:
    if arch == "qwen35":
        _gated_delta_net(t, p, shape)
    elif arch == "lfm2":
        _short_conv(t, p, shape.n_embd)
    else:
        _mamba2(t, p, shape.n_embd)


def _layer(t: _Tensors, arch: str, il: int, shape: ModelShape, attention: bool, moe: bool) -> None:
    """Block ``il``: pre-norm and mixer, then (except for mamba2) a norm and a SwiGLU FFN."""
    p = f"blk.{il}."
    n_embd = shape.n_embd
    t.ones(p + "attn_norm.weight", n_embd)
    if arch == "mamba2":
        _mamba2(t, p, n_embd)
        return
    if attention:
        _attention(t, p, shape, gated_q=arch == "qwen35", qk_norm=arch in ("qwen35", "lfm2"))
    else:
        _recurrent_mixer(t, arch, p, shape)
    t.ones(p + ("post_attention_norm.weight" if arch == "qwen35" else "ffn_norm.weight"), n_embd)
    n_ff = shape.n_ff
    if moe:
        t.f32(p + "ffn_gate_inp.weight", t.rng.standard_normal((N_EXPERTS, n_embd)))
        t.matrix(p + "ffn_gate_exps.weight", n_embd, n_ff, experts=N_EXPERTS)
        t.matrix(p + "ffn_up_exps.weight", n_embd, n_ff, experts=N_EXPERTS)
        t.matrix(p + "ffn_down_exps.weight", n_ff, n_embd, experts=N_EXPERTS)
        return
    t.matrix(p + "ffn_gate.weight", n_embd, n_ff)
    t.matrix(p + "ffn_up.weight", n_embd, n_ff)
    t.matrix(p + "ffn_down.weight", n_ff, n_embd)


def _add_hparams(
    w: gguf.GGUFWriter, arch: str, shape: ModelShape, attention: list[bool], variant: ModelVariant
) -> None:
    """Architecture key/values; lfm2 and granitehybrid mark recurrent layers by 0 KV heads."""
    n_embd = shape.n_embd
    w.add_context_length(variant.ctx_train)
    if variant.moe:
        w.add_expert_count(N_EXPERTS)
        w.add_expert_used_count(N_EXPERTS_USED)
    if variant.sliding_window:
        w.add_sliding_window(variant.sliding_window)
    w.add_embedding_length(n_embd)
    w.add_block_count(len(attention))
    w.add_layer_norm_rms_eps(RMS_EPS)
    if arch != "mamba2":
        n_head = shape.n_head
        w.add_feed_forward_length(shape.n_ff)
        w.add_head_count(n_head)
        if arch in ("lfm2", "granitehybrid"):
            w.add_head_count_kv([shape.n_head_kv if a else 0 for a in attention])
        else:
            w.add_head_count_kv(shape.n_head_kv)
        if shape.explicit_heads:
            w.add_key_length(shape.head_dim)
            w.add_value_length(shape.head_dim)
        if shape.rope_dims:
            w.add_rope_dimension_count(shape.rope_dims)
    if arch == "qwen35":
        w.add_full_attention_interval(shape.attention_interval)
        w.add_rope_dimension_sections(list(shape.rope_sections))
        value_dim = shape.v_heads * shape.linear_head_dim
        _add_ssm(
            w,
            inner=value_dim,
            state=shape.linear_head_dim,
            heads=shape.v_heads,
            groups=shape.k_heads,
        )
    elif arch in ("granitehybrid", "mamba2"):
        d_inner = 2 * n_embd
        n_ssm_heads = d_inner // MAMBA_HEAD_DIM
        _add_ssm(w, inner=d_inner, state=MAMBA_STATE, heads=n_ssm_heads, groups=MAMBA_GROUPS)
    elif arch == "lfm2":
        w.add_shortconv_l_cache(SHORTCONV_L_CACHE)


def _add_ssm(w: gguf.GGUFWriter, *, inner: int, state: int, heads: int, groups: int) -> None:
    """The ``ssm.*`` key/values shared by Mamba2 and gated-delta-net layers."""
    w.add_ssm_conv_kernel(CONV_KERNEL)
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(state)
    w.add_ssm_time_step_rank(heads)
    w.add_ssm_group_count(groups)


def write_tokenizer(out: str | Path, tokenizer_from: str | Path | None = None) -> Path:
    """A GGUF file of ``tokenizer_from``'s tokenizer alone (default: SmolLM2's), no tensors:
    a model's vocabulary at a few MB, for ``tokenizer_from`` where the model is not at hand."""
    out = Path(out)
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name("baton-tokenizer")
    for key, value, vtype, sub_type in vocabulary_kv(tokenizer_from, ModelVariant())[0]:
        writer.add_key_value(key, value, vtype, sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return out


def write_tiny_model(
    arch: str,
    out: str | Path,
    *,
    seed: int = 0,
    n_layers: int = 2,
    n_embd: int = DEFAULT_EMBD,
    tokenizer_from: str | Path | None = None,
    variant: ModelVariant = ModelVariant(),
    shape: ModelShape | None = None,
) -> Path:
    """Write a random-weight ``arch`` model to ``out`` and return its path.

    The same arguments always give a byte-identical file. ``n_embd`` must be a positive
    multiple of 32; hybrids need ``n_layers >= 2`` so that both layer kinds are present.
    ``shape`` (a real model's widths, llama and qwen35) replaces ``n_embd``'s scaled ones.
    ``tokenizer_from`` (default: the SmolLM2 GGUF) supplies the tokenizer and vocab size,
    unless ``variant`` asks for llama.cpp's test vocabulary.
    """
    if arch not in ARCHITECTURES:
        expected = ", ".join(ARCHITECTURES)
        raise ValueError(f"unknown architecture {arch!r}; expected one of {expected}")
    if shape is not None and arch not in SHAPED_ARCHITECTURES:
        raise ValueError(f"a shape is written for {' and '.join(SHAPED_ARCHITECTURES)}, not {arch}")
    shaped = shape is not None
    shape = shape or ModelShape.scaled(n_embd)
    shape.check(arch)
    hybrid = arch in HYBRID_ARCHITECTURES
    interval = shape.attention_interval
    min_layers = interval if hybrid else 1
    if n_layers < min_layers:
        raise ValueError(f"{arch} needs n_layers >= {min_layers}, got {n_layers}")
    variant.check(arch)
    tokenizer, n_vocab = vocabulary_kv(tokenizer_from, variant)

    attention = [
        arch == "llama" or (hybrid and il % interval == interval - 1) for il in range(n_layers)
    ]
    t = _Tensors(seed, WEIGHT_TYPES[variant.weights], tiled=shaped)
    n_embd = shape.n_embd
    t.matrix("token_embd.weight", n_embd, n_vocab, std=1.0)
    for il, is_attention in enumerate(attention):
        _layer(t, arch, il, shape, is_attention, variant.moe)
    t.ones("token_embd_norm.weight" if arch == "lfm2" else "output_norm.weight", n_embd)
    t.matrix("output.weight", n_embd, n_vocab)

    out = Path(out)
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(f"baton-tiny-{arch}")
    _add_hparams(writer, arch, shape, attention, variant)
    writer.add_vocab_size(n_vocab)
    for key, value, vtype, sub_type in tokenizer:
        writer.add_key_value(key, value, vtype, sub_type)
    t.write(writer)
    return out
