"""The engine's face: everything code outside `replicas/engine/` may call on an engine.

Outside code holds an engine as an `EngineFace`; only where one is built (the replica's
deployment and actor, the demo, the benches) names the class `Engine`, which implements it
(`tests/test_engine_face.py` checks both). What is behind the face — the prefix cache, its
store, the slots, the step — can change without any other room noticing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from baton_serve.cache_store.checkpoints.checkpoint_store import Checkpoint, Stored
from baton_serve.cache_store.checkpoints.state_blob import BlobParts, Buffer
from baton_serve.cache_store.wire.prompt_types import ChatMessage, Prompt
from baton_serve.cache_store.wire.protocol import Completion, GenerationRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine_checkpoints import StoreFigures
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_model import LlamaModel, ModelKind
from baton_serve.replicas.engine.prefix_states import CheckpointListener
from baton_serve.replicas.engine.request_handle import RequestHandle
from baton_serve.replicas.engine.stats import EngineLoad, EngineStats


@runtime_checkable
class EngineFace(Protocol):
    """One llama.cpp context serving requests, and its checkpoints (see `Engine`)."""

    config: EngineConfig
    model: LlamaModel
    kind: ModelKind
    fingerprint: bytes
    stats: EngineStats
    n_ctx: int

    # ---- requests and lifecycle ----------------------------------------------------------

    def text_prompt(self, text: str) -> Prompt: ...

    def chat_prompt(self, messages: list[ChatMessage] | list[dict[str, str]]) -> Prompt: ...

    def check(self, request: GenerationRequest) -> None: ...

    def submit(
        self, request: GenerationRequest, prefix_hashes: Sequence[bytes] = ()
    ) -> RequestHandle: ...

    def generate(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        return_logits: bool = False,
    ) -> Completion: ...

    def load(self) -> EngineLoad: ...

    def check_health(self) -> None: ...

    def wait_idle(self, timeout: float | None = None) -> bool: ...

    def stop(self) -> None: ...

    def close(self) -> None: ...

    # ---- checkpoints (`EngineCheckpoints`) -----------------------------------------------

    def checkpoints(self, *, on_disk: bool = False) -> list[Stored]: ...

    def checkpoint_prefixing(self, tokens: Sequence[int]) -> Checkpoint | None: ...

    def store_figures(self) -> StoreFigures: ...

    def local_reuse(
        self, tokens: Sequence[int], prefix_hashes: Sequence[bytes] = ()
    ) -> tuple[int, float]: ...

    def checkpoint_positions(self, prompt: Prompt) -> list[int]: ...

    def prefill_progress(
        self, tokens: Sequence[int], min_tokens: int
    ) -> tuple[int, int] | None: ...

    def replay_share(self, tokens: Sequence[int]) -> int: ...

    def keep_for_peer(self, tokens: Sequence[int], min_tokens: int, wait_s: float) -> None: ...

    def export_best(
        self, tokens: Sequence[int], min_tokens: int = 0
    ) -> tuple[tuple[bytes, memoryview], object | None] | None: ...

    def export_checkpoint(self, prefix_hash: bytes) -> tuple[bytes, memoryview] | None: ...

    def import_checkpoint(self, blob: Buffer | BlobParts) -> Checkpoint: ...

    def share_states(self, share: Callable[[Checkpoint], None]) -> None: ...

    def add_checkpoint_listener(self, listener: CheckpointListener) -> None: ...

    def hash_chain(self, tokens: Sequence[int], known: Sequence[bytes] = ()) -> list[bytes]: ...

    def carried_chain(
        self, tokens: Sequence[int], prefix_hashes: Sequence[bytes]
    ) -> tuple[bytes, ...]: ...

    def prefix_hash(self, tokens: Sequence[int]) -> bytes: ...

    def state_bytes(self, n_tokens: int) -> int: ...

    @property
    def state_size(self) -> tuple[int, int] | None: ...

    @property
    def largest_state_bytes(self) -> int: ...
