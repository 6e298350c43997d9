"""A fault ends only the request that caused it; no request waits on the engine forever;
a stuck engine loop makes the replica unhealthy.

Real llama.cpp on a generated model. The faults themselves are injected by replacing one
call (a sampler's pick, a state save, the n > 1 state copy, a sampler's construction, a
decode) with one that raises or blocks for ONE chosen request: llama.cpp cannot be made to
fail like that on purpose, and these are the faults the engine must contain.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import (
    EngineError,
    EngineStalled,
    EngineTimeout,
    GenerationRequest,
    ReplicaRequest,
)
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine import slots
from baton_serve.replicas.engine.liveness import request_deadline_s
from baton_serve.replicas.replica import Replica
from baton_serve.router.gateway.errors import from_exception

MODEL = "llama"
TOKENS = 24
FAULTY = "faulty"


def _request(
    prompt: Prompt, request_id: str | None = None, *, n: int = 1, seed: int | None = None
) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=TOKENS, ignore_eos=True, seed=seed)
    ids = {"request_id": request_id} if request_id else {}
    return GenerationRequest(prompt=prompt, sampling=sampling, n=n, **ids)


def _raw(first: int) -> Prompt:
    """A prompt of token ids sharing no first token with another (so no slot reuses it)."""
    return Prompt(tokens=tuple(range(first, first + 24)))


def _tokens(engine, prompts: list[Prompt]) -> list[list[int]]:
    handles = [engine.submit(_request(p)) for p in prompts]
    return [h.result(timeout=60).tokens for h in handles]


def _fail_for(monkeypatch, engine, call: str, fails: Callable[[int], bool]) -> None:
    """Make the engine's `context.<call>(seq_id)` raise where `fails(seq_id)`: the fault
    injected (llama.cpp cannot be made to fail there on purpose)."""
    original = getattr(engine._context, call)

    def faulty(seq_id: int) -> object:
        if fails(seq_id):
            raise RuntimeError(f"injected {call} fault")
        return original(seq_id)

    monkeypatch.setattr(engine._context, call, faulty)


def _still_serves(engine, n: int = 1) -> None:
    done = engine.submit(_request(_raw(4000), n=n, seed=3)).result(timeout=60)
    assert [len(c.tokens) for c in done.choices] == [TOKENS] * n
    assert engine.wait_idle(30) and engine.load().running == 0


def test_a_sampler_that_raises_ends_only_its_request(tiny_model, make_engine, monkeypatch):
    engine = make_engine(tiny_model(MODEL), n_slots=4)
    neighbours = [engine.text_prompt(f"Neighbour {i} tells a story.") for i in range(3)]
    undisturbed = _tokens(engine, neighbours)
    pick = slots.Running.pick

    def faulty_pick(run, logits, is_end_of_generation):
        if run.handle.request.request_id == FAULTY and len(run.generated) == 3:
            raise RuntimeError("injected sampler fault")  # e.g. a grammar that raises
        return pick(run, logits, is_end_of_generation)

    monkeypatch.setattr(slots.Running, "pick", faulty_pick)
    handles = [engine.submit(_request(p)) for p in neighbours]
    bad = engine.submit(_request(engine.text_prompt("The faulty one."), FAULTY))
    with pytest.raises(EngineError, match=f"request {FAULTY} failed while sampling a token"):
        bad.result(timeout=60)
    assert [h.result(timeout=60).tokens for h in handles] == undisturbed
    assert engine.stats.request_faults == 1
    monkeypatch.setattr(slots.Running, "pick", pick)
    _still_serves(engine)


def test_a_failed_state_save_while_evicting_ends_only_its_request(
    tiny_model, make_engine, monkeypatch
):
    engine = make_engine(tiny_model(MODEL), n_slots=3)
    neighbours = [_raw(1000), _raw(2000)]
    undisturbed = _tokens(engine, neighbours)  # their states stay in slots 0 and 1
    # A prompt computed and not replayed (no reply): its state is in slot 2 and nowhere
    # else, so the faulty request, placed there, must save it before evicting it.
    prompt_only = GenerationRequest(prompt=_raw(3000), sampling=SamplingParams(max_tokens=0))
    engine.submit(prompt_only).result(timeout=60)
    assert engine.wait_idle(30)
    (victim,) = [s for s in engine._slots if s.tokens and s.tokens[0] == 3000]
    _fail_for(monkeypatch, engine, "save_state", lambda seq_id: seq_id == victim.seq_id)
    handles = [engine.submit(_request(p)) for p in neighbours]
    bad = engine.submit(_request(_raw(5000), FAULTY))
    with pytest.raises(EngineError, match=f"request {FAULTY} failed while starting"):
        bad.result(timeout=60)
    assert [h.result(timeout=60).tokens for h in handles] == undisturbed
    assert victim.tokens == [] and victim.running is None  # its state was unknown: emptied
    monkeypatch.undo()
    _still_serves(engine)


def test_a_failed_state_copy_for_n_choices_ends_only_its_request(
    tiny_model, make_engine, monkeypatch
):
    engine = make_engine(tiny_model(MODEL), n_slots=4)
    neighbours = [engine.text_prompt(f"Neighbour {i} keeps going.") for i in range(2)]
    undisturbed = _tokens(engine, neighbours)

    def failing_copy(source, target):
        raise RuntimeError("injected copy_sequence fault")  # only n > 1 copies states

    monkeypatch.setattr(engine._context, "copy_sequence", failing_copy)
    handles = [engine.submit(_request(p)) for p in neighbours]
    bad = engine.submit(_request(engine.text_prompt("Two choices, please."), FAULTY, n=2))
    with pytest.raises(EngineError, match=f"request {FAULTY} failed while copying"):
        bad.result(timeout=60)
    assert [h.result(timeout=60).tokens for h in handles] == undisturbed
    monkeypatch.undo()
    _still_serves(engine, n=2)  # both of its slots were given back


def test_a_failed_store_of_a_finished_conversation_loses_only_that_state(
    tiny_model, make_engine, monkeypatch
):
    """The full state stored once the engine is idle: a save that raises is logged, the
    conversation's state is not stored (nor tried again), and the engine serves on."""
    engine = make_engine(tiny_model("qwen35"), n_slots=2)
    _fail_for(monkeypatch, engine, "save_state", lambda seq_id: True)
    done = engine.submit(_request(_raw(1000))).result(timeout=60)
    assert len(done.tokens) == TOKENS  # answered before anything is stored
    assert engine.wait_idle(30)
    assert engine.stats.written_back == 0 and not engine.checkpoints()
    monkeypatch.undo()
    _still_serves(engine)


def test_a_failed_anchor_ends_only_its_request(tiny_model, make_engine, monkeypatch):
    engine = make_engine(tiny_model("qwen35"), n_slots=3)
    neighbours = [_raw(1000), _raw(2000)]
    undisturbed = _tokens(engine, neighbours)
    assert engine.wait_idle(30)

    def faulty_request(seq_id: int) -> bool:
        running = engine._slots[seq_id].running  # on the engine thread: the slot's request
        return running is not None and running.handle.request.request_id == FAULTY

    _fail_for(monkeypatch, engine, "save_partial", faulty_request)
    handles = [engine.submit(_request(p)) for p in neighbours]
    bad = engine.submit(_request(_raw(5000), FAULTY))
    with pytest.raises(EngineError, match=f"request {FAULTY} failed while keeping an anchor"):
        bad.result(timeout=60)
    assert [h.result(timeout=60).tokens for h in handles] == undisturbed
    monkeypatch.undo()
    _still_serves(engine)


def test_a_request_whose_start_raises_is_finished_at_once(tiny_model, make_engine, monkeypatch):
    engine = make_engine(tiny_model(MODEL), n_slots=3)
    neighbour = engine.text_prompt("A neighbour that starts fine.")
    (undisturbed,) = _tokens(engine, [neighbour])
    sampler = slots.TokenSampler

    def failing_sampler(params, *args, **kwargs):
        if params.seed == 8:  # choice 1 of the faulty request (seed 7 + 1): half started
            raise RuntimeError("injected sampler construction fault")
        return sampler(params, *args, **kwargs)

    monkeypatch.setattr(slots, "TokenSampler", failing_sampler)
    handle = engine.submit(_request(neighbour))
    bad = engine.submit(_request(engine.text_prompt("Fails to start."), FAULTY, n=2, seed=7))
    started = time.monotonic()
    with pytest.raises(EngineError, match=f"request {FAULTY} failed while starting"):
        bad.result(timeout=30)  # before the fix: it never finished (TimeoutError here)
    assert time.monotonic() - started < 10
    assert handle.result(timeout=60).tokens == undisturbed
    monkeypatch.undo()
    _still_serves(engine, n=2)


class _StuckDecode:
    """Makes the engine's next llama_decode block until `release()` (a stuck kernel)."""

    def __init__(self, engine, monkeypatch) -> None:
        self.entered, self._go = threading.Event(), threading.Event()
        decode_rows = engine._context.decode_rows

        def stuck(entries):
            self.entered.set()
            self._go.wait(30)
            self._go.set()  # stuck once, at most 30 s (never forever, even for a failing test)
            return decode_rows(entries)

        monkeypatch.setattr(engine._context, "decode_rows", stuck)

    def release(self) -> None:
        self._go.set()


def test_a_stuck_step_makes_the_replica_unhealthy(tiny_model, make_engine, monkeypatch):
    engine = make_engine(tiny_model(MODEL), stall_timeout_s=0.3)
    replica = Replica("stuck", engine)
    time.sleep(0.5)  # idle for longer than the bound: still healthy (no work waits)
    replica.check_health()
    stuck = _StuckDecode(engine, monkeypatch)
    handle = engine.submit(_request(engine.text_prompt("Anyone there?")))
    assert stuck.entered.wait(10)
    time.sleep(0.5)
    with pytest.raises(EngineStalled, match="has not completed a step for .* 1 request"):
        replica.check_health()
    stuck.release()
    assert len(handle.result(timeout=60).tokens) == TOKENS
    replica.check_health()


def test_an_await_past_its_deadline_ends_with_a_timeout(tiny_model, make_engine, monkeypatch):
    engine = make_engine(tiny_model(MODEL), floor_tokens_per_s=1e6, max_queue_s=0.3)
    replica = Replica("slow", engine)
    stuck = _StuckDecode(engine, monkeypatch)
    prompt = engine.text_prompt("Waiting for a stuck engine.")
    request = ReplicaRequest(generation=_request(prompt))
    started = time.monotonic()
    with pytest.raises(EngineTimeout, match="did not finish within its deadline of 0.3 s"):
        asyncio.run(replica.generate(request))
    assert time.monotonic() - started < 5
    handle = engine.submit(_request(prompt))
    with pytest.raises(EngineTimeout):
        list(handle)  # the blocking stream has the same deadline
    assert handle.cancelled
    assert from_exception(EngineTimeout("late")).status == 504
    stuck.release()
    assert engine.wait_idle(30) and engine.load().running == 0  # cancelled, slots freed


def test_a_deadline_counts_the_queue_and_every_token_at_the_floor_pace(
    tiny_model, make_engine
) -> None:
    engine = make_engine(tiny_model(MODEL), floor_tokens_per_s=2.0, max_queue_s=100.0)
    request = _request(_raw(100), n=2)  # 24 prompt tokens, 2 × 24 reply tokens
    assert request_deadline_s(request, engine.n_ctx, engine.config) == 100.0 + 72 / 2.0
    assert engine.submit(request).deadline_s == 136.0
