"""The widths of a generated model (`tiny_model`): scaled from its embedding size, or a real
model's (`REAL_SHAPES`: head sizes, head counts, FFN width and layer mix, at any depth), for
benchmarks on a GPU, where head size 16 has no flash-attention kernel and widths decide
which kernels run."""

from __future__ import annotations

from dataclasses import dataclass

FFN_MULT = 2  # n_ff = FFN_MULT * n_embd
HEAD_DIM = 16  # attention and gated-delta-net head size; n_head = n_embd // HEAD_DIM
QWEN35_ROPE_SECTIONS = (3, 3, 2, 0)  # sums to HEAD_DIM // 2


@dataclass(frozen=True)
class ModelShape:
    """The widths of a generated model: attention heads, FFN, the hybrid's layer mix and, for
    Qwen3.5's gated delta net, its key and value heads. `scaled` gives the tiny defaults."""

    n_embd: int
    head_dim: int
    n_head: int
    n_head_kv: int
    n_ff: int
    attention_interval: int = 2  # hybrids: every Nth layer is attention, the rest recurrent
    rope_dims: int = 0  # rotary dimensions (0: the whole head)
    rope_sections: tuple[int, ...] = QWEN35_ROPE_SECTIONS  # qwen35's M-RoPE; sum = rope dims / 2
    linear_head_dim: int = HEAD_DIM  # gated delta net: key and value head size
    linear_k_heads: int = 0  # gated delta net heads (0: n_embd // HEAD_DIM values, half keys)
    linear_v_heads: int = 0

    @classmethod
    def scaled(cls, n_embd: int) -> ModelShape:
        """Every width from ``n_embd``: heads of `HEAD_DIM`, half as many KV heads."""
        n_head = n_embd // HEAD_DIM
        return cls(n_embd, HEAD_DIM, n_head, n_head // 2, FFN_MULT * n_embd)

    @property
    def v_heads(self) -> int:
        return self.linear_v_heads or self.n_embd // HEAD_DIM

    @property
    def k_heads(self) -> int:
        return self.linear_k_heads or self.v_heads // 2

    @property
    def explicit_heads(self) -> bool:
        """Whether llama.cpp must be told the head size (it assumes n_embd / n_head)."""
        return self.head_dim * self.n_head != self.n_embd

    def check(self, arch: str) -> None:
        """Raise `ValueError` for widths llama.cpp's loader for ``arch`` would not read."""
        if self.n_embd <= 0 or self.n_embd % 32:
            raise ValueError(f"n_embd must be a positive multiple of 32, got {self.n_embd}")
        if self.n_head <= 0 or self.n_head_kv <= 0 or self.n_head % self.n_head_kv:
            raise ValueError(f"{self.n_head} heads do not group over {self.n_head_kv} KV heads")
        if self.v_heads % self.k_heads:
            raise ValueError(f"{self.v_heads} value heads do not group over {self.k_heads}")
        rotary = self.rope_dims or self.head_dim
        if rotary > self.head_dim:
            raise ValueError(f"{rotary} rotary dims exceed the head size {self.head_dim}")
        if arch == "qwen35" and 2 * sum(self.rope_sections) != rotary:
            raise ValueError(f"rope sections {self.rope_sections} do not fill {rotary} dims")


# Real models' widths (their published configs), at any depth: `baton make-model --shape`.
REAL_SHAPES: dict[str, ModelShape] = {
    # Qwen3.5-9B: gated attention (16 heads of 256, 4 KV heads, a quarter of each rotary) on
    # every 4th layer, gated delta nets (16 key and 32 value heads of 128) on the others
    "qwen3.5-9b": ModelShape(
        n_embd=4096,
        head_dim=256,
        n_head=16,
        n_head_kv=4,
        n_ff=12288,
        attention_interval=4,
        rope_dims=64,
        rope_sections=(11, 11, 10, 0),
        linear_head_dim=128,
        linear_k_heads=16,
        linear_v_heads=32,
    ),
    # Llama-3-8B: 32 heads of 128, 8 KV heads
    "llama-3-8b": ModelShape(n_embd=4096, head_dim=128, n_head=32, n_head_kv=8, n_ff=14336),
}
