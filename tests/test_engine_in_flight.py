"""Prefixes being computed count: requests that share a long prefix with a prefill in
progress wait for its checkpoint instead of computing the prefix again — and stay exact.

Real llama.cpp on generated attention and hybrid models.
"""

from __future__ import annotations

import numpy as np
import pytest

from baton_serve.cache_store.prefix_hash import common_prefix_length
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import GenerationRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6)
# One token: its logits come from the prompt's own prefill, not from a decode step batched
# with other sequences (whose kernels round differently from a lone sequence's).
FIRST_TOKEN = SamplingParams(max_tokens=1)
SYSTEM = "You are a careful assistant who answers in short sentences and cites sources. " * 10


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_a_burst_sharing_a_system_prompt_computes_it_once(arch, tiny_model, make_engine) -> None:
    path = tiny_model(arch)
    engine = make_engine(path, n_slots=4, prefill_chunk=32, block_tokens=32)
    scratch = make_engine(path, prefix_cache=False)
    prompts = [
        engine.chat_prompt(
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Session {i}: tell me about item {i * 7}."},
            ]
        )
        for i in range(4)
    ]
    shared = min(common_prefix_length(prompts[0].tokens, p.tokens) for p in prompts[1:])
    assert shared >= prompts[0].system_end >= 100

    handles = [
        engine.submit(GenerationRequest(prompt=p, sampling=FIRST_TOKEN, return_logits=True))
        for p in prompts
    ]
    results = [handle.result(timeout=120) for handle in handles]

    computed = sum(r.usage.computed_tokens for r in results)
    distinct = shared + sum(len(p) - shared for p in prompts)
    assert computed == distinct, "the shared prefix is computed exactly once"
    assert engine.stats.prefix_waits == 3
    assert all(r.usage.cached_tokens >= shared for r in results[1:])
    for prompt, result in zip(prompts, results):
        fresh = scratch.generate(prompt, FIRST_TOKEN, return_logits=True)
        assert result.tokens == fresh.tokens
        assert float(np.abs(result.logits - fresh.logits).max()) == 0.0


def test_waiting_requests_do_not_hold_up_unrelated_ones(tiny_model, make_engine) -> None:
    """A request waiting for a prefix lets the queue pass: an unrelated prompt behind it
    starts at once in a free slot."""
    path = tiny_model("llama")
    engine = make_engine(path, n_slots=3, prefill_chunk=16, block_tokens=32)
    long_prompt = engine.chat_prompt(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First."}]
    )
    sharing = engine.chat_prompt(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Second."}]
    )
    unrelated = engine.text_prompt("Nothing in common with the others at all.")

    handles = [
        engine.submit(GenerationRequest(prompt=p, sampling=GREEDY))
        for p in (long_prompt, sharing, unrelated)
    ]
    _, second, third = (handle.result(timeout=120) for handle in handles)
    assert third.timings.queued_s < second.timings.queued_s  # it did not wait behind it
    assert second.usage.cached_tokens >= long_prompt.system_end
    assert engine.stats.prefix_waits == 1


def test_a_cancelled_prefill_releases_the_requests_waiting_on_it(tiny_model, make_engine) -> None:
    path = tiny_model("qwen35")
    engine = make_engine(path, n_slots=2, prefill_chunk=16, block_tokens=32)
    first = engine.chat_prompt(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First."}]
    )
    second = engine.chat_prompt(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Second."}]
    )
    running = engine.submit(GenerationRequest(prompt=first, sampling=GREEDY))
    waiting = engine.submit(GenerationRequest(prompt=second, sampling=GREEDY))
    running.cancel()
    assert running.result(timeout=60).finish_reason == "cancelled"
    assert waiting.result(timeout=120).finish_reason == "length"


def test_a_short_prompt_is_not_held_up_behind_a_long_one(tiny_model, make_engine) -> None:
    """Of two prompts being computed, the one with less left goes first: a follow-up's few
    tokens are answered while another session's long document is still being computed."""
    path = tiny_model("llama")
    engine = make_engine(path, n_slots=2, prefill_chunk=16, block_tokens=32)
    long_prompt = Prompt(tokens=tuple(range(1000, 1600)))  # about 38 prefill steps
    short_prompt = Prompt(tokens=tuple(range(3000, 3020)))  # two
    long_run = engine.submit(GenerationRequest(prompt=long_prompt, sampling=FIRST_TOKEN))
    short_run = engine.submit(GenerationRequest(prompt=short_prompt, sampling=FIRST_TOKEN))
    short_run.result(timeout=60)
    assert not long_run.done
    assert long_run.result(timeout=60).usage.computed_tokens == len(long_prompt)
