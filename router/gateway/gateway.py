"""The OpenAI-compatible HTTP gateway, independent of how replicas are reached.

`create_app` serves /v1/chat/completions, /v1/completions, /v1/models, /health, and
llama-server's /tokenize and /detokenize. A request is checked, tokenised and hashed here,
then handed to a `ReplicaClient` (a `Replica` in process, or a router over many) as a
`ReplicaRequest`; the answer goes back as OpenAI JSON or as server-sent events.

One body cannot take the gateway over: message and prompt counts are bounded before any
rendering, a prompt's text before tokenising, and both run on a few threads off the event
loop. With API keys, every path but `PUBLIC_PATHS` needs one.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Protocol

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from baton_serve.cache_store.telemetry import tracing
from baton_serve.cache_store.telemetry.logs import bound_request
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import (
    Completion,
    GenerationRequest,
    ReplicaRequest,
)
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.media_input import DecodedMedia, MediaBounds, MediaError
from baton_serve.router.gateway import openai_types as api
from baton_serve.router.gateway.chunks import (
    ChatChunks,
    ReplyIds,
    ReplyReader,
    TextChunks,
    chat_choice,
)
from baton_serve.router.gateway.errors import (
    install_error_handlers,
    invalid_request,
    model_not_found,
)
from baton_serve.router.gateway.event_stream import (
    ReplicaStream,
    UsageChunks,
    event_stream,
    finish_reason,
    usage_of,
)
from baton_serve.router.gateway.gateway_work import PromptThreads, Readiness, all_or_none
from baton_serve.router.gateway.grammar_limits import GrammarLimits
from baton_serve.router.gateway.guided import template_variables
from baton_serve.router.gateway.http_telemetry import HTTPTelemetry
from baton_serve.router.gateway.list_bounds import (
    MAX_DOCUMENTS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGE_PARTS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
    BoundLists,
    ListBounds,
)
from baton_serve.router.gateway.logprobs import LogprobFormat
from baton_serve.router.gateway.media_parts import has_media, read_media
from baton_serve.router.gateway.middleware import APIKeyAuth, BodySizeLimit
from baton_serve.router.gateway.prompt_builder import ChatEnding, PromptBuilder
from baton_serve.router.gateway.reply_budget import ReplyBudget
from baton_serve.router.gateway.reply_grammar import ReplyGrammars
from baton_serve.router.gateway.token_ids import in_vocabulary, logit_bias_pairs
from baton_serve.router.gateway.tokenizer_api import TokenizerAPI
from baton_serve.router.gateway.transport_defaults import BODY_READ_TIMEOUT_S

PUBLIC_PATHS = frozenset({"/health"})  # with API keys, every other path needs one
REPLICA_HEADER = "X-Baton-Replica"  # on non-streamed replies: the replica(s) that served them

GenerationBody = api.ChatCompletionRequest | api.CompletionRequest


class ReplicaClient(Protocol):
    """Where the gateway sends requests: one replica, or a router over several."""

    async def generate(self, request: ReplicaRequest) -> Completion: ...

    def stream(self, request: ReplicaRequest) -> ReplicaStream:
        """Tokens as they are generated, then the `Completion`; closing it early cancels."""
        ...


@dataclass(frozen=True)
class GatewaySettings:
    model_name: str
    model_path: str
    n_ctx: int  # 0: the model's training context
    block_tokens: int = 64
    chat_template: str | None = None  # instead of the model's own
    stream_ping_s: float = 15.0  # an SSE comment after this long without an event (0: none)
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    max_body_bytes: int = 4 << 20
    body_read_timeout_s: float = BODY_READ_TIMEOUT_S  # the whole body, else 408
    max_tokens_cap: int | None = None  # the most tokens a choice may generate (None: n_ctx)
    max_request_tokens: int | None = None  # reply_budget's work budget (None: 16 × n_ctx)
    max_tools: int = MAX_TOOLS
    max_documents: int = MAX_DOCUMENTS
    max_logit_bias: int = MAX_LOGIT_BIAS  # entries
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    max_message_parts: int = MAX_MESSAGE_PARTS  # content parts and tool calls, all messages
    max_messages: int = 2048  # in one chat request
    max_prompts: int = 256  # in one completion request
    max_prompt_bytes: int = 4 << 20  # a prompt's text: a chat as rendered, or one prompt
    prompt_threads: int = 4  # chats rendered and prompts tokenised at once, off the event loop
    grammar_limits: GrammarLimits = GrammarLimits()  # a reply's grammar; strict calls' checks
    engine: str | None = None  # what computes, for /health ("llama.cpp", "emulated:NAME")
    mmproj: str | None = None  # the multimodal projector the replicas serve
    media_bounds: MediaBounds = MediaBounds()  # images and clips a chat may carry


def create_app(
    settings: GatewaySettings,
    replicas: ReplicaClient,
    *,
    ready: Callable[[], Awaitable[bool]] | None = None,
) -> FastAPI:
    """The gateway for one model; `ready()` answers /health (always ready if not given)."""
    builder = PromptBuilder(
        settings.model_path,
        block_tokens=settings.block_tokens,
        n_ctx=settings.n_ctx,
        chat_template=settings.chat_template,
        max_prompt_bytes=settings.max_prompt_bytes,
        mmproj=settings.mmproj,
    )
    threads = PromptThreads(settings.prompt_threads)
    gateway = _Gateway(settings, replicas, builder, threads, Readiness(ready) if ready else None)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            builder.close()

    app = FastAPI(title="Baton", summary="OpenAI-compatible API", lifespan=lifespan)
    install_error_handlers(app)
    app.add_api_route(
        "/v1/chat/completions", gateway.chat, methods=["POST"], response_model=api.ChatCompletion
    )
    app.add_api_route(
        "/v1/completions", gateway.complete, methods=["POST"], response_model=api.TextCompletion
    )
    app.add_api_route("/v1/models", gateway.models, methods=["GET"], response_model=api.ModelList)
    app.add_api_route("/health", gateway.health, methods=["GET"])
    tokenizer = TokenizerAPI(builder, threads)
    app.add_api_route("/tokenize", tokenizer.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", tokenizer.detokenize, methods=["POST"])
    bounds = ListBounds(
        max_messages=settings.max_messages,
        max_prompts=settings.max_prompts,
        max_tools=settings.max_tools,
        max_documents=settings.max_documents,
        max_logit_bias=settings.max_logit_bias,
        max_stop_token_ids=settings.max_stop_token_ids,
        max_message_parts=settings.max_message_parts,
    )
    app.add_middleware(BoundLists, bounds=bounds)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_body_bytes,
        read_timeout_s=settings.body_read_timeout_s,
    )
    if settings.api_keys:
        app.add_middleware(APIKeyAuth, keys=settings.api_keys, public=PUBLIC_PATHS)
    app.add_middleware(HTTPTelemetry)  # the outermost: its span covers all the others
    return app


class _Gateway:
    """The endpoints, bound to one model's settings, prompt builder and replicas."""

    def __init__(
        self,
        settings: GatewaySettings,
        replicas: ReplicaClient,
        builder: PromptBuilder,
        threads: PromptThreads,
        ready: Readiness | None,
    ) -> None:
        self._settings = settings
        self._replicas = replicas
        self._builder = builder
        self._ready = ready
        self._started = int(time.time())
        self._logprobs = LogprobFormat(builder.token_bytes)
        self._prompt_threads = threads
        self._grammars = ReplyGrammars(settings.grammar_limits, threads)
        self._budget = ReplyBudget(
            builder.n_ctx, settings.max_tokens_cap, settings.max_request_tokens
        )

    async def chat(self, body: api.ChatCompletionRequest) -> Response:
        self._check_model(body.model)
        self._budget.check_asked(body, prompts=1)
        media: tuple[DecodedMedia, ...] = ()
        if has_media(body.messages):
            bounds, kinds = self._settings.media_bounds, self._builder.media_kinds
            try:
                marked, media = await read_media(body.messages, bounds, kinds, self._prompt_threads)
            except MediaError as exc:
                raise invalid_request(str(exc), param=exc.param) from None
            body = body.model_copy(update={"messages": marked})
        tools = self._builder.template_tools
        plan = await self._grammars.plan(body, tools)
        grammar = await self._grammars.chat(body, plan)
        sampling = self._sampling(body, grammar)
        extras = template_variables(body, plan.extras)
        with tracing.span("tokenise") as span:
            prompt = await self._prompt_threads.run(
                self._builder.from_messages, plan.messages, extras, _chat_ending(body), media
            )
            span.set_attribute("baton.prompt_tokens", len(prompt))
        (max_tokens,) = self._budget.replies(body, [len(prompt)])
        request_id = bound_request() or uuid.uuid4().hex
        routed = [{"role": m.role, "content": m.content or ""} for m in plan.messages]
        call = self._replica_request(
            prompt, body, request_id, sampling, max_tokens, messages=routed
        )
        in_reasoning = self._builder.opens_reasoning(prompt)

        def reader() -> ReplyReader:  # one per choice
            parser = plan.reply_parser(tools, in_reasoning)
            return self._grammars.reader(parser, plan, reasoning=body.include_reasoning)

        reply_id = f"chatcmpl-{body.request_id or request_id}"
        reply = ReplyIds(reply_id, int(time.time()), self._settings.model_name)
        if body.stream:
            return await event_stream(
                self._replicas.stream(call),
                ChatChunks(reply, reader, self._logprobs),
                _usage_chunks(body, len(prompt)),
                self._settings.stream_ping_s,
            )
        done = await self._replicas.generate(call)
        read = [partial(chat_choice, c, reader(), self._logprobs) for c in done.choices]
        choices = [await self._prompt_threads.run(r) if plan.tools else r() for r in read]
        return _json(
            api.ChatCompletion(**asdict(reply), choices=choices, usage=usage_of([done])), [done]
        )

    async def complete(self, body: api.CompletionRequest) -> Response:
        self._check_model(body.model)
        if body.stream and len(body.prompt) > 1:
            raise invalid_request("Streaming takes a single prompt.", param="prompt")
        self._budget.check_asked(body, prompts=len(body.prompt))
        grammar = await self._grammars.guided(body)
        sampling = self._sampling(body, grammar)
        with tracing.span("tokenise") as span:
            prompts = await self._prompt_threads.run_prompts(self._completion_prompts, body.prompt)
            span.set_attribute("baton.prompt_tokens", sum(len(p) for p in prompts))
        replies = self._budget.replies(body, [len(p) for p in prompts])
        request_id = bound_request() or uuid.uuid4().hex
        calls = []
        for i, (prompt, given) in enumerate(zip(prompts, body.prompt, strict=True)):
            text = given if isinstance(given, str) else ""
            # One prompt keeps the request's id (so its replica's log lines name it).
            call_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            calls.append(
                self._replica_request(prompt, body, call_id, sampling, replies[i], text=text)
            )
        echoed = [
            self._echoed(p, given) if body.echo else "" for p, given in zip(prompts, body.prompt)
        ]
        reply_id = f"cmpl-{body.request_id or request_id}"
        reply = ReplyIds(reply_id, int(time.time()), self._settings.model_name)
        if body.stream:
            chunks = TextChunks(reply, self._logprobs, echo=echoed[0], n=body.n)
            return await event_stream(
                self._replicas.stream(calls[0]),
                chunks,
                _usage_chunks(body, len(prompts[0])),
                self._settings.stream_ping_s,
            )
        done = await all_or_none([self._replicas.generate(call) for call in calls])
        choices = [  # prompt-major, as OpenAI numbers them
            api.CompletionChoice(
                index=i * body.n + c.index,
                text=echoed[i] + c.text,
                finish_reason=finish_reason(c),
                logprobs=None if c.logprobs is None else self._logprobs.completion(c.logprobs),
            )
            for i, d in enumerate(done)
            for c in d.choices
        ]
        return _json(
            api.TextCompletion(**asdict(reply), choices=choices, usage=usage_of(done)), done
        )

    async def models(self) -> Response:
        modalities = self._builder.media_kinds.modalities()
        card = api.ModelCard(
            id=self._settings.model_name, created=self._started, modalities=modalities
        )
        return _json(api.ModelList(data=[card]))

    async def health(self) -> JSONResponse:
        ok = self._ready is None or await self._ready.check()
        body = {"status": "ok" if ok else "unavailable"}
        if self._settings.engine:
            body["engine"] = self._settings.engine
        return JSONResponse(body, status_code=200 if ok else 503)

    def _check_model(self, model: str) -> None:
        if model != self._settings.model_name:
            raise model_not_found(model, self._settings.model_name)

    def _echoed(self, prompt: Prompt, given: str | list[int]) -> str:
        """The prompt's text for `echo` (token ids given: their text)."""
        if isinstance(given, str):
            return given
        text = b"".join(self._builder.token_bytes(t) for t in prompt.tokens)
        return text.decode("utf-8", errors="replace")

    def _completion_prompts(self, prompts: Sequence[str | list[int]]) -> list[Prompt]:
        build = self._builder
        return [
            build.from_text(p) if isinstance(p, str) else build.from_token_ids(p) for p in prompts
        ]

    def _replica_request(
        self,
        prompt: Prompt,
        body: GenerationBody,
        request_id: str,
        sampling: SamplingParams,
        max_tokens: int,
        *,
        text: str = "",
        messages: list[dict[str, str]] | None = None,
    ) -> ReplicaRequest:
        """`prompt`'s request: `sampling` (from `_sampling`) with its own `max_tokens`."""
        if body.min_tokens > max_tokens:
            raise invalid_request(
                f"min_tokens is {body.min_tokens}, more than the {max_tokens} tokens this "
                "request may generate.",
                param="min_tokens",
            )
        sampling = sampling.model_copy(update={"max_tokens": max_tokens})
        with tracing.span("hash") as span:
            hashes = self._builder.hashes(prompt)
            span.set_attribute("baton.blocks", len(hashes))
        return ReplicaRequest(
            generation=GenerationRequest(
                prompt=prompt, sampling=sampling, request_id=request_id, n=body.n
            ),
            prefix_hashes=hashes,
            prompt=text,
            chat_messages=messages,
            trace_context=tracing.inject(),
        )

    def _sampling(self, body: GenerationBody, grammar: str | None) -> SamplingParams:
        """How the request's tokens are picked, its token ids checked against the
        vocabulary (`max_tokens` is each prompt's own: `_replica_request` sets it)."""
        n_vocab = self._builder.n_vocab
        return SamplingParams(
            temperature=body.temperature,
            top_k=body.top_k if 0 < body.top_k < n_vocab else 0,  # ≥ n_vocab: keeps every token
            top_p=body.top_p,
            min_p=body.min_p,
            typical_p=body.typical_p,
            top_n_sigma=body.top_n_sigma,
            xtc_probability=body.xtc_probability,
            xtc_threshold=body.xtc_threshold,
            mirostat=body.mirostat,
            mirostat_tau=body.mirostat_tau,
            mirostat_eta=body.mirostat_eta,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=logit_bias_pairs(body.logit_bias, n_vocab),
            seed=body.seed,
            stop=tuple(body.stop),
            stop_token_ids=tuple(in_vocabulary(body.stop_token_ids, n_vocab, "stop_token_ids")),
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            logprobs=body.logprobs_count,
            grammar=grammar,
        )


def _chat_ending(body: api.ChatCompletionRequest) -> ChatEnding:
    if body.continue_final_message:
        return "inside_last_message"
    return "generation_prompt" if body.add_generation_prompt else "last_message"


def _usage_chunks(body: GenerationBody, prompt_tokens: int) -> UsageChunks:
    return UsageChunks(body.include_usage, body.continuous_usage, prompt_tokens)


# ---- responses -----------------------------------------------------------------------------


def _json(body: BaseModel, done: Sequence[Completion] = ()) -> Response:
    served_by = ",".join(dict.fromkeys(d.replica_id for d in done if d.replica_id))
    headers = {REPLICA_HEADER: served_by} if served_by else None
    return Response(body.model_dump_json(), media_type="application/json", headers=headers)
