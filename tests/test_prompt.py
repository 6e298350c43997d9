"""Chat and text prompts with the real SmolLM2 tokenizer and chat template."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from baton_serve.cache_store.wire.prompt_types import ChatMessage
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.prompt import ChatTemplate, PromptError, chat_prompt, text_prompt
from baton_serve.replicas.models.default_model import default_model_path

GENERATION_PROMPT = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def model() -> Iterator[LlamaModel]:
    with LlamaModel(default_model_path(), vocab_only=True) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def template(model: LlamaModel) -> ChatTemplate:
    source = model.chat_template
    assert source is not None
    return ChatTemplate(
        source,
        bos_token=model.token_text(model.bos_token),
        eos_token=model.token_text(model.eos_token),
    )


def make_template(model: LlamaModel, source: str) -> ChatTemplate:
    return ChatTemplate(
        source,
        bos_token=model.token_text(model.bos_token),
        eos_token=model.token_text(model.eos_token),
    )


def msgs(*pairs: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=content) for role, content in pairs]


CONVERSATIONS = {
    "user only": msgs(("user", "Hi!")),
    "system+user": msgs(("system", "Be brief."), ("user", "What is 2+2?")),
    "multi-turn": msgs(
        ("system", "You are terse."),
        ("user", "Name a colour."),
        ("assistant", "Blue."),
        ("user", "Another one, please."),
    ),
    "unicode and newlines": msgs(
        ("user", "Café ☕ — naïve 😀\nsecond line\n\n  indented"),
        ("assistant", "Très bien. 日本語もOK"),
        ("user", "  leading spaces and trailing\n"),
    ),
    "empty content": msgs(("user", ""), ("assistant", ""), ("user", "ok")),
    "ends with assistant": msgs(("user", "Hello"), ("assistant", "Hi there")),
}


@pytest.mark.parametrize("messages", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
def test_message_starts_are_exact_offsets(
    model: LlamaModel, template: ChatTemplate, messages: list[ChatMessage]
) -> None:
    """tokens[start_i:start_i+1] detokenizes to exactly message i's rendered text."""
    prompt = chat_prompt(model, template, messages)
    assert len(prompt.message_starts) == len(messages)
    assert prompt.message_roles == tuple(m.role for m in messages)
    assert prompt.message_starts[0] == 0
    assert list(prompt.message_starts) == sorted(set(prompt.message_starts))
    bounds = list(prompt.message_starts) + [len(prompt) - len(model.tokenize(GENERATION_PROMPT))]
    for i in range(len(messages)):
        before = template.render(messages[:i], add_generation_prompt=False) if i else ""
        through = template.render(messages[: i + 1], add_generation_prompt=False)
        assert through.startswith(before)
        piece = model.detokenize(list(prompt.tokens[bounds[i] : bounds[i + 1]]))
        assert piece == through[len(before) :]
        assert piece.endswith(f"<|im_start|>{messages[i].role}\n{messages[i].content}<|im_end|>\n")


@pytest.mark.parametrize("messages", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
def test_tokens_render_the_full_conversation(
    model: LlamaModel, template: ChatTemplate, messages: list[ChatMessage]
) -> None:
    """All tokens together are the template's rendering, generation prompt at the end."""
    prompt = chat_prompt(model, template, messages)
    full = template.render(messages, add_generation_prompt=True)
    assert model.detokenize(list(prompt.tokens)) == full
    generation = model.tokenize(GENERATION_PROMPT)
    assert list(prompt.tokens[-len(generation) :]) == generation
    assert full.endswith(GENERATION_PROMPT)


def test_message_starts_are_im_start_tokens(model: LlamaModel, template: ChatTemplate) -> None:
    """Every message begins on the <|im_start|> special token."""
    prompt = chat_prompt(model, template, CONVERSATIONS["multi-turn"])
    (im_start,) = model.tokenize("<|im_start|>")
    assert [prompt.tokens[s] for s in prompt.message_starts] == [im_start] * 4


def test_default_system_prompt_belongs_to_first_message(
    model: LlamaModel, template: ChatTemplate
) -> None:
    """SmolLM2 inserts a system prompt before a leading user message; it is part of message 0."""
    prompt = chat_prompt(model, template, CONVERSATIONS["user only"])
    text = model.detokenize(list(prompt.tokens))
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.message_starts == (0,)
    assert prompt.last_user_start == 0


USER_LAST = {name: m for name, m in CONVERSATIONS.items() if m[-1].role == "user"}


@pytest.mark.parametrize(
    "reply",
    ["Blue.", " Blue.", "\nBlue.", "", "Line one\nline two", "😀 emoji first"],
)
@pytest.mark.parametrize("messages", USER_LAST.values(), ids=USER_LAST.keys())
def test_conversation_is_prefix_of_next_turn(
    model: LlamaModel, template: ChatTemplate, messages: list[ChatMessage], reply: str
) -> None:
    """A prompt (generation prompt included) is a token prefix of the same chat with the
    reply appended; that chat, less its generation prompt, is a prefix of the next turn."""
    short = chat_prompt(model, template, messages)
    with_reply = messages + msgs(("assistant", reply))
    long = chat_prompt(model, template, with_reply)
    assert long.tokens[: len(short)] == short.tokens
    assert long.message_starts[:-1] == short.message_starts
    assert long.message_starts[-1] == len(short) - len(model.tokenize(GENERATION_PROMPT))
    following = chat_prompt(model, template, with_reply + msgs(("user", "And then?")))
    conversation = long.tokens[: len(long) - len(model.tokenize(GENERATION_PROMPT))]
    assert following.tokens[: len(conversation)] == conversation
    assert following.message_starts[:-1] == long.message_starts


@pytest.mark.parametrize("reply", ["\n\nBlue.", "  Blue."])
def test_prefix_holds_for_reply_starting_with_whitespace(
    model: LlamaModel, template: ChatTemplate, reply: str
) -> None:
    """The prefix property should hold whatever the reply starts with."""
    messages = msgs(("user", "Name a colour."))
    short = chat_prompt(model, template, messages)
    long = chat_prompt(model, template, messages + msgs(("assistant", reply)))
    assert long.tokens[: len(short)] == short.tokens


@pytest.mark.parametrize(
    ("messages", "expected_index"),
    [
        (CONVERSATIONS["user only"], 0),
        (CONVERSATIONS["multi-turn"], 3),
        (CONVERSATIONS["ends with assistant"], 0),
        (msgs(("user", "a"), ("user", "b"), ("assistant", "c")), 1),
        (msgs(("system", "only a system message")), None),
    ],
)
def test_last_user_start_points_at_last_user_message(
    model: LlamaModel,
    template: ChatTemplate,
    messages: list[ChatMessage],
    expected_index: int | None,
) -> None:
    """last_user_start is the first token of the last user message."""
    prompt = chat_prompt(model, template, messages)
    if expected_index is None:
        assert prompt.last_user_start is None
        return
    assert prompt.last_user_start == prompt.message_starts[expected_index]
    bounds = list(prompt.message_starts) + [len(prompt) - len(model.tokenize(GENERATION_PROMPT))]
    end = bounds[expected_index + 1]
    user_text = model.detokenize(list(prompt.tokens[prompt.last_user_start : end]))
    assert user_text.endswith(f"<|im_start|>user\n{messages[expected_index].content}<|im_end|>\n")


def test_empty_messages_rejected(model: LlamaModel, template: ChatTemplate) -> None:
    """A chat prompt needs at least one message."""
    with pytest.raises(PromptError, match="empty"):
        chat_prompt(model, template, [])


def test_empty_role_rejected() -> None:
    """A message role must not be empty."""
    with pytest.raises(ValidationError):
        ChatMessage(role="", content="hi")


def test_raise_exception_becomes_prompt_error(model: LlamaModel) -> None:
    """A template's raise_exception('x') surfaces as PromptError carrying 'x'."""
    source = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('bad role: ' + m['role']) }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    template = make_template(model, source)
    assert len(chat_prompt(model, template, msgs(("user", "hi")))) > 0
    with pytest.raises(PromptError, match="bad role: tool"):
        chat_prompt(model, template, msgs(("user", "hi"), ("tool", "42")))
    with pytest.raises(PromptError, match="rejected the messages: x$"):
        chat_prompt(model, make_template(model, "{{ raise_exception('x') }}"), msgs(("user", "hi")))


@pytest.mark.parametrize(
    "source", ["{% for m in messages %}", "{{ messages[ }}", "{% if %}{% endif %}"]
)
def test_template_syntax_error_is_prompt_error(model: LlamaModel, source: str) -> None:
    """A template that does not parse is refused when it is loaded."""
    with pytest.raises(PromptError, match="does not parse"):
        make_template(model, source)


def test_sandbox_violation_is_prompt_error(model: LlamaModel) -> None:
    """Templates run in an immutable sandbox: mutating the messages is refused."""
    template = make_template(model, "{% set _ = messages.append(1) %}x")
    with pytest.raises(PromptError, match="unsafe"):
        chat_prompt(model, template, msgs(("user", "hi")))


def test_template_rewriting_history_has_no_message_offsets(model: LlamaModel) -> None:
    """If earlier messages render differently later, the prompt is tokenized whole, without offsets."""
    template = make_template(model, "turns={{ messages | length }}\n{{ messages[-1]['content'] }}")
    messages = msgs(("user", "one"), ("assistant", "two"))
    prompt = chat_prompt(model, template, messages)
    assert model.detokenize(list(prompt.tokens)) == "turns=2\ntwo"
    assert prompt.message_starts == () and prompt.message_roles == ()
    assert prompt.last_user_start is None


def test_template_gets_special_tokens(model: LlamaModel) -> None:
    """bos_token and eos_token are available to the template; written specials are parsed."""
    source = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    template = make_template(model, source)
    prompt = chat_prompt(model, template, msgs(("user", "hi")))
    assert prompt.tokens[0] == model.bos_token and prompt.tokens[-1] == model.eos_token


@pytest.mark.parametrize("text", ["Hello world", "Café ☕\nsecond line", " leading space"])
def test_text_prompt(model: LlamaModel, text: str) -> None:
    """Raw prompts: the text's tokens, BOS only if asked and the model wants one (SmolLM2 does not)."""
    plain = text_prompt(model, text, add_bos=False)
    assert list(plain.tokens) == model.tokenize(text)
    assert model.detokenize(list(plain.tokens)) == text
    assert plain.tokens[0] != model.bos_token
    assert plain.message_starts == () and plain.last_user_start is None
    with_bos = text_prompt(model, text, add_bos=True)
    assert list(with_bos.tokens) == model.tokenize(text, add_special=True)
    assert not model.add_bos
    assert with_bos.tokens == plain.tokens


class _RecordingTokenizer:
    """A stand-in tokenizer (the Tokenizer protocol) that adds token 1 as BOS when asked."""

    def tokenize(
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        return ([1] if add_special else []) + [ord(c) for c in text]

    def token_text(self, token: int) -> str:
        return chr(token)


@pytest.mark.parametrize(("add_bos", "expected"), [(True, (1, 104, 105)), (False, (104, 105))])
def test_text_prompt_passes_add_bos_to_tokenizer(add_bos: bool, expected: tuple[int, ...]) -> None:
    """add_bos reaches the tokenizer as add_special (a model that wants BOS gets it)."""
    assert text_prompt(_RecordingTokenizer(), "hi", add_bos=add_bos).tokens == expected
