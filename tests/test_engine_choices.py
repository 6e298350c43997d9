"""n > 1: one prefill, forked into n choices (attention and hybrid memory), on real
llama.cpp with generated models."""

from __future__ import annotations

import numpy as np
import pytest

from baton_serve.cache_store.wire.protocol import GenerationRequest, InvalidGeneration
from baton_serve.cache_store.wire.sampling_params import SamplingParams

ARCHS = ("llama", "qwen35")


def _request(prompt, **sampling) -> GenerationRequest:
    n = sampling.pop("n", 1)
    return GenerationRequest(prompt=prompt, sampling=SamplingParams(**sampling), n=n)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_choices_equal_a_single_run_and_the_prompt_is_computed_once(
    arch, tiny_model, make_engine
) -> None:
    """Forked state is exact: three greedy choices equal one greedy run from scratch."""
    engine = make_engine(tiny_model(arch), n_slots=3, prefix_cache=False)
    prompt = engine.text_prompt("Once upon a time in a land of recurrent states, " * 4)
    single = engine.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    computed = engine.stats.prompt_tokens_computed
    done = engine.submit(_request(prompt, n=3, max_tokens=16, ignore_eos=True)).result(60)
    assert engine.stats.prompt_tokens_computed - computed == len(prompt)  # one prefill
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert all(c.tokens == single.tokens for c in done.choices)
    assert all(c.text == single.text for c in done.choices)


@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_choices_differ_and_reproduce(arch, tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model(arch), n_slots=3)
    prompt = engine.text_prompt("Tell me something random.")
    request = _request(prompt, n=3, max_tokens=12, ignore_eos=True, temperature=1.0, seed=11)
    first = engine.submit(request).result(60)
    again = engine.submit(request.model_copy(update={"request_id": "again"})).result(60)
    tokens = [c.tokens for c in first.choices]
    assert len({tuple(t) for t in tokens}) == 3
    assert [c.tokens for c in again.choices] == tokens
    alone = engine.generate(
        prompt, SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=12)
    )
    assert alone.tokens == tokens[1]  # choice i samples with seed + i


def test_streamed_events_carry_their_choice(tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model("llama"), n_slots=2)
    prompt = engine.text_prompt("Stream two choices")
    handle = engine.submit(
        _request(prompt, n=2, max_tokens=5, ignore_eos=True, temperature=1.0, seed=1)
    )
    events = list(handle)
    done = handle.result(30)
    for choice in done.choices:
        assert [e.token for e in events if e.index == choice.index] == choice.tokens


def test_more_choices_than_slots_is_refused_and_others_keep_running(
    tiny_model, make_engine
) -> None:
    engine = make_engine(tiny_model("llama"), n_slots=2)
    prompt = engine.text_prompt("Hello")
    with pytest.raises(InvalidGeneration, match="n <= 2"):
        engine.submit(_request(prompt, n=3))
    queued = [engine.submit(_request(prompt, n=2, max_tokens=4, ignore_eos=True)) for _ in range(3)]
    assert all(len(h.result(60).choices) == 2 for h in queued)


def test_cancelling_stops_every_choice(tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model("qwen35"), n_slots=2)
    prompt = engine.text_prompt("A long story")
    handle = engine.submit(_request(prompt, n=2, max_tokens=500, ignore_eos=True))
    next(iter(handle))
    handle.cancel()
    done = handle.result(30)
    assert {c.finish_reason for c in done.choices} == {"cancelled"}
    assert engine.wait_idle(30)
    assert engine.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True)).tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_slots_of_choices_that_end_at_once_stay_exact(arch, tiny_model, make_engine) -> None:
    """Three choices that each end at their first token free their slots at once; the next
    requests, placed in those slots and reusing the prompt, get exactly the logits of a
    fresh engine (a deferred `llama_memory_seq_cp` would corrupt them)."""
    engine = make_engine(tiny_model(arch), n_slots=3)
    prompt = engine.text_prompt("A shared beginning for every choice, " * 6)
    engine.submit(_request(prompt, n=3, max_tokens=1, ignore_eos=True)).result(60)
    follow = engine.text_prompt("A shared beginning for every choice, " * 6 + "and then more.")
    sampling = SamplingParams(max_tokens=1)  # the prefill's logits: no batching rounding
    handles = [
        engine.submit(GenerationRequest(prompt=follow, sampling=sampling, return_logits=True))
        for _ in range(3)
    ]
    fresh = make_engine(tiny_model(arch), n_slots=1).generate(follow, sampling, return_logits=True)
    for handle in handles:
        done = handle.result(60)
        assert done.tokens == fresh.tokens
        assert np.array_equal(done.logits, fresh.logits)
