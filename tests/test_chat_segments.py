"""Chat rendering in time linear in the number of messages gives exactly the tokens and
message offsets that rendering every prefix gave (the definition), for real chat templates."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from baton_serve.cache_store.wire.prompt_types import ChatMessage, Prompt
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.prompt import (
    ChatTemplate,
    PromptError,
    chat_prompt,
    model_chat_template,
)
from baton_serve.replicas.models.default_model import default_model_path

TEMPLATES = Path(__file__).parent / "chat_templates"
CALL = {"id": "call_123456789", "type": "function", "function": {"name": "f", "arguments": {}}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def model() -> Iterator[LlamaModel]:
    with LlamaModel(default_model_path(), vocab_only=True) as loaded:
        yield loaded


def template(model: LlamaModel, source: str) -> ChatTemplate:
    found = model_chat_template(model, source)
    assert found is not None
    return found


def by_prefixes(
    tokenizer: LlamaModel,
    template: ChatTemplate,
    messages: Sequence[ChatMessage],
    extras: Mapping[str, Any] | None = None,
) -> Prompt:
    """The previous implementation, the definition: every prefix rendered (O(n²))."""
    pieces: list[list[str]] = []
    rendered = ""
    for i in range(1, len(messages) + 1):
        text = template.render(messages[:i], add_generation_prompt=False, extras=extras)
        if not text.startswith(rendered):
            full = template.render(messages, add_generation_prompt=True, extras=extras)
            return Prompt(tokens=tuple(tokenizer.tokenize(full)))
        opened = (
            template.render(messages[: i - 1], add_generation_prompt=True, extras=extras)
            if i > 1
            else ""
        )
        if len(rendered) < len(opened) and opened.startswith(rendered) and text.startswith(opened):
            pieces.append([opened[len(rendered) :], text[len(opened) :]])
        else:
            pieces.append([text[len(rendered) :]])
        rendered = text
    full = template.render(messages, add_generation_prompt=True, extras=extras)
    if not full.startswith(rendered):
        return Prompt(tokens=tuple(tokenizer.tokenize(full)))
    tokens: list[int] = []
    starts: list[int] = []
    for parts in pieces:
        starts.append(len(tokens))
        for part in parts:
            tokens.extend(tokenizer.tokenize(part))
    tokens.extend(tokenizer.tokenize(full[len(rendered) :]))
    roles = tuple(m.role for m in messages)
    return Prompt(tokens=tuple(tokens), message_starts=tuple(starts), message_roles=roles)


def msg(role: str, content: str | None, **fields: Any) -> ChatMessage:
    return ChatMessage(role=role, content=content, **fields)


CONVERSATIONS: dict[str, list[ChatMessage]] = {
    "one user": [msg("user", "Hi!")],
    "system first": [msg("system", "Be brief."), msg("user", "2+2?"), msg("assistant", "4")],
    "long": [msg("system", "S")]
    + [msg("user" if i % 2 == 0 else "assistant", f"turn {i} " * (i % 3)) for i in range(37)],
    "reply with whitespace": [msg("user", "Q"), msg("assistant", "\n\n  spaced"), msg("user", "")],
    "tool round": [
        msg("system", "Use tools."),
        msg("user", "Call f."),
        msg("assistant", None, tool_calls=[CALL]),
        msg("tool", "42", tool_call_id=CALL["id"]),
        msg("assistant", "It is 42."),
        msg("user", "Again."),
        msg("assistant", "", tool_calls=[CALL, CALL]),
        msg("tool", "1", tool_call_id=CALL["id"]),
        msg("tool", "2", tool_call_id=CALL["id"]),
    ],
}

SOURCES = {
    "model's own": None,
    **{path.stem: path.read_text() for path in sorted(TEMPLATES.glob("*.jinja"))},
    # Gemma's shape: the system message is folded into the first user turn, the loop runs
    # over messages[1:].
    "system folded": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
        "{% set first = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
        "{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
        "{% for message in loop_messages %}<turn>{{ message['role'] }}\n"
        "{% if loop.first %}{{ first }}{% endif %}{{ message['content'] }}<end>\n{% endfor %}"
        "{% if add_generation_prompt %}<turn>model\n{% endif %}"
    ),
    # loop.last looks one message ahead (Jinja fetches the next one early).
    "last marked": (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% if loop.last %}<last>{% else %}</{{ m.role }}>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    ),
    # A separator printed before a message, only between messages.
    "separated": (
        "{% for m in messages %}{% if not loop.first %}\n---\n{% endif %}"
        "{{ m.role }}: {{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}\n---\nassistant:{% endif %}"
    ),
    # Qwen3's shape: reasoning is dropped from replies before the last user message, and a
    # reversed pre-scan finds that message.
    "drops old reasoning": (
        "{% set ns = namespace(last=-1) %}{% for m in messages[::-1] %}"
        "{% if ns.last < 0 and m.role == 'user' %}{% set ns.last = messages|length - 1 - loop.index0 %}"
        "{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.reasoning_content and loop.index0 > ns.last %}<think>{{ m.reasoning_content }}"
        "</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "rewrites history": "turns={{ messages | length }}\n{{ messages[-1]['content'] }}",
}

REASONED = [
    msg("user", "Think."),
    msg("assistant", "Done.", reasoning_content="hmm"),
    msg("user", "More."),
    msg("assistant", "Ok.", reasoning_content="again"),
]


@pytest.mark.parametrize("name", list(SOURCES))
@pytest.mark.parametrize("tools", [False, True], ids=["", "tools"])
def test_same_tokens_and_offsets_as_rendering_every_prefix(
    model: LlamaModel, name: str, tools: bool
) -> None:
    chat = template(model, SOURCES[name])  # type: ignore[arg-type]
    extras = {"tools": TOOLS} if tools else None
    conversations = {**CONVERSATIONS, "reasoned": REASONED}
    compared = 0
    for title, messages in conversations.items():
        for n in sorted({*range(1, min(len(messages), 9) + 1), len(messages)}):
            try:
                expected = by_prefixes(model, chat, messages[:n], extras)
            except PromptError:  # e.g. a template that cannot show a call without content
                continue
            got = chat_prompt(model, chat, messages[:n], extras)
            assert got == expected, f"{name}, {title}, {n} messages"
            compared += 1
    assert compared >= 20


class CountingTemplate(ChatTemplate):
    """Counts the messages every rendering went through."""

    rendered = 0

    def stream_views(self, views: Sequence[dict[str, Any]], **kwargs: Any) -> Iterator[str]:
        self.rendered += len(views)
        return super().stream_views(views, **kwargs)


def test_rendering_is_linear_in_the_number_of_messages(model: LlamaModel) -> None:
    source = model.chat_template
    assert source is not None
    counted = CountingTemplate(source, bos_token="", eos_token="")
    for n in (200, 2000):
        counted.rendered = 0
        messages = [msg("user" if i % 2 == 0 else "assistant", "word") for i in range(n)]
        started = time.perf_counter()
        prompt = chat_prompt(model, counted, messages)
        elapsed = time.perf_counter() - started
        assert len(prompt.message_starts) == n  # offsets found, not given up on
        assert counted.rendered <= 12 * n  # every prefix would be n * (n + 1)
        assert elapsed < 2.0, f"{n} messages took {elapsed:.2f} s"
