"""`/tokenize` and `/detokenize`, in llama-server's shapes and with its defaults, on the
served model's own vocabulary.

Bounded as prompts are: a text to tokenise is refused over `max_prompt_bytes` (413) or when
it cannot fit the context (400, before tokenising; also when its tokens do not), and a
detokenize takes at most the context's tokens (400, before any id is looked at). Both run
on the gateway's worker threads, off the event loop."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from baton_serve.replicas.engine.prompt import PromptError
from baton_serve.router.gateway.errors import context_length_exceeded, invalid_request
from baton_serve.router.gateway.gateway_work import PromptThreads
from baton_serve.router.gateway.prompt_builder import PromptBuilder


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    content: str
    add_special: bool = Field(default=False, description="add BOS where the model wants one")
    parse_special: bool = Field(default=True, description="read special tokens in the text")
    with_pieces: bool = Field(default=False, description="each id with its text")


class TokenPiece(BaseModel):
    id: int
    piece: str | list[int]  # the text, or its bytes where they are not whole UTF-8


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[TokenPiece]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: list[int]


class DetokenizeResponse(BaseModel):
    content: str


class TokenizerAPI:
    """The two endpoints, over one model's vocabulary."""

    def __init__(self, builder: PromptBuilder, threads: PromptThreads) -> None:
        self._builder = builder
        self._threads = threads

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        return await self._threads.run(self._tokenize, body)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        if len(body.tokens) > self._builder.n_ctx:
            raise invalid_request(
                f"tokens: {len(body.tokens)} ids; this server detokenizes at most "
                f"{self._builder.n_ctx}, its context (the n_ctx setting).",
                param="tokens",
            )
        return await self._threads.run(self._detokenize, body.tokens)

    def _tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self._builder.check_text(body.content, "content")
        try:
            ids = self._builder.tokenize(body.content, body.add_special, body.parse_special)
        except PromptError as exc:
            raise invalid_request(str(exc), param="content") from None
        if len(ids) > self._builder.n_ctx:
            raise context_length_exceeded(len(ids), self._builder.n_ctx, param="content")
        if not body.with_pieces:
            return TokenizeResponse(tokens=ids)
        return TokenizeResponse(tokens=[TokenPiece(id=i, piece=self._piece(i)) for i in ids])

    def _detokenize(self, tokens: list[int]) -> DetokenizeResponse:
        n_vocab = self._builder.n_vocab
        bad = [token for token in tokens if not 0 <= token < n_vocab]
        if bad:
            message = f"token id {bad[0]} is not in the vocabulary [0, {n_vocab})."
            raise invalid_request(message, param="tokens")
        if not self._builder.has_text:
            raise invalid_request("this model's vocabulary has no text.", param="tokens")
        data = b"".join(self._builder.token_bytes(token) for token in tokens)
        return DetokenizeResponse(content=data.decode("utf-8", errors="replace"))

    def _piece(self, token: int) -> str | list[int]:
        data = self._builder.token_bytes(token)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return list(data)
