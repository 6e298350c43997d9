"""What makes a request unservable on an engine, found before it queues: a client's
mistake answered at once, never an engine fault."""

from __future__ import annotations

from baton_serve.cache_store.wire.protocol import (
    GenerationRequest,
    InvalidGeneration,
    PromptTooLong,
)
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.media_projector import MediaProjector
from baton_serve.replicas.engine.prompt import PromptError
from baton_serve.replicas.engine.prompt_media import check_prompt_ids
from baton_serve.replicas.engine.sampling import sampling_problem


def check_request(
    request: GenerationRequest,
    model: LlamaModel,
    n_ctx: int,
    n_slots: int,
    config: EngineConfig,
    projector: MediaProjector | None = None,
) -> None:
    """Raise `PromptError`, `PromptTooLong` or `InvalidGeneration` if `request` cannot be
    served by an engine of `model` (and `projector`, for images) with `n_slots` sequences of
    `n_ctx` tokens."""
    n_prompt = len(request.prompt)
    if n_prompt == 0:
        raise PromptError("the prompt is empty")
    if n_prompt >= n_ctx:
        raise PromptTooLong(n_prompt, n_ctx)
    check_prompt_ids(request.prompt, model.n_vocab, projector)
    if problem := sampling_problem(request.sampling, model, config):
        raise InvalidGeneration(problem)
    if request.n > n_slots:
        raise InvalidGeneration(f"n is {request.n}; this replica serves n <= {n_slots}", param="n")
