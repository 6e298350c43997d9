"""Whatever model metadata llama.cpp accepts, the engine serves, through the same code.

Every generated architecture × metadata variant (no BOS, no EOS, special ids outside the
vocabulary, no chat template, llama.cpp's token-id-only test vocabulary, a short training
context, an extra end-of-generation token) plus the structural variants (MoE, a sliding
window, quantized weights) runs a three-turn conversation of token-id prompts: greedy
tokens equal llama.cpp computing each prompt from scratch, and later turns reuse the cache.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.prompt import PromptError
from baton_serve.replicas.models.tiny_model import ARCHITECTURES, ModelVariant, write_tiny_model

METADATA_VARIANTS = [
    ModelVariant(),
    ModelVariant(bos=False),
    ModelVariant(eos=False),
    ModelVariant(bos=False, eos=False, chat_template=False),
    ModelVariant(special_ids_out_of_vocab=True),
    ModelVariant(ctx_train=512),
    ModelVariant(vocab="test"),
    ModelVariant(vocab="test", bos=False, eos=False),
]
STRUCTURE_VARIANTS = [
    ("llama", ModelVariant(moe=True)),
    ("llama", ModelVariant(weights="q8_0")),
    ("qwen35", ModelVariant(weights="q4_0")),
    ("lfm2", ModelVariant(sliding_window=32)),
]
CASES = [(arch, v) for arch in ARCHITECTURES for v in METADATA_VARIANTS] + STRUCTURE_VARIANTS
GREEDY = SamplingParams(max_tokens=6)


@pytest.fixture(scope="module")
def variant_model(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("variants")
    made: dict[tuple[str, ModelVariant], Path] = {}

    def get(arch: str, variant: ModelVariant) -> Path:
        if (arch, variant) not in made:
            path = folder / f"{arch}-{variant.label}.gguf"
            made[arch, variant] = write_tiny_model(arch, path, variant=variant)
        return made[arch, variant]

    return get


def _ids(rng: random.Random, n: int, n_vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, n_vocab) for _ in range(n))


def _three_turns(engine: Engine, scratch: Engine) -> list[tuple[int, int, int]]:
    """(prompt tokens, cached tokens, completion tokens) per turn, asserting each turn's
    greedy tokens equal a from-scratch computation of its prompt."""
    rng = random.Random(7)
    n_vocab = engine.model.n_vocab
    tokens = _ids(rng, 150, n_vocab)
    turns = []
    for turn in range(3):
        prompt = Prompt(tokens=tokens)
        resumed = engine.generate(prompt, GREEDY)
        fresh = scratch.generate(prompt, GREEDY)
        assert resumed.tokens == fresh.tokens, f"turn {turn}"
        assert fresh.usage.cached_tokens == 0
        turns.append((len(prompt), resumed.usage.cached_tokens, len(resumed.tokens)))
        tokens = tokens + tuple(resumed.tokens) + _ids(rng, 20, n_vocab)
    return turns


@pytest.mark.parametrize(("arch", "variant"), CASES, ids=[f"{arch}-{v.label}" for arch, v in CASES])
def test_every_variant_serves_a_conversation_from_cache(
    arch, variant, variant_model, make_engine
) -> None:
    path = variant_model(arch, variant)
    engine = make_engine(path, block_tokens=16, checkpoint_interval=64, prefill_chunk=64)
    scratch = make_engine(path, prefix_cache=False)

    turns = _three_turns(engine, scratch)

    for turn, (n_prompt, cached, _) in enumerate(turns[1:], start=1):
        previous_prompt = turns[turn - 1][0]
        assert cached >= previous_prompt - 16, f"turn {turn}: {turns}"
        assert cached < n_prompt


def test_missing_special_tokens_are_none_not_invalid_ids(variant_model) -> None:
    with LlamaModel(variant_model("qwen35", ModelVariant(vocab="test", bos=False, eos=False))) as m:
        assert (m.bos_token, m.eos_token, m.add_bos) == (None, None, False)
    with LlamaModel(variant_model("llama", ModelVariant(vocab="test"))) as m:
        assert (m.bos_token, m.eos_token) == (1, 2) and m.add_bos
    with LlamaModel(variant_model("llama", ModelVariant(vocab="test", bos=False))) as m:
        prompt_tokens = m.tokenize("abcdefghij", add_special=m.add_bos)
        assert m.bos_token is None and 1 not in prompt_tokens[:1]


def test_a_model_without_chat_template_names_the_fix(variant_model, make_engine) -> None:
    path = variant_model("llama", ModelVariant(chat_template=False))
    engine = make_engine(path)
    with pytest.raises(PromptError, match="--chat-template"):
        engine.chat_prompt([{"role": "user", "content": "Hi"}])
    assert engine.generate(engine.text_prompt("Completions still work."), GREEDY).tokens

    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}<|im_start|>"
    templated = make_engine(path, chat_template=template)
    prompt = templated.chat_prompt([{"role": "user", "content": "Hi"}])
    assert templated.generate(prompt, GREEDY).usage.prompt_tokens == len(prompt)


def test_context_is_clamped_to_the_training_context(variant_model, make_engine) -> None:
    path = variant_model("qwen35", ModelVariant(ctx_train=512))
    assert make_engine(path, n_ctx=1024).n_ctx == 512
    assert make_engine(path, n_ctx=0).n_ctx == 512
    assert make_engine(path, n_ctx=256).n_ctx == 256


@pytest.mark.parametrize("arch", ["llama", "mamba2"])
def test_generation_stops_on_any_end_of_generation_token(
    arch, tmp_path, variant_model, make_engine
) -> None:
    """The same weights with one more EOG token: generation stops where that token comes."""
    plain = make_engine(variant_model(arch, ModelVariant()))
    prompt = Prompt(tokens=tuple(range(100, 160)))
    first = plain.generate(prompt, SamplingParams(max_tokens=4)).tokens[0]
    assert not plain.model.is_end_of_generation(first)

    eog = write_tiny_model(arch, tmp_path / "eog.gguf", variant=ModelVariant(extra_eog=first))
    stopping = make_engine(eog)
    assert stopping.model.is_end_of_generation(first)
    done = stopping.generate(prompt, SamplingParams(max_tokens=4))
    assert (done.tokens, done.finish_reason) == ([], "stop")


def test_a_vocabulary_without_text_serves_token_ids(tmp_path, make_engine) -> None:
    """llama.cpp's "none" vocabulary has no text at all: text prompts get a clear error,
    token ids are served (and its text operations, which abort in llama.cpp, never run)."""
    path = write_tiny_model("llama", tmp_path / "none.gguf", variant=ModelVariant(vocab="none"))
    engine = make_engine(path)
    assert not engine.model.has_text and engine.model.bos_token is None
    with pytest.raises(PromptError, match="token ids"):
        engine.text_prompt("hello")
    done = engine.generate(Prompt(tokens=tuple(range(10, 40))), GREEDY)
    assert len(done.tokens) == GREEDY.max_tokens and done.text == ""
