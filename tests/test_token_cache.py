"""The gateway's token cache (`router/gateway/token_cache.py`) over a real vocabulary: the
same tokens as tokenising afresh, a conversation's earlier messages tokenised once, the
budget kept, errors not remembered, safe across threads."""

from __future__ import annotations

import threading

import pytest

from baton_serve.cache_store.wire.prompt_types import ChatMessage
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.prompt import PromptError
from baton_serve.router.gateway.prompt_builder import PromptBuilder
from baton_serve.router.gateway.token_cache import MIN_CHARS, TokenCache


class Counting:
    """The real model's tokenizer, counting the texts it is asked for."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.asked: list[str] = []

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True):
        self.asked.append(text)
        return self.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_text(self, token: int) -> str:
        return self.model.token_text(token)


@pytest.fixture(scope="module")
def model(tiny_model):
    loaded = LlamaModel(tiny_model("llama"), vocab_only=True)
    yield loaded
    loaded.close()


def _text(i: int) -> str:
    return f"Message number {i}: the weather is mild and the tea is warm. " * 3


def test_cached_tokens_are_the_tokens_and_each_text_is_tokenised_once(model) -> None:
    counting = Counting(model)
    cache = TokenCache(counting)
    for _ in range(3):
        for i in range(4):
            assert cache.tokenize(_text(i)) == model.tokenize(_text(i))
    assert counting.asked == [_text(i) for i in range(4)]
    # the flags are part of what is remembered
    special = cache.tokenize(_text(0), add_special=True, parse_special=False)
    assert special == model.tokenize(_text(0), add_special=True, parse_special=False)
    assert len(counting.asked) == 5


def test_short_texts_are_not_remembered(model) -> None:
    counting = Counting(model)
    cache = TokenCache(counting)
    short = "x" * (MIN_CHARS - 1)
    cache.tokenize(short)
    cache.tokenize(short)
    assert counting.asked == [short, short] and cache.held_chars == 0


def test_the_budget_drops_the_least_recently_used(model) -> None:
    counting = Counting(model)
    one = len(_text(0))
    cache = TokenCache(counting, max_chars=8 * one + 10)  # 8 texts fit; each ≤ budget / 8
    for i in range(8):
        cache.tokenize(_text(i))
    cache.tokenize(_text(0))  # used again: the least recently used is now text 1
    cache.tokenize(_text(8))
    assert cache.held_chars <= 8 * one + 10
    counting.asked.clear()
    cache.tokenize(_text(0))
    cache.tokenize(_text(1))
    assert counting.asked == [_text(1)]  # 0 was kept, 1 was dropped


def test_errors_are_raised_each_time_not_remembered(model) -> None:
    counting = Counting(model)
    cache = TokenCache(counting)
    bad = "a lone surrogate \ud800 in a text long enough to be remembered"
    for _ in range(2):
        with pytest.raises(PromptError, match="lone surrogate"):
            cache.tokenize(bad)
    assert len(counting.asked) == 2 and cache.held_chars == 0


def test_threads_share_one_cache(model) -> None:
    cache = TokenCache(model, max_chars=20 * len(_text(0)))
    expected = {i: model.tokenize(_text(i)) for i in range(30)}
    wrong: list[int] = []

    def work(offset: int) -> None:
        for k in range(300):
            i = (k * 7 + offset) % 30
            if cache.tokenize(_text(i)) != expected[i]:
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong and cache.held_chars <= 20 * len(_text(0))


def test_a_chat_prompt_is_the_same_turn_after_turn(tiny_model) -> None:
    """The gateway's prompt for each turn equals a fresh builder's: nothing a cache holds
    leaks from one conversation's turn into another's tokens."""
    warm = PromptBuilder(tiny_model("llama"), block_tokens=32, n_ctx=4096)
    messages = [ChatMessage(role="system", content=_text(100))]
    for turn in range(4):
        messages.append(ChatMessage(role="user", content=_text(turn)))
        cold = PromptBuilder(tiny_model("llama"), block_tokens=32, n_ctx=4096)
        try:
            assert warm.from_messages(messages) == cold.from_messages(messages)
        finally:
            cold.close()
        messages.append(ChatMessage(role="assistant", content=_text(50 + turn)))
    warm.close()
