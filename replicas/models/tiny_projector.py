"""Write tiny, deterministic, random-weight vision and audio projector ("mmproj") GGUF files.

llama.cpp's ``mtmd`` library loads them next to a text model from `tiny_model` of the same
``n_embd``: an image or an audio clip becomes a handful of embeddings that the text model
decodes in place of tokens. Every file holds both encoders, as real omni models' files do
(``clip.has_vision_encoder`` and ``clip.has_audio_encoder``, the projector types under
``clip.vision.projector_type`` and ``clip.audio.projector_type``).

Two of mtmd's vision projector families are written, one for each kind of text position:

* ``qwen35`` → ``qwen3vl_merger`` (Qwen3-VL), the vision encoder of real Qwen3.5 checkpoints
  (llama.cpp converts ``Qwen3_5ForConditionalGeneration`` with ``Qwen3VLVisionModel``): a ViT
  with 2-D M-RoPE, two patch-embedding convolutions of 16×16 px (the two frames of Qwen's
  temporal patch, a still image going through both) and their one bias, learned position
  embeddings for a 4×4 patch grid that mtmd interpolates bilinearly to each image's grid,
  blocks with a fused QKV projection, a post-norm and a merger that concatenates each 2×2
  block of patches and projects it with a 2-layer GELU MLP. No deepstack layers: Qwen3.5 has none
  (``deepstack_visual_indexes`` is empty), and llama.cpp's qwen35 text model takes embeddings
  of ``n_embd`` only. Images keep their aspect ratio: mtmd resizes them to multiples of 32 px
  (patch 16 × merge 2) holding between 8 and 4096 tokens (``image_min_tokens`` /
  ``image_max_tokens`` move the bounds), one token per 32×32 px, so a square image of at
  most 111×111 px gives 3×3 = **9 tokens**, one of 112×112 px 4×4 = **16 tokens** and one of
  448×448 px 14×14 = **196 tokens**. The text model's imrope makes ``mtmd_decode_use_mrope()``
  true, and a grid of w×h tokens then takes max(w, h) positions: 3, 4 and 14. mtmd puts the
  text ``<|vision_start|>`` before an image and ``<|vision_end|>`` after it.
* ``llama`` → ``mlp`` (LLaVA-1.5): a CLIP ViT with learned 1-D position embeddings and a
  2-layer MLP. Every image is padded to a square and resized to 56×56 px: 4×4 patches of
  14 px = **16 tokens**, decoded at 16 ordinary consecutive positions.

Both archs get the same audio encoder, ``ultravox`` (16 kHz): a Whisper encoder (two 1-D
convolutions over 128 mel bins, the second of stride 2; learned position embeddings;
pre-norm blocks without a key bias) whose 1500 output frames are stacked 16 at a time and
projected by Ultravox's RMS-normed SwiGLU MLP. mtmd appends 30 s of silence to a clip and
cuts its mel frames into whole chunks of 30 s (3000 frames), so every clip shorter than
30 s is one audio chunk of **94 tokens** and a clip of d seconds floor(d / 30) + 1 such
chunks. Each token takes one position (one M-RoPE position under imrope), and mtmd puts
no text before or after the chunks.

Weights are F16 (norms, biases and position embeddings F32), drawn with std 1/sqrt(fan-in)
so that activations stay of order one. All tensors come from one generator seeded by
``seed``, in the order they are written.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from baton_serve.replicas.models.tiny_model import _Tensors

VISION_EMBD = 64
VISION_HEADS = 4  # head size 16: Qwen's vision M-RoPE splits it in four sections of 4
VISION_FF = 128  # != VISION_EMBD, or mtmd's fix-up for old LLaVA files swaps ffn_up and ffn_down
VISION_LAYERS = 2
LAYER_NORM_EPS = 1e-6

PROJECTOR_TYPES = {"qwen35": "qwen3vl_merger", "llama": "mlp"}  # vision, per text arch
PATCH_SIZES = {"qwen35": 16, "llama": 14}  # Qwen3-VL's and CLIP ViT-L/14's
SPATIAL_MERGE = 2  # qwen3vl: 2×2 patches per token
# qwen3vl: learned position embeddings for a POSITION_GRID × POSITION_GRID patch grid (real
# Qwen3.5: 48 × 48), interpolated to each image's grid. Not 8: 64 rows would make the
# tensor square and a transposed layout load unnoticed.
POSITION_GRID = 4
# clip.vision.image_size: the input side for mlp; qwen3vl only records it (its images keep
# their own size), as the position grid's side in pixels, the converter's
# sqrt(num_position_embeddings) × patch_size.
IMAGE_SIZES = {"qwen35": POSITION_GRID * PATCH_SIZES["qwen35"], "llama": 56}
IMAGE_TOKENS = {"qwen35": 9, "llama": 16}  # qwen35: for a square image of at most 111×111 px
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # the CLIP / OpenAI normalization
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_MEANS = {"qwen35": (0.5, 0.5, 0.5), "llama": _CLIP_MEAN}  # Qwen3-VL's preprocessor: 0.5
IMAGE_STDS = {"qwen35": (0.5, 0.5, 0.5), "llama": _CLIP_STD}

AUDIO_PROJECTOR_TYPE = "ultravox"
AUDIO_EMBD = 64
AUDIO_HEADS = 4
AUDIO_FF = 128
AUDIO_LAYERS = 2
MEL_BINS = 128  # Whisper large-v3's, the encoder of Ultravox v0.5
AUDIO_POSITIONS = 1500  # Whisper's: 3000 mel frames (30 s) halved by the stride-2 convolution
CONV1D_KERNEL = 3
# Encoder frames stacked into one token. Not Ultravox's 8: for 3000 mel frames mtmd counts
# 3000 / 8 / 2 = 187 tokens while its graph pads 1500 frames to 188 and aborts the process.
STACK_FACTOR = 16
ULTRAVOX_HIDDEN = 128  # the MLP's width after SwiGLU (its first layer gives twice as many)
WHISPER_EPS = 1e-5
AUDIO_TOKENS = 94  # per audio chunk: a clip shorter than 30 s is one chunk


def _conv(t: _Tensors, name: str, patch: int) -> None:
    """A patch-embedding convolution of GGUF shape [patch, patch, 3, VISION_EMBD], F16."""
    fan_in = 3 * patch * patch
    values = t.rng.standard_normal((VISION_EMBD, 3, patch, patch)) * fan_in**-0.5
    t.items.append((name, values.astype(np.float16), None))


def _bias(t: _Tensors, name: str, n: int) -> None:
    """A small random F32 bias (zeros would hide a bias applied to the wrong tensor)."""
    t.f32(name, t.rng.standard_normal(n) * 0.02)


def _position_embeddings(t: _Tensors, name: str, n_positions: int, n_embd: int) -> None:
    """Learned F32 position embeddings of GGUF shape [n_embd, n_positions]."""
    t.f32(name, t.rng.standard_normal((n_positions, n_embd)) * 0.02)


def _layer_norm(t: _Tensors, name: str, n: int) -> None:
    """A LayerNorm's F32 weight (ones) and bias (zeros)."""
    t.ones(name + ".weight", n)
    t.f32(name + ".bias", np.zeros(n))


def _linear(t: _Tensors, name: str, n_in: int, n_out: int) -> None:
    """An F16 weight of GGUF shape [n_in, n_out] and its F32 bias."""
    t.matrix(name + ".weight", n_in, n_out)
    _bias(t, name + ".bias", n_out)


def _ffn(t: _Tensors, p: str, n_embd: int, n_ff: int) -> None:
    """The second half of pre-norm block ``p``: its norm and 2-layer FFN, all biased."""
    _layer_norm(t, p + "ln2", n_embd)
    _linear(t, p + "ffn_up", n_embd, n_ff)
    _linear(t, p + "ffn_down", n_ff, n_embd)


def _block(t: _Tensors, p: str, n_embd: int, n_ff: int, *, k_bias: bool) -> None:
    """Pre-norm encoder block ``p``: separate biased q/v/out (and k where ``k_bias``)
    projections and a 2-layer FFN."""
    _layer_norm(t, p + "ln1", n_embd)
    _linear(t, p + "attn_q", n_embd, n_embd)
    if k_bias:
        _linear(t, p + "attn_k", n_embd, n_embd)
    else:
        t.matrix(p + "attn_k.weight", n_embd, n_embd)
    _linear(t, p + "attn_v", n_embd, n_embd)
    _linear(t, p + "attn_out", n_embd, n_embd)
    _ffn(t, p, n_embd, n_ff)


def _qkv_block(t: _Tensors, il: int) -> None:
    """Qwen3-VL vision block ``il``: one biased QKV projection (q, k and v in that order
    along its output), a biased out projection and a 2-layer FFN."""
    p = f"v.blk.{il}."
    _layer_norm(t, p + "ln1", VISION_EMBD)
    _linear(t, p + "attn_qkv", VISION_EMBD, 3 * VISION_EMBD)
    _linear(t, p + "attn_out", VISION_EMBD, VISION_EMBD)
    _ffn(t, p, VISION_EMBD, VISION_FF)


def _qwen3vl_tensors(t: _Tensors, n_embd_text: int) -> None:
    """Two patch convolutions and their shared bias, position embeddings, blocks, post-norm
    and merger MLP (mm.0, GELU, mm.2). No pre-norm and no deepstack mergers."""
    patch = PATCH_SIZES["qwen35"]
    _conv(t, "v.patch_embd.weight", patch)
    _conv(t, "v.patch_embd.weight.1", patch)
    _bias(t, "v.patch_embd.bias", VISION_EMBD)
    _position_embeddings(t, "v.position_embd.weight", POSITION_GRID**2, VISION_EMBD)
    for il in range(VISION_LAYERS):
        _qkv_block(t, il)
    _layer_norm(t, "v.post_ln", VISION_EMBD)
    merged = VISION_EMBD * SPATIAL_MERGE**2
    _linear(t, "mm.0", merged, merged)
    _linear(t, "mm.2", merged, n_embd_text)


def _mlp_tensors(t: _Tensors, n_embd_text: int) -> None:
    """Patch convolution, position embeddings, pre-norm, blocks and MLP (mm.0, GELU, mm.2).

    LLaVA takes the features of the second-to-last block, so the last one is loaded but
    never run, as in real LLaVA-1.5 files.
    """
    patch = PATCH_SIZES["llama"]
    n_patches = (IMAGE_SIZES["llama"] // patch) ** 2
    _conv(t, "v.patch_embd.weight", patch)
    _position_embeddings(t, "v.position_embd.weight", n_patches, VISION_EMBD)
    _layer_norm(t, "v.pre_ln", VISION_EMBD)
    for il in range(VISION_LAYERS):
        _block(t, f"v.blk.{il}.", VISION_EMBD, VISION_FF, k_bias=True)
    _linear(t, "mm.0", VISION_EMBD, n_embd_text)
    _linear(t, "mm.2", n_embd_text, n_embd_text)


def _conv1d(t: _Tensors, name: str, n_in: int, n_out: int) -> None:
    """A 1-D convolution of GGUF shape [kernel, n_in, n_out], F16, and its F32 bias of
    shape [1, n_out] (added to every frame)."""
    fan_in = n_in * CONV1D_KERNEL
    values = t.rng.standard_normal((n_out, n_in, CONV1D_KERNEL)) * fan_in**-0.5
    t.items.append((name + ".weight", values.astype(np.float16), None))
    t.f32(name + ".bias", t.rng.standard_normal((n_out, 1)) * 0.02)


def _ultravox_tensors(t: _Tensors, n_embd_text: int) -> None:
    """Whisper encoder (convolutions, position embeddings, blocks without a k bias, post
    norm) and Ultravox's projector (norm_pre, mlp.1, SwiGLU, norm_mid, mlp.2; no biases)."""
    _conv1d(t, "a.conv1d.1", MEL_BINS, AUDIO_EMBD)
    _conv1d(t, "a.conv1d.2", AUDIO_EMBD, AUDIO_EMBD)
    _position_embeddings(t, "a.position_embd.weight", AUDIO_POSITIONS, AUDIO_EMBD)
    for il in range(AUDIO_LAYERS):
        _block(t, f"a.blk.{il}.", AUDIO_EMBD, AUDIO_FF, k_bias=False)
    _layer_norm(t, "a.post_ln", AUDIO_EMBD)
    stacked = AUDIO_EMBD * STACK_FACTOR
    t.ones("mm.a.norm_pre.weight", stacked)
    t.matrix("mm.a.mlp.1.weight", stacked, 2 * ULTRAVOX_HIDDEN)
    t.ones("mm.a.norm_mid.weight", ULTRAVOX_HIDDEN)
    t.matrix("mm.a.mlp.2.weight", ULTRAVOX_HIDDEN, n_embd_text)


def _add_vision_keys(w: gguf.GGUFWriter, arch: str, n_embd_text: int) -> None:
    """The ``clip.vision.*`` key/values of ``arch``'s vision encoder (and, for qwen3vl,
    ``clip.use_gelu``, as the converter writes it)."""
    w.add_clip_vision_projector_type(PROJECTOR_TYPES[arch])
    w.add_vision_projection_dim(n_embd_text)
    w.add_vision_image_size(IMAGE_SIZES[arch])
    w.add_vision_patch_size(PATCH_SIZES[arch])
    w.add_vision_embedding_length(VISION_EMBD)
    w.add_vision_feed_forward_length(VISION_FF)
    w.add_vision_block_count(VISION_LAYERS)
    w.add_vision_head_count(VISION_HEADS)
    w.add_vision_attention_layernorm_eps(LAYER_NORM_EPS)
    w.add_vision_image_mean(list(IMAGE_MEANS[arch]))
    w.add_vision_image_std(list(IMAGE_STDS[arch]))
    if arch == "qwen35":
        w.add_vision_use_gelu(True)  # tanh GELU in the blocks' FFN (else mtmd's quick GELU)
        w.add_vision_spatial_merge_size(SPATIAL_MERGE)
        # Informative only: mtmd finds deepstack layers by their v.deepstack.* tensors.
        w.add_vision_is_deepstack_layers([False] * VISION_LAYERS)


def _add_audio_keys(w: gguf.GGUFWriter, n_embd_text: int) -> None:
    """The ``clip.audio.*`` key/values of the Ultravox audio encoder."""
    w.add_clip_audio_projector_type(AUDIO_PROJECTOR_TYPE)
    w.add_audio_projection_dim(n_embd_text)
    w.add_audio_embedding_length(AUDIO_EMBD)
    w.add_audio_feed_forward_length(AUDIO_FF)
    w.add_audio_block_count(AUDIO_LAYERS)
    w.add_audio_head_count(AUDIO_HEADS)
    w.add_audio_attention_layernorm_eps(WHISPER_EPS)
    w.add_audio_num_mel_bins(MEL_BINS)
    w.add_audio_stack_factor(STACK_FACTOR)


def write_tiny_projector(path: Path, *, arch: str, n_embd_text: int, seed: int = 0) -> Path:
    """Write a random-weight vision and audio projector for a tiny ``arch`` text model to
    ``path``.

    Its output width is ``n_embd_text`` (the text model's ``n_embd``; mtmd refuses a
    mismatch). The same arguments always give a byte-identical file. Tokens per image are
    in `IMAGE_TOKENS`, per audio clip in `AUDIO_TOKENS`, and both in the module docstring.
    """
    if arch not in PROJECTOR_TYPES:
        expected = ", ".join(PROJECTOR_TYPES)
        raise ValueError(f"no projector for architecture {arch!r}; expected one of {expected}")
    if n_embd_text <= 0:
        raise ValueError(f"n_embd_text must be positive, got {n_embd_text}")
    t = _Tensors(seed)
    if arch == "qwen35":
        _qwen3vl_tensors(t, n_embd_text)
    else:
        _mlp_tensors(t, n_embd_text)
    _ultravox_tensors(t, n_embd_text)

    path = Path(path)
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])  # "clip"
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name(f"baton-tiny-{arch}-mmproj")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_has_audio_encoder(True)
    _add_vision_keys(w, arch, n_embd_text)
    _add_audio_keys(w, n_embd_text)
    t.write(w)
    return path
