"""The replica's public request and response types: all the router side needs to know."""

from __future__ import annotations

import uuid

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.route_plan import RoutePlan
from baton_serve.cache_store.wire.sampling_params import SamplingParams, TokenLogprob

TARGET_REPLICA_KWARG = "target_replica"  # a replica call carrying it goes to that replica only


class GenerationRequest(BaseModel):
    """One generation: prompt tokens (with message boundaries) and sampling parameters."""

    model_config = ConfigDict(frozen=True, extra="forbid")  # a misnamed field is no default

    prompt: Prompt
    sampling: SamplingParams = SamplingParams()
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    return_logits: bool = False
    n: int = Field(default=1, ge=1, description="choices: one prefill, forked n ways")


class Usage(BaseModel):
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    completion_tokens: int


class Timings(BaseModel):
    """Where a request's time went on the engine, in seconds, one phase after the other, and
    the sequence-state bytes its slot copied between host memory and the llama context."""

    model_config = ConfigDict(frozen=True)

    queued_s: float = 0.0  # submitted, waiting for a slot
    restore_s: float = 0.0  # the slot readied: a reused prefix restored or cut back
    prefill_s: float = 0.0  # the rest of the prompt computed, to the first token
    decode_s: float = 0.0  # the rest of the reply generated
    restored_bytes: int = 0  # full states loaded into its slot (llama_state_seq_set_data)
    # Full states saved (llama_state_seq_get_data) as its slot was readied (an evicted slot's
    # KV) and at its prompt's checkpoints; the replay's, after the reply, are not in here.
    saved_bytes: int = 0
    # Partial states (recurrent and sliding-window memory, no attention KV): anchors kept at
    # its prompt's checkpoints, and the one its slot was rewound to.
    anchor_bytes: int = 0
    rewound_bytes: int = 0


class Completion(BaseModel):
    """The outcome of a finished request."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    request_id: str
    tokens: list[int]
    text: str
    finish_reason: str  # "stop", "length" or "cancelled"
    usage: Usage
    ttft_s: float | None  # from leaving the queue (restore included) to the first token
    total_s: float  # from leaving the queue to the end
    timings: Timings = Timings()
    logits: np.ndarray | None = None  # logits of the last sampling step, when asked for
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when asked for
    replica_id: str | None = None  # the replica that served it (set by `Replica`)
    index: int = 0  # which choice of an n > 1 request
    extra_choices: list[Completion] = Field(default_factory=list)  # choices 1 … n-1

    @property
    def choices(self) -> list[Completion]:
        """Every choice, in order (one for n = 1)."""
        return [self, *self.extra_choices]


class TokenEvent(BaseModel):
    """One generated token and the text it made visible (may be empty)."""

    model_config = ConfigDict(frozen=True)

    token: int
    text: str
    logprob: TokenLogprob | None = None
    index: int = 0  # which choice of an n > 1 request
    completion_tokens: int = 0  # this choice's tokens generated so far (usage on every chunk)
    cached_tokens: int = 0  # prompt tokens the replica reused from its cache


class Admitted(BaseModel):
    """The first item of a replica's stream: the request passed the replica's checks and is
    being served (a gateway can answer the client's headers now)."""

    replica_id: str = ""


class EngineError(RuntimeError):
    """The engine could not serve a request."""


class PromptTooLong(EngineError, ValueError):
    """The prompt does not fit the context window."""

    def __init__(self, prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(
            f"the prompt has {prompt_tokens} tokens but the context window is {n_ctx} tokens "
            f"(at most {n_ctx - 1} prompt tokens leave room for one generated token)"
        )
        self.prompt_tokens = prompt_tokens
        self.n_ctx = n_ctx


class InvalidGeneration(EngineError, ValueError):
    """The request asks for something the engine cannot do (e.g. a grammar llama.cpp
    cannot parse): the client's mistake. `param`: the request field at fault, if known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param)  # both in args: it survives pickling (Ray)
        self.message, self.param = message, param

    def __str__(self) -> str:
        return self.message


class EngineClosed(EngineError):
    """The engine was shut down."""


class EngineTimeout(EngineError):
    """A request passed its deadline (see `EngineConfig.floor_tokens_per_s`) and was
    cancelled: the engine is far slower than it should be, or stuck."""


class EngineStalled(EngineError):
    """The engine loop has work but has not completed a step for too long (stuck)."""


class ReplicaRequest(BaseModel):
    """What the gateway hands a replica: the generation, plus what routers read.

    `prefix_hashes` is the prompt's block hash chain, computed once by the gateway (Baton's
    router looks it up in its index copy; the replica uses it instead of hashing again);
    `plan` is the router's decision (set by Baton's router for the replica Ray picked; None
    for other routers and direct calls: the replica then decides itself); `prompt` / `messages` are the text forms that Ray Serve LLM's
    `PrefixCacheAffinityRouter` reads from the first argument of a call. `trace_context`
    carries the gateway's trace to the router and the replica (W3C `traceparent`, empty
    when tracing is off).
    """

    model_config = ConfigDict(frozen=True)

    generation: GenerationRequest
    prefix_hashes: tuple[bytes, ...] = ()
    prompt: str = ""
    chat_messages: list[dict[str, str]] | None = None
    trace_context: dict[str, str] = Field(default_factory=dict)
    plan: RoutePlan | None = None

    @property
    def messages(self) -> list[dict[str, str]] | str:
        """The chat messages, or the prompt text for a raw prompt (that router reads
        `.messages` whenever the attribute exists, so it is never None), or for a prompt
        given as token ids one character per id: a prefix of it is a prefix of the tokens,
        and that router divides by its length (on an empty text it raised ZeroDivisionError
        and retried the request for ever)."""
        if self.chat_messages is not None:
            return self.chat_messages
        return self.prompt or "".join(map(chr, self.generation.prompt.tokens))
