"""A checkpoint: a llama.cpp sequence state saved after a prefix of tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baton_serve.cache_store.prefix_hash import token_array


@dataclass(eq=False)
class Checkpoint:
    """A llama.cpp sequence state saved after `tokens`; compares by identity."""

    prefix_hash: bytes
    tokens: np.ndarray
    state: bytes

    def __post_init__(self) -> None:
        tokens = np.array(token_array(self.tokens))  # always a private copy
        if len(tokens) == 0:
            raise ValueError("a checkpoint needs at least one token")
        tokens.flags.writeable = False
        self.tokens = tokens
        self.state = bytes(self.state)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return len(self.state) + self.tokens.nbytes
