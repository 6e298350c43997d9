"""The engine as a server: concurrency, streaming, stop rules, cancellation, limits, errors.

Real llama.cpp on generated models (attention `llama`, hybrid `qwen35`).
"""

from __future__ import annotations

import threading

import pytest

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import EngineClosed, GenerationRequest, PromptTooLong
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.prompt import PromptError

ARCHS = ("llama", "qwen35")
LONG = SamplingParams(max_tokens=24, ignore_eos=True)


def _request(prompt: Prompt, sampling: SamplingParams = LONG) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, sampling=sampling)


@pytest.mark.parametrize("arch", ARCHS)
def test_concurrent_streams_share_decode_steps(arch, tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model(arch), n_slots=4)
    prompts = [engine.text_prompt(f"Stream number {i} tells a story.") for i in range(4)]
    handles = [engine.submit(_request(p)) for p in prompts]
    done = [h.result(timeout=60) for h in handles]

    assert [len(d.tokens) for d in done] == [24] * 4
    assert all(d.finish_reason == "length" for d in done)
    # one llama_decode per step serves every generating stream
    assert engine.stats.decode_steps < sum(len(d.tokens) for d in done)


@pytest.mark.parametrize("arch", ARCHS)
def test_more_requests_than_slots_all_complete(arch, tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model(arch), n_slots=2)
    handles = [
        engine.submit(
            _request(
                engine.text_prompt(f"Request {i}."), SamplingParams(max_tokens=5, ignore_eos=True)
            )
        )
        for i in range(7)
    ]
    assert [len(h.result(timeout=60).tokens) for h in handles] == [5] * 7


def test_stream_events_add_up_to_the_completion(tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model("llama"))
    handle = engine.submit(_request(engine.text_prompt("Once upon a time")))
    events = list(handle)
    done = handle.result()
    assert [e.token for e in events] == done.tokens
    assert "".join(e.text for e in events) == done.text
    assert done.ttft_s is not None and 0 < done.ttft_s <= done.total_s


def test_stop_string_ends_generation_before_it(tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model("llama"))
    prompt = engine.text_prompt("Tell me something")
    free = engine.generate(prompt, LONG)
    start = next(
        i
        for i in range(len(free.text) // 3, len(free.text))
        if free.text[i : i + 2].strip() == free.text[i : i + 2]
    )
    stop = free.text[start : start + 2]
    stopped = engine.generate(prompt, LONG.model_copy(update={"stop": (stop,)}))
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text
    assert free.text.startswith(stopped.text)


def test_seeded_sampling_is_reproducible(tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model("qwen35"))
    prompt = engine.text_prompt("Pick some words:")
    params = SamplingParams(
        max_tokens=16, temperature=1.0, top_k=50, top_p=0.95, min_p=0.01, seed=7, ignore_eos=True
    )
    first = engine.generate(prompt, params)
    again = engine.generate(prompt, params)
    other = engine.generate(prompt, params.model_copy(update={"seed": 8}))
    greedy = engine.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    assert first.tokens == again.tokens
    assert first.tokens != other.tokens
    assert first.tokens != greedy.tokens


def test_max_tokens_zero_only_prefills(tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model("qwen35"))
    done = engine.generate(engine.text_prompt("Just read this."), SamplingParams(max_tokens=0))
    assert done.tokens == [] and done.finish_reason == "length"
    assert done.usage.computed_tokens == done.usage.prompt_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_longer_than_context_is_a_clear_error(arch, tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model(arch), n_ctx=128)
    prompt = Prompt(tokens=tuple(range(100, 400)))
    with pytest.raises(PromptTooLong) as caught:
        engine.submit(_request(prompt))
    assert "300" in str(caught.value) and str(engine.n_ctx) in str(caught.value)
    assert (
        len(engine.generate(engine.text_prompt("still fine"), SamplingParams(max_tokens=2)).tokens)
        <= 2
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_stops_at_the_context_limit(arch, tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model(arch), n_ctx=128)
    prompt = Prompt(tokens=tuple(range(1000, 1100)))
    done = engine.generate(prompt, SamplingParams(max_tokens=500, ignore_eos=True))
    assert done.finish_reason == "length"
    assert 0 < len(done.tokens) and len(prompt) + len(done.tokens) <= engine.n_ctx
    assert (
        engine.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True)).usage.cached_tokens
        > 0
    )


def test_bad_token_ids_are_rejected(tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model("llama"))
    with pytest.raises(PromptError):
        engine.submit(_request(Prompt(tokens=(1, 2, 10**9))))
    with pytest.raises(PromptError):
        engine.submit(_request(Prompt(tokens=())))


@pytest.mark.parametrize("arch", ARCHS)
def test_cancel_mid_stream_frees_the_slot(arch, tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model(arch), n_slots=1)
    handle = engine.submit(
        _request(
            engine.text_prompt("A long story"), SamplingParams(max_tokens=400, ignore_eos=True)
        )
    )
    seen = 0
    for _ in handle:
        seen += 1
        if seen == 3:
            handle.cancel()
    done = handle.result(timeout=30)
    assert done.finish_reason == "cancelled"
    assert 3 <= len(done.tokens) < 400
    # the only slot is free again: the next request is served
    assert (
        len(
            engine.generate(
                engine.text_prompt("Next"), SamplingParams(max_tokens=4, ignore_eos=True)
            ).tokens
        )
        == 4
    )


def test_cancel_before_start_never_runs(tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model("llama"), n_slots=1)
    blocker = engine.submit(
        _request(engine.text_prompt("Busy"), SamplingParams(max_tokens=60, ignore_eos=True))
    )
    queued = engine.submit(_request(engine.text_prompt("Waiting")))
    queued.cancel()
    assert queued.result(timeout=30).finish_reason == "cancelled"
    assert queued.result().tokens == []
    assert len(blocker.result(timeout=30).tokens) == 60


def test_edited_last_turn_reuses_the_state_before_it(tiny_model, make_engine) -> None:
    """A hybrid model keeps a checkpoint at the start of the last user message."""
    engine = make_engine(tiny_model("qwen35"))
    history = [
        {"role": "system", "content": "Be brief. " * 30},
        {"role": "user", "content": "First question?"},
    ]
    engine.generate(engine.chat_prompt(history), SamplingParams(max_tokens=4))
    retried = engine.chat_prompt(
        history[:1] + [{"role": "user", "content": "A different first question?"}]
    )
    done = engine.generate(retried, SamplingParams(max_tokens=4))
    assert done.usage.cached_tokens == retried.last_user_start


def test_long_prefill_takes_a_bounded_number_of_checkpoints(tiny_model, make_engine) -> None:
    engine = make_engine(
        tiny_model("mamba2"), n_ctx=1024, checkpoint_interval=64, max_interval_checkpoints=3
    )
    prompt = Prompt(tokens=tuple(range(500, 1200)))
    done = engine.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    assert engine.wait_idle(timeout=30)  # the reply is replayed after the response
    # Stored: 3 interval checkpoints (peers wait for them) + the end of generation (stored
    # once idle); anchored in the slot: those 3 + the end of the prompt less the last piece.
    assert engine.stats.checkpoints_saved == 4 and engine.stats.written_back == 1
    assert engine.stats.anchors_taken == 4
    positions = sorted(c.n_tokens for c in engine.checkpoints())
    assert positions[-1] == len(prompt) + len(done.tokens)
    assert all(p % 64 == 0 for p in positions[:-1])


def test_store_budget_is_never_exceeded(tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model("qwen35"), store_budget_bytes=400_000)
    for i in range(8):
        engine.generate(
            engine.text_prompt(f"Conversation {i}: " + "words " * 40), SamplingParams(max_tokens=3)
        )
        assert engine.store_figures().used_bytes <= 400_000
    assert engine.store_figures().checkpoints > 0


def test_closed_engine_refuses_work(tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model("llama"))
    prompt = engine.text_prompt("late")
    engine.close()
    with pytest.raises(EngineClosed):
        engine.submit(_request(prompt))
    with pytest.raises(EngineClosed):
        engine.text_prompt("after close")


def test_submit_is_thread_safe(tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model("llama"), n_slots=3)
    results: list[int] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        done = engine.generate(
            engine.text_prompt(f"Client {i}"), SamplingParams(max_tokens=6, ignore_eos=True)
        )
        with lock:
            results.append(len(done.tokens))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [6] * 6
