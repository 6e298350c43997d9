"""Prompts from OpenAI inputs, tokenised with the served model's own vocabulary and chat
template (loaded without weights), and their prefix hash chains for routing."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from baton_serve.cache_store.prefix_hash import PrefixHasher
from baton_serve.cache_store.wire.prompt_types import ChatMessage, MediaInput, Prompt
from baton_serve.replicas.engine.chat_segments import ChatText
from baton_serve.replicas.engine.engine_config import context_size
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.media_input import DecodedAudio, DecodedMedia
from baton_serve.replicas.engine.media_projector import MediaProjector, ProjectorError
from baton_serve.replicas.engine.prompt import (
    PromptError,
    RenderedTooLarge,
    model_chat_template,
    no_chat_template_message,
    render_chat,
    text_prompt,
    tokenize_chat,
)
from baton_serve.router.gateway.chat_plan import TemplateTools
from baton_serve.router.gateway.errors import (
    context_length_exceeded,
    invalid_request,
    prompt_too_large,
)
from baton_serve.router.gateway.media_parts import MediaKinds
from baton_serve.router.gateway.media_tokenizer import MediaTokenizer
from baton_serve.router.gateway.reply_parser import THINK_OPEN
from baton_serve.router.gateway.token_cache import TokenCache
from baton_serve.router.gateway.tool_calls import ToolFormat

# How a chat prompt ends: with the assistant's turn opened (OpenAI), after the last message
# (vLLM's add_generation_prompt false), or inside it, for the reply to continue it.
ChatEnding = Literal["generation_prompt", "last_message", "inside_last_message"]


class PromptBuilder:
    """Builds the prompts a replica of one model would build, and checks they fit.

    A prompt's text over `max_prompt_bytes` (a chat as its template renders it) is refused
    with a 413 before it is tokenised."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        block_tokens: int,
        n_ctx: int,
        chat_template: str | None = None,
        max_prompt_bytes: int | None = None,
        mmproj: str | None = None,
    ) -> None:
        """`mmproj`: the projector the replicas serve, loaded here (on the CPU) for the
        tokens each image or audio clip takes."""
        self.max_prompt_bytes = max_prompt_bytes
        self._model = LlamaModel(model_path, vocab_only=True)
        self._projector = (
            MediaProjector(mmproj, self._model, use_gpu=False, threads=1) if mmproj else None
        )
        self._chat_tokens = TokenCache(self._model)  # earlier messages come back each turn
        self._template = model_chat_template(self._model, chat_template)
        self.template_tools = (
            TemplateTools.probe(self._template)
            if self._template is not None
            else TemplateTools(ToolFormat.HERMES, False, False, False)
        )
        self._hasher = PrefixHasher(self._model.fingerprint, block_tokens)
        self.n_ctx = context_size(n_ctx, self._model.n_ctx_train)

    @functools.cached_property
    def media_kinds(self) -> MediaKinds:
        """What the served projector reads (nothing without one)."""
        projector = self._projector
        if projector is None:
            return MediaKinds()
        return MediaKinds(images=projector.takes_images, audio_rate=projector.audio_rate)

    def from_messages(
        self,
        messages: Sequence[ChatMessage],
        extras: Mapping[str, Any] | None = None,
        ending: ChatEnding = "generation_prompt",
        media: Sequence[DecodedMedia] = (),
    ) -> Prompt:
        """A chat rendered with the model's template (`extras`: more template variables),
        ending as `ending` says; `media`: the images and clips its messages' markers stand
        for."""
        if self._template is None:
            raise invalid_request(no_chat_template_message(self._model.name), param="messages")
        try:
            chat = render_chat(self._template, messages, extras, max_bytes=self.max_prompt_bytes)
            if ending != "generation_prompt":
                chat = self._without_generation_prompt(chat, messages, extras)
            if ending == "inside_last_message":
                chat = _cut_after_last_message(chat, messages[-1].content)
            self._refuse_unfitting(chat.text)
            if media:
                prompt = self._with_media(chat, messages, media)
            else:
                prompt = tokenize_chat(self._chat_tokens, chat, messages)
        except RenderedTooLarge as exc:
            raise prompt_too_large(exc.size, exc.limit, "messages", "max_prompt_bytes") from None
        except PromptError as exc:
            raise invalid_request(str(exc), param="messages") from exc
        return self.check_length(prompt)

    def _with_media(
        self, chat: ChatText, messages: Sequence[ChatMessage], media: Sequence[DecodedMedia]
    ) -> Prompt:
        projector = self._projector
        assert projector is not None  # the gateway reads no media for a model without one
        try:
            item_tokens = [
                projector.layout(item).tokens(projector.identity(item.digest)) for item in media
            ]
        except ProjectorError as exc:
            raise invalid_request(str(exc), param="messages") from None
        tokenizer = MediaTokenizer(self._chat_tokens, [_wire(item) for item in media], item_tokens)
        prompt = tokenize_chat(tokenizer, chat, messages)
        return prompt.model_copy(update={"media": tuple(tokenizer.used)})

    def from_text(self, text: str) -> Prompt:
        """Raw text, with BOS where the model wants one."""
        self.check_text(text, "prompt")
        try:
            prompt = text_prompt(self._model, text, add_bos=self._model.add_bos)
        except PromptError as exc:
            raise invalid_request(str(exc), param="prompt") from exc
        return self.check_length(prompt)

    def from_token_ids(self, ids: Sequence[int]) -> Prompt:
        """Token ids used exactly as given."""
        n_vocab = self._model.n_vocab
        if not all(0 <= token < n_vocab for token in ids):
            raise invalid_request(f"token ids must be in [0, {n_vocab})", param="prompt")
        return self.check_length(Prompt(tokens=tuple(ids)))

    def _without_generation_prompt(
        self, chat: ChatText, messages: Sequence[ChatMessage], extras: Mapping[str, Any] | None
    ) -> ChatText:
        if chat.pieces:  # the tail is the generation prompt
            return ChatText(pieces=chat.pieces, tail="")
        assert self._template is not None
        return ChatText(
            pieces=(),
            tail=self._template.render(messages, add_generation_prompt=False, extras=extras),
        )

    @property
    def n_vocab(self) -> int:
        return self._model.n_vocab

    @property
    def has_text(self) -> bool:
        return self._model.has_text

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """Raises `PromptError` for a vocabulary without text."""
        return self._model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token: int) -> bytes:
        """The text bytes of one token (empty for a vocabulary without text)."""
        return self._model.token_bytes(token)

    def opens_reasoning(self, prompt: Prompt) -> bool:
        """Whether the prompt ends inside an opened `<think>` (the reply starts reasoning)."""
        if not self.template_tools.reasoning or not self._model.has_text:
            return False
        tail = b"".join(self._model.token_bytes(t) for t in prompt.tokens[-8:])
        return tail.decode("utf-8", errors="replace").rstrip().endswith(THINK_OPEN)

    def hashes(self, prompt: Prompt) -> tuple[bytes, ...]:
        """The prompt's block hash chain (what the router looks up in the index)."""
        return tuple(self._hasher.chain(prompt.tokens))

    def check_text(self, text: str, param: str) -> None:
        """Refuse `text`, field `param`'s, before it is tokenised: larger than
        `max_prompt_bytes` (413), or too long to fit the context (400)."""
        limit = self.max_prompt_bytes
        if limit is not None and len(text) > limit // 4:  # ≥ 1 byte a character
            size = len(text.encode("utf-8", errors="surrogatepass"))
            if size > limit:
                raise prompt_too_large(size, limit, param, "max_prompt_bytes")
        self._refuse_unfitting(text, param)

    def _refuse_unfitting(self, text: str, param: str | None = None) -> None:
        """Refuse text that cannot fit the context before spending time tokenising it: no
        token stands for more bytes than the vocabulary's longest, so the text has at least
        its size over that many tokens."""
        if len(text) * 4 < self.n_ctx or not self._model.has_text:  # fewer bytes than n_ctx
            return
        at_least = -(-len(text.encode("utf-8", errors="surrogatepass")) // self._longest_token)
        if at_least + 1 > self.n_ctx:
            raise context_length_exceeded(at_least, self.n_ctx, at_least=True, param=param)

    @functools.cached_property
    def _longest_token(self) -> int:
        """The most bytes one token stands for (found once, when a long text first asks)."""
        return max(1, *(len(self._model.token_bytes(t)) for t in range(self._model.n_vocab)))

    def check_length(self, prompt: Prompt) -> Prompt:
        """`prompt`, if it is not empty and leaves room for one generated token."""
        if not prompt.tokens:
            raise invalid_request("the prompt is empty")
        if len(prompt) + 1 > self.n_ctx:
            raise context_length_exceeded(len(prompt), self.n_ctx)
        return prompt

    def close(self) -> None:
        if self._projector is not None:
            self._projector.close()
        self._model.close()


def _wire(item: DecodedMedia) -> MediaInput:
    """What travels to the replica of an image or clip: the file as sent, its digest."""
    audio_format = item.audio_format if isinstance(item, DecodedAudio) else None
    return MediaInput(digest=item.digest, data=item.source, audio_format=audio_format)


def _cut_after_last_message(chat: ChatText, content: str | None) -> ChatText:
    """`chat` ending right after the last message's text (what closes the message, such as
    an end-of-turn token, cut off), as vLLM's continue_final_message does."""
    if chat.pieces:
        *parts, last = chat.pieces[-1]
        end = last.rfind(content) if content else -1
        if end >= 0:
            last_piece = (*parts, last[: end + len(content or "")])
            return ChatText(pieces=(*chat.pieces[:-1], last_piece), tail="")
    else:
        end = chat.tail.rfind(content) if content else -1
        if end >= 0:
            return ChatText(pieces=(), tail=chat.tail[: end + len(content or "")])
    raise invalid_request(
        "continue_final_message: the chat template does not show the last message's text "
        "as it was sent, so the reply cannot continue it.",
        param="continue_final_message",
    )
