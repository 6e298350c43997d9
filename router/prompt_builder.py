"""Prompts from OpenAI inputs, tokenised with the served model's own vocabulary and chat
template (loaded without weights), and their prefix hash chains for routing."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from baton_serve.cache_store.prefix_hash import PrefixHasher
from baton_serve.replicas.engine.engine_config import context_size
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.prompt import (
    ChatMessage,
    Prompt,
    PromptError,
    chat_prompt,
    model_chat_template,
    no_chat_template_message,
    text_prompt,
)
from baton_serve.router.chat_plan import TemplateTools
from baton_serve.router.errors import context_length_exceeded, invalid_request
from baton_serve.router.reply_parser import THINK_OPEN
from baton_serve.router.tool_calls import ToolFormat


class PromptBuilder:
    """Builds the prompts a replica of one model would build, and checks they fit."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        block_tokens: int,
        n_ctx: int,
        chat_template: str | None = None,
    ) -> None:
        self._model = LlamaModel(model_path, vocab_only=True)
        self._template = model_chat_template(self._model, chat_template)
        self.template_tools = (
            TemplateTools.probe(self._template)
            if self._template is not None
            else TemplateTools(ToolFormat.HERMES, False, False, False)
        )
        self._hasher = PrefixHasher(self._model.fingerprint, block_tokens)
        self.n_ctx = context_size(n_ctx, self._model.n_ctx_train)

    def from_messages(
        self, messages: Sequence[ChatMessage], extras: Mapping[str, Any] | None = None
    ) -> Prompt:
        """A chat rendered with the model's template (`extras`: more template variables),
        ending with the generation prompt."""
        if self._template is None:
            raise invalid_request(no_chat_template_message(self._model.name), param="messages")
        try:
            prompt = chat_prompt(self._model, self._template, messages, extras)
        except PromptError as exc:
            raise invalid_request(str(exc), param="messages") from exc
        return self.check_length(prompt)

    def from_text(self, text: str) -> Prompt:
        """Raw text, with BOS where the model wants one."""
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

    def check_length(self, prompt: Prompt) -> Prompt:
        """`prompt`, if it is not empty and leaves room for one generated token."""
        if not prompt.tokens:
            raise invalid_request("the prompt is empty")
        if len(prompt) + 1 > self.n_ctx:
            raise context_length_exceeded(len(prompt), self.n_ctx)
        return prompt

    def close(self) -> None:
        self._model.close()
