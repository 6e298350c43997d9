"""The tokenizer a generated model (`tiny_model`) carries: SmolLM2's (from its GGUF, or any
file's `tokenizer.*` keys), llama.cpp's test vocabulary, or none, as its `ModelVariant`
asks, with the variant's special-token changes."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Protocol

import gguf

from baton_serve.replicas.models.default_model import default_model_path

TEST_VOCAB_SIZE = 512  # the "test" and "none" vocabularies

_KeyValue = tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]


class VocabularyChoices(Protocol):
    """What of a `tiny_model.ModelVariant` decides its tokenizer keys (read only)."""

    @property
    def vocab(self) -> str: ...
    @property
    def bos(self) -> bool: ...
    @property
    def eos(self) -> bool: ...
    @property
    def chat_template(self) -> bool: ...
    @property
    def special_ids_out_of_vocab(self) -> bool: ...
    @property
    def extra_eog(self) -> int | None: ...


@functools.lru_cache(maxsize=4)
def _tokenizer_kv(path: Path) -> tuple[_KeyValue, ...]:
    """Every ``tokenizer.*`` key/value of the GGUF file at ``path``, with its GGUF types."""
    items = []
    for key, field in gguf.GGUFReader(path).fields.items():
        if key.startswith("tokenizer."):
            vtype, *sub_types = (gguf.GGUFValueType(t) for t in field.types)
            items.append((key, field.contents(), vtype, sub_types[0] if sub_types else None))
    return tuple(items)


def vocabulary_kv(
    tokenizer_from: str | Path | None, variant: VocabularyChoices
) -> tuple[list[_KeyValue], int]:
    """The ``tokenizer.*`` key/values of ``variant`` and the vocabulary size."""
    if variant.vocab == "none":
        return [("tokenizer.ggml.model", "none", gguf.GGUFValueType.STRING, None)], TEST_VOCAB_SIZE
    if variant.vocab == "test":
        items: list[_KeyValue] = [
            ("tokenizer.ggml.model", "test", gguf.GGUFValueType.STRING, None),
            (
                "tokenizer.ggml.tokens",
                [f"<t{i}>" for i in range(TEST_VOCAB_SIZE)],
                gguf.GGUFValueType.ARRAY,
                gguf.GGUFValueType.STRING,
            ),
            ("tokenizer.ggml.bos_token_id", 1, gguf.GGUFValueType.UINT32, None),
            ("tokenizer.ggml.eos_token_id", 2, gguf.GGUFValueType.UINT32, None),
            ("tokenizer.ggml.add_bos_token", variant.bos, gguf.GGUFValueType.BOOL, None),
        ]
    else:
        source = Path(tokenizer_from or default_model_path()).resolve()
        items = list(_tokenizer_kv(source))
    n_vocab = len(next(value for key, value, *_ in items if key == "tokenizer.ggml.tokens"))
    dropped = set()
    if not variant.bos:
        dropped.add("tokenizer.ggml.bos_token_id")
    if not variant.eos:
        dropped.add("tokenizer.ggml.eos_token_id")
    if not variant.chat_template:
        dropped.add("tokenizer.chat_template")
    items = [item for item in items if item[0] not in dropped]
    if variant.special_ids_out_of_vocab:
        out_of_vocab = {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"}
        items = [
            (key, n_vocab + 7, *types) if key in out_of_vocab else (key, value, *types)
            for key, value, *types in items
        ]
    if variant.extra_eog is not None:
        if not 0 <= variant.extra_eog < n_vocab:
            raise ValueError(f"extra_eog must be a token id in [0, {n_vocab})")
        items.append(
            ("tokenizer.ggml.eot_token_id", variant.extra_eog, gguf.GGUFValueType.UINT32, None)
        )
    return items, n_vocab
