"""A checkpoint: a llama.cpp sequence state saved after a prefix of tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baton_serve.cache_store.checkpoints.state_blob import PayloadSeal
from baton_serve.cache_store.prefix_hash import token_array


@dataclass(eq=False)
class Checkpoint:
    """A llama.cpp sequence state saved after `tokens`; compares by identity.

    `state` is kept as given, as a read-only byte view: the checkpoint takes the buffer
    over (no copy; whoever made it must not write to it again). `seal` authenticates the
    state in its signed blob once known (`state_blob.PayloadSeal`), so exporting it again
    does not read the state again. `shared` is a handle to the same state in a store that peers read without
    a copy (a Ray ObjectRef, when the replica put it in Ray's object store; `state` is then
    a view of that copy), handed to peers instead of the bytes.
    """

    prefix_hash: bytes
    tokens: np.ndarray
    state: memoryview
    seal: PayloadSeal | None = None
    shared: object | None = None

    def __post_init__(self) -> None:
        tokens = np.array(token_array(self.tokens))  # always a private copy
        if len(tokens) == 0:
            raise ValueError("a checkpoint needs at least one token")
        tokens.flags.writeable = False
        self.tokens = tokens
        state = self.state.data if isinstance(self.state, np.ndarray) else memoryview(self.state)
        self.state = state.cast("B").toreadonly()

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return len(self.state) + self.tokens.nbytes
