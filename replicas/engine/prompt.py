"""Prompts as token ids, with the token offsets where chat messages start.

Chat messages are rendered with the model's own Jinja chat template (sandboxed). Each
message's rendered text is tokenized on its own and the pieces are concatenated, so a
conversation's tokens are a stable prefix of the next turn's tokens — which is what
prefix reuse needs — and every message start is an exact token offset. Rendering and
cutting take time linear in the number of messages (`chat_segments`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from baton_serve.cache_store.wire.prompt_types import ChatMessage, Prompt
from baton_serve.replicas.engine.chat_segments import ChatText, segment_chat


class PromptError(ValueError):
    """The prompt cannot be built (bad messages, no chat template, template error)."""


class RenderedTooLarge(PromptError):
    """A chat rendered to more text than the server accepts."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the rendered chat is {size} bytes, over the limit of {limit}")
        self.size = size
        self.limit = limit


class Tokenizer(Protocol):
    def tokenize(
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]: ...

    def token_text(self, token: int) -> str: ...


class ChatTemplate:
    """A model's chat template, rendered in a Jinja sandbox the way Hugging Face renders
    it (loop controls, a `tojson` that keeps non-ASCII text, `raise_exception`)."""

    def __init__(self, source: str, *, bos_token: str, eos_token: str) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_template_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise PromptError(f"the model's chat template does not parse: {exc}") from exc
        self.source = source
        self._specials = {"bos_token": bos_token, "eos_token": eos_token}

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool,
        extras: Mapping[str, Any] | None = None,
    ) -> str:
        """`extras`: more template variables (`tools`, `chat_template_kwargs`' entries)."""
        views = [m.template_view() for m in messages]
        return self.render_views(
            views, add_generation_prompt=add_generation_prompt, extras=extras or {}
        )

    def render_views(
        self,
        views: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        extras: Mapping[str, Any],
    ) -> str:
        """`render` of messages already in their template view."""
        return "".join(
            self.stream_views(views, add_generation_prompt=add_generation_prompt, extras=extras)
        )

    def stream_views(
        self,
        views: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        extras: Mapping[str, Any],
    ) -> Iterator[str]:
        """The rendering as the template produces it, chunk by chunk."""
        chunks = self._template.generate(
            **extras,
            messages=views,
            add_generation_prompt=add_generation_prompt,
            **self._specials,
        )
        try:
            yield from chunks
        except PromptError:
            raise
        except Exception as exc:  # the template is model data: any failure is a bad prompt
            raise PromptError(f"chat template error: {exc}") from exc


class TemplatedModel(Tokenizer, Protocol):
    chat_template: str | None
    bos_token: int | None
    eos_token: int | None


def model_chat_template(model: TemplatedModel, override: str | None = None) -> ChatTemplate | None:
    """`override` (a Jinja chat template), else the model's own; None if neither exists.

    A model without BOS or EOS renders them as empty text.
    """
    source = override or model.chat_template
    if not source:
        return None
    return ChatTemplate(
        source,
        bos_token="" if model.bos_token is None else model.token_text(model.bos_token),
        eos_token="" if model.eos_token is None else model.token_text(model.eos_token),
    )


def no_chat_template_message(model_name: str) -> str:
    """The error for a chat request to a model without a chat template, naming the fixes."""
    return (
        f"model {model_name} has no chat template (its GGUF has no tokenizer.chat_template): "
        "send a prompt to /v1/completions, or start Baton with --chat-template FILE"
    )


def _raise_template_exception(message: str) -> None:
    raise PromptError(f"chat template rejected the messages: {message}")


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def text_prompt(tokenizer: Tokenizer, text: str, *, add_bos: bool) -> Prompt:
    """A raw text prompt (OpenAI completions): BOS where the model wants one."""
    return Prompt(tokens=tuple(tokenizer.tokenize(text, add_special=add_bos)))


def chat_prompt(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: Sequence[ChatMessage],
    extras: Mapping[str, Any] | None = None,
) -> Prompt:
    """Render `messages` plus the generation prompt; record each message's first token."""
    return tokenize_chat(tokenizer, render_chat(template, messages, extras), messages)


def render_chat(
    template: ChatTemplate,
    messages: Sequence[ChatMessage],
    extras: Mapping[str, Any] | None = None,
    *,
    max_bytes: int | None = None,
) -> ChatText:
    """`messages` rendered with the generation prompt and cut into one piece per message
    (`chat_segments`), in time linear in their number.

    Raises `RenderedTooLarge` if the rendering is over `max_bytes` (before it is cut)."""
    if not messages:
        raise PromptError("messages must not be empty")
    views = [m.template_view() for m in messages]
    extras = extras or {}
    full = template.render_views(views, add_generation_prompt=True, extras=extras)
    if max_bytes is not None and len(full) > max_bytes // 4:  # ≥ 1 byte a character
        size = len(full.encode("utf-8", errors="surrogatepass"))
        if size > max_bytes:
            raise RenderedTooLarge(size, max_bytes)
    return segment_chat(template, views, extras, full)


def tokenize_chat(tokenizer: Tokenizer, chat: ChatText, messages: Sequence[ChatMessage]) -> Prompt:
    """A rendered chat's tokens, each piece tokenized on its own.

    A message that continues a generation prompt (an assistant reply) is tokenized in two
    parts — the generation prompt, then the reply — so its tokens match the previous turn's
    prompt exactly, whatever whitespace the reply starts with."""
    if not chat.pieces:
        return Prompt(tokens=tuple(tokenizer.tokenize(chat.tail)))
    tokens: list[int] = []
    starts: list[int] = []
    for parts in chat.pieces:
        starts.append(len(tokens))
        for part in parts:
            tokens.extend(tokenizer.tokenize(part))
    tokens.extend(tokenizer.tokenize(chat.tail))
    return Prompt(
        tokens=tuple(tokens),
        message_starts=tuple(starts),
        message_roles=tuple(m.role for m in messages),
    )
