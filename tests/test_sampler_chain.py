"""llama.cpp's sampler chain beyond top-k/top-p/min-p: penalties, logit bias, grammar, stop
token ids and log-probabilities — on synthetic rows, and through the engine on a real
generated model."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from pydantic import ValidationError

from baton_serve.cache_store.wire.protocol import GenerationRequest, InvalidGeneration
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.sampling import TokenSampler, token_logprob

VOCAB = 8


def run(params: SamplingParams, logits: np.ndarray, steps: int) -> list[int]:
    """`steps` tokens from one sampler, each accepted as the engine does."""
    sampler = TokenSampler(params, len(logits))
    tokens = []
    for _ in range(steps):
        token = sampler(logits)
        assert token is not None
        sampler.accept(token)
        tokens.append(token)
    sampler.close()
    return tokens


def test_greedy_without_penalty_repeats_the_best_token() -> None:
    logits = np.arange(VOCAB, dtype=np.float32)
    assert run(SamplingParams(), logits, 5) == [7] * 5


def test_presence_penalty_moves_greedy_off_a_used_token() -> None:
    """A presence penalty above the logit gap makes greedy pick each token once in turn."""
    logits = np.array([0, 0, 0, 0, 0, 1.0, 1.5, 2.0], dtype=np.float32)
    assert run(SamplingParams(presence_penalty=2.0), logits, 3) == [7, 6, 5]


def test_frequency_penalty_grows_with_each_use() -> None:
    """A frequency penalty of 0.3 per use: the best token (gap 1.0) is left after 4 uses."""
    logits = np.array([0, 0, 0, 0, 0, 0, 1.0, 2.0], dtype=np.float32)
    assert run(SamplingParams(frequency_penalty=0.3), logits, 5) == [7, 7, 7, 7, 6]


def test_repetition_penalty_counts_the_prompt() -> None:
    """vLLM's repetition penalty (a positive logit divided by it) covers prompt tokens too."""
    logits = np.array([0, 0, 0, 0, 0, 0, 1.5, 2.0], dtype=np.float32)
    params = SamplingParams(repetition_penalty=1.5)
    sampler = TokenSampler(params, VOCAB, prompt=(7, 3))
    assert sampler(logits) == 6  # 2.0 / 1.5 < 1.5
    assert TokenSampler(params, VOCAB)(logits) == 7


def test_logit_bias_bans_and_forces() -> None:
    logits = np.arange(VOCAB, dtype=np.float32)
    assert run(SamplingParams(logit_bias=((7, -100.0),)), logits, 3) == [6] * 3
    assert run(SamplingParams(logit_bias=((0, 100.0),)), logits, 3) == [0] * 3
    draws = run(SamplingParams(temperature=1.0, seed=1, logit_bias=((7, -100),)), logits, 300)
    assert 7 not in draws and len(set(draws)) > 3


def test_seeds_reproduce_and_differ() -> None:
    logits = np.zeros(64, dtype=np.float32)
    first = run(SamplingParams(temperature=1.0, seed=11), logits, 40)
    assert run(SamplingParams(temperature=1.0, seed=11), logits, 40) == first
    assert run(SamplingParams(temperature=1.0, seed=12), logits, 40) != first
    big_seed = SamplingParams(temperature=1.0, seed=2**63 - 1)  # folded into 32 bits
    assert run(big_seed, logits, 40) == run(big_seed, logits, 40)


def test_token_logprob_is_the_model_distribution() -> None:
    probs = np.array([0.5, 0.25, 0.125, 0.125])
    result = token_logprob(np.log(probs).astype(np.float32), 1, 2)
    assert result.logprob == pytest.approx(np.log(0.25), abs=1e-6)
    assert [t for t, _ in result.top] == [0, 1]
    assert result.top[0][1] == pytest.approx(np.log(0.5), abs=1e-6)
    assert token_logprob(np.zeros(3, dtype=np.float32), 0, 0).top == ()
    assert len(token_logprob(np.zeros(3, dtype=np.float32), 0, 20).top) == 3


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.1},
        {"repetition_penalty": 0.0},
        {"logprobs": 21},
        {"logprobs": -1},
    ],
)
def test_out_of_range_fields_are_rejected(fields: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        SamplingParams(**fields)


# ---- through the engine, on a generated model ----------------------------------------------


def test_grammar_constrains_sampled_text(tiny_model, make_engine) -> None:
    """At temperature 1 on random weights, every reply is one of the grammar's words."""
    engine = make_engine(tiny_model("llama"))
    prompt = engine.text_prompt("Answer:")
    grammar = 'root ::= "yes" | "no" | "maybe"'
    replies = Counter(
        engine.generate(prompt, SamplingParams(temperature=1.0, seed=s, grammar=grammar)).text
        for s in range(12)
    )
    assert set(replies) <= {"yes", "no", "maybe"}, replies
    assert len(replies) >= 2


def test_json_grammar_output_parses(tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model("qwen35"))
    grammar = r'''root ::= "{\"n\": " [1-9] [0-9]? ", \"ok\": " ("true" | "false") "}"'''
    for seed in range(4):
        done = engine.generate(
            engine.text_prompt("JSON:"), SamplingParams(temperature=1.0, seed=seed, grammar=grammar)
        )
        assert done.finish_reason == "stop"
        value = json.loads(done.text)
        assert set(value) == {"n", "ok"} and 1 <= value["n"] <= 99


def test_unservable_sampling_fails_the_request_only(tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model("llama"))
    prompt = engine.text_prompt("Hello")
    request = GenerationRequest(prompt=prompt, sampling=SamplingParams(grammar="root ::= ("))
    with pytest.raises(InvalidGeneration, match="grammar"):
        engine.submit(request).result(timeout=30)
    with pytest.raises(InvalidGeneration, match="ignore_eos"):
        engine.generate(prompt, SamplingParams(grammar='root ::= "a"', ignore_eos=True))
    with pytest.raises(InvalidGeneration, match="vocabulary"):
        engine.generate(prompt, SamplingParams(stop_token_ids=(10**7,)))
    assert engine.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True)).tokens


def test_stop_token_ids_end_generation(tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model("llama"))
    prompt = engine.text_prompt("Count with me")
    free = engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    stop_at = free.tokens[4]
    first = free.tokens.index(stop_at)
    done = engine.generate(
        prompt, SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop_at,))
    )
    assert done.finish_reason == "stop"
    assert done.tokens == free.tokens[:first]


def test_logprobs_match_the_logits(tiny_model, make_engine) -> None:
    """Greedy: the chosen token is the top alternative, with the same log-probability; the
    streamed events carry the same entries as the completion."""
    engine = make_engine(tiny_model("llama"))
    prompt = engine.text_prompt("Some text")
    handle = engine.submit(
        GenerationRequest(
            prompt=prompt, sampling=SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
        )
    )
    events = list(handle)
    done = handle.result(timeout=30)
    assert done.logprobs is not None and len(done.logprobs) == len(done.tokens) == 6
    assert [e.logprob for e in events] == done.logprobs
    for entry, token in zip(done.logprobs, done.tokens, strict=True):
        assert entry.token == token and entry.top[0] == (token, entry.logprob)
        assert len(entry.top) == 3 and entry.logprob <= 0.0
    plain = engine.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    assert plain.logprobs is None and plain.tokens == done.tokens


def test_penalties_change_greedy_replies_on_a_real_model(tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model("llama"))
    prompt = engine.text_prompt("Repeat repeat repeat")
    plain = engine.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    penalised = engine.generate(
        prompt, SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=2.0)
    )
    assert len(set(penalised.tokens)) >= len(set(plain.tokens))
    assert penalised.tokens != plain.tokens or len(set(plain.tokens)) == 24
    with LlamaModel(tiny_model("llama"), vocab_only=True) as model:
        assert model.n_vocab > max(penalised.tokens)
