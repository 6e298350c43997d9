"""`plan_step`, the engine's scheduling over plain data: admission, waiting for a prefix in
flight, every decoding stream in every step beside prompt pieces within the step's budget,
pieces at checkpoint cuts — and the engine and the routing simulator both executing its
plans."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from baton_serve.cache_store.wire.protocol import GenerationRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.loadtests.sim_bench import PROFILES
from baton_serve.loadtests.sim_cluster import Cluster
from baton_serve.loadtests.sim_policies import ROUND_ROBIN
from baton_serve.loadtests.sim_workload import BURST, Phase, Session, Turn
from baton_serve.replicas.engine import engine as engine_module
from baton_serve.replicas.engine import step_plan
from baton_serve.replicas.engine.checkpoint_policy import prefill_checkpoints, prefill_pieces
from baton_serve.replicas.engine.step_plan import (
    Piece,
    Queued,
    RunView,
    StepPlan,
    StepView,
    plan_step,
)


def view(
    queue: tuple[Queued[str], ...] = (),
    runs: tuple[RunView[str], ...] = (),
    *,
    free: int = 4,
    step_tokens: int = 512,
    now: float = 10.0,
    max_piece: int = 256,
    one_call: bool = False,
) -> StepView[str, str]:
    return StepView(queue, free, runs, step_tokens, max_piece, one_call, 100.0, now)


def prefill(key: str, done: int, end: int, since: float = 0.0, **kw: object) -> RunView[str]:
    return RunView(key, 0, done=done, end=end, since=since, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- admission


def test_the_queue_is_admitted_in_order_one_request_a_plan() -> None:
    plan = plan_step(view((Queued("a"), Queued("b"))))
    assert plan == StepPlan(admit="a")  # b is planned after a has started


def test_a_request_needing_more_slots_than_are_free_stops_the_queue() -> None:
    plan = plan_step(view((Queued("a", slots=3), Queued("b")), free=2))
    assert plan.admit is None  # b does not overtake a
    assert plan_step(view((Queued("a", slots=2), Queued("b")), free=2)).admit == "a"
    assert plan_step(view((Queued("a"),), free=0)).admit is None


def test_a_request_waiting_for_a_prefix_lets_the_others_pass() -> None:
    asked: list[str] = []

    def must_wait(key: str) -> bool:
        asked.append(key)
        return key == "a"

    plan = plan_step(view((Queued("a"), Queued("b"), Queued("c"))), must_wait)
    assert (plan.admit, plan.waiting) == ("b", ("a",))
    assert asked == ["a", "b"]  # asked in order, only until one is admitted

    asked.clear()
    plan = plan_step(view((Queued("a"), Queued("b", slots=2)), free=1), must_wait)
    assert (plan.admit, plan.waiting, asked) == (None, ("a",), ["a"])  # b does not fit


def test_nothing_to_do_is_an_empty_plan() -> None:
    assert plan_step(view()) == StepPlan()
    waiting = prefill("w", 0, 0)  # a choice waiting to fork: neither decodes nor prefills
    assert plan_step(view(runs=(waiting,))) == StepPlan()


# ---------------------------------------------------------------- the step


def test_the_decode_batch_is_every_decoding_request_in_order() -> None:
    runs = (RunView("c", 2, decoding=True), RunView("a", 0, decoding=True), prefill("p", 0, 0))
    assert plan_step(view(runs=runs)) == StepPlan(decode=("a", "c"))


def test_every_step_carries_every_decoding_stream_beside_a_piece() -> None:
    runs = (RunView("d", 1, decoding=True), RunView("e", 0, decoding=True), prefill("p", 0, 1000))
    plan = plan_step(view(runs=runs))
    assert plan == StepPlan(decode=("e", "d"), prefill=(Piece("p", 0, 256),))
    # the next step too: a stream never waits for a prompt's other pieces
    later = (*runs[:2], prefill("p", 256, 1000))
    assert plan_step(view(runs=later)).decode == ("e", "d")


def test_the_piece_is_cut_to_the_room_the_streams_leave() -> None:
    streams = tuple(RunView(f"d{i}", i, decoding=True) for i in range(3))
    plan = plan_step(view(runs=(*streams, prefill("p", 0, 1000)), step_tokens=103))
    assert plan.prefill == (Piece("p", 0, 100),)
    # a cut never leaves one token before a planned boundary: it moves back by one
    cut = plan_step(view(runs=(*streams, prefill("p", 0, 101)), step_tokens=103))
    assert cut.prefill == (Piece("p", 0, 99),)
    ahead = prefill("p", 0, 1000, boundaries=(101, 1000))
    assert plan_step(view(runs=(*streams, ahead), step_tokens=103)).prefill == (Piece("p", 0, 99),)


def test_one_piece_always_goes_in_so_prompts_never_starve() -> None:
    streams = tuple(RunView(f"d{i}", i, decoding=True) for i in range(4))
    plan = plan_step(view(runs=(*streams, prefill("p", 0, 1000)), step_tokens=4))
    assert len(plan.decode) == 4 and plan.prefill == (Piece("p", 0, 2),)  # never one token
    three = plan_step(view(runs=(*streams, prefill("p", 0, 3)), step_tokens=4))
    assert three.prefill == (Piece("p", 0, 3),)  # 2 would leave a lone row


def test_a_step_carries_several_prompts_where_it_is_one_call_or_no_stream_decodes() -> None:
    runs = (
        RunView("d", 0, decoding=True),
        prefill("long", 0, 1000, since=9.0),
        prefill("short", 0, 100, since=9.0),
        prefill("mid", 0, 300, since=9.0),
    )
    plan = plan_step(view(runs=runs, step_tokens=512, one_call=True))
    # by priority, one piece a run, until the step's 512 tokens are spent
    assert plan.prefill == (Piece("short", 0, 100), Piece("mid", 0, 256), Piece("long", 0, 155))
    assert plan.decode == ("d",)
    # a call a piece: beside a decoding stream, one; with none decoding, each prompt's
    assert plan_step(view(runs=runs, step_tokens=512)).prefill == (Piece("short", 0, 100),)
    idle = plan_step(view(runs=runs[1:], step_tokens=512)).prefill
    assert idle == (Piece("short", 0, 100), Piece("mid", 0, 256), Piece("long", 0, 156))


def test_prefill_without_decoding_streams_has_the_whole_step() -> None:
    plan = plan_step(view(runs=(prefill("a", 0, 1000),), step_tokens=100))
    assert plan == StepPlan(prefill=(Piece("a", 0, 100),))


def test_the_prompt_with_least_left_goes_first_aged_so_none_starves() -> None:
    short, long = prefill("short", 0, 100, since=9.0), prefill("long", 0, 1000, since=9.0)
    assert plan_step(view(runs=(long, short))).prefill[0].key == "short"
    # at 100 tokens/s, 10 s of waiting is worth 1000 tokens: the old long prompt goes first
    old_long = prefill("long", 0, 1000, since=0.0)
    assert plan_step(view(runs=(short, old_long))).prefill[0].key == "long"
    # equal priorities: the older one
    a, b = prefill("a", 0, 100, since=5.0), prefill("b", 100, 200, since=5.0)
    assert step_plan.prefill_priority(a, 100.0, 10.0) == step_plan.prefill_priority(b, 100.0, 10.0)
    assert plan_step(view(runs=(b, a))).prefill[0].key == "b"


def _pieces(run: RunView[str], max_piece: int) -> list[tuple[int, int]]:
    """The pieces successive plans give `run` when each is executed."""
    got = []
    while run.done < run.end:
        (piece,) = plan_step(view(runs=(run,), max_piece=max_piece)).prefill
        assert piece.start == run.done
        got.append((piece.start, piece.end))
        run = replace(run, done=piece.end)
    return got


def test_prefill_pieces_end_at_the_planned_checkpoint_cuts() -> None:
    cuts = [300, 698]
    planned = prefill_pieces(40, 700, cuts, 256)  # the engine's pieces for this prompt
    got = _pieces(prefill("p", 40, 700, boundaries=tuple(planned)), 256)
    assert [end for _, end in got] == planned
    assert {300, 698} <= {end for _, end in got}
    assert all(2 <= end - start <= 256 for start, end in got)


def test_without_planned_cuts_a_prefill_goes_max_piece_at_a_time() -> None:
    assert _pieces(prefill("p", 0, 600), 256) == [(0, 256), (256, 512), (512, 600)]


# ---------------------------------------------------------------- the executors


def _recording(monkeypatch: pytest.MonkeyPatch, module: object) -> list[StepPlan]:
    """The plans `module`'s executor gets and carries out (the simulator also plans on
    arrivals mid-step, for admissions only: those plans' steps are not run)."""
    plans: list[StepPlan] = []

    def record(view: StepView, must_wait=step_plan._never) -> StepPlan:  # type: ignore[no-untyped-def]
        plan = plan_step(view, must_wait)  # the real one
        if plan.admit is not None or not getattr(must_wait.__self__, "_stepping", False):
            plans.append(plan)
        return plan

    monkeypatch.setattr(module, "plan_step", record)
    return plans


def test_the_engine_and_the_simulator_call_the_same_function() -> None:
    assert engine_module.plan_step is step_plan.plan_step
    from baton_serve.loadtests import sim_replica

    assert sim_replica.steps is step_plan


def test_the_simulator_executes_plan_step(monkeypatch: pytest.MonkeyPatch) -> None:
    plans = _recording(monkeypatch, step_plan)
    cpu = replace(PROFILES["cpu"], step_noise=0.0)
    long = Session(BURST, 0, 0.0, (), [Turn(((1, 1000),), 8)])
    short = Session(BURST, 1, 0.5, (), [Turn(((2, 100),), 8)])
    Cluster(cpu, 1, ROUND_ROBIN).run([Phase([long, short])])

    steps = [p for p in plans if p.prefill]
    pieces = [(x.key.n_prompt, x.start, x.end) for p in steps for x in p.prefill]
    assert pieces[:5] == [
        (1000, 0, 256),
        (100, 0, 100),  # less left than the long prompt: it goes first, in the same step
        (1000, 256, 512),
        (1000, 512, 768),
        (1000, 768, 1000),
    ]
    admitted = [p.admit.n_prompt for p in plans if p.admit is not None]
    assert admitted == [1000, 100]
    # no stream decodes in the first two steps: a piece of each prompt; then the short one
    # decodes in every step, beside one piece of the long one
    assert [(len(p.prefill), len(p.decode)) for p in steps[:4]] == [(1, 0), (2, 0), (1, 1), (1, 1)]


def test_the_engine_executes_plan_step(
    monkeypatch: pytest.MonkeyPatch, tiny_model, make_engine
) -> None:
    """A hybrid model's prompt is computed in the pieces its plans give, ending at its
    checkpoint positions, each piece of at most `prefill_chunk` tokens."""
    plans = _recording(monkeypatch, engine_module)
    engine = make_engine(tiny_model("qwen35"), prefill_chunk=32, block_tokens=32)
    system = "You are a careful assistant who answers in short sentences. " * 4
    prompt = engine.chat_prompt(
        [{"role": "system", "content": system}, {"role": "user", "content": "Say something."}]
    )
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    result = engine.submit(GenerationRequest(prompt=prompt, sampling=sampling)).result(60)
    assert engine.wait_idle(60)

    config = engine.config
    cuts = prefill_checkpoints(
        prompt,
        cached=0,
        interval=config.checkpoint_interval,
        max_interval=config.max_interval_checkpoints,
    )
    first_decode = next(i for i, p in enumerate(plans) if p.decode)
    prompt_pieces = [piece for p in plans[:first_decode] for piece in p.prefill]
    ends = [piece.end for piece in prompt_pieces]
    assert ends == prefill_pieces(0, len(prompt), cuts, 32)
    assert set(cuts) <= set(ends) and prompt.system_end in ends
    assert result.usage.computed_tokens == len(prompt)
    assert sum(1 for p in plans if p.decode) == len(result.tokens) - 1  # the first: prefill's
    replay = [piece for p in plans[first_decode:] for piece in p.prefill]
    assert replay and replay[-1].end == len(prompt) + len(result.tokens)


@pytest.mark.parametrize("exact_reuse", [True, False])
def test_a_stream_decodes_in_every_step_while_a_prompt_is_computed(
    monkeypatch: pytest.MonkeyPatch, tiny_model, make_engine, exact_reuse: bool
) -> None:
    """Two prompts submitted at once start in the same step; the first to finish decodes in
    every step that computes the other's pieces. With exact reuse each piece is a call of
    its own and a step beside a decoding stream has one; without, the step is one
    llama_decode and may carry both prompts' pieces beside it."""
    plans = _recording(monkeypatch, engine_module)
    engine = make_engine(tiny_model("llama"), prefill_chunk=16, exact_reuse=exact_reuse)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [
        engine.text_prompt(f"Request {i}: " + "tell me a story. " * (10 + 30 * i)) for i in (0, 1)
    ]
    handles = [engine.submit(GenerationRequest(prompt=p, sampling=sampling)) for p in prompts]
    results = [h.result(60) for h in handles]
    assert engine.wait_idle(60)

    assert all(len(r.tokens) == 24 for r in results)
    steps = [p for p in plans if not p.empty]
    first_streams = next(i for i, p in enumerate(steps) if p.decode)
    long_pieces = [  # the second prompt's (not its reply's replay)
        p
        for p in steps[first_streams:]
        if any(x.key.handle is handles[1] and x.end <= len(prompts[1]) for x in p.prefill)
    ]
    assert len(long_pieces) >= 3 and all(p.decode for p in long_pieces)
    assert any(len(p.prefill) == 2 for p in steps[:first_streams])  # both, before any decodes
    if exact_reuse:  # a piece a call: beside a decoding stream, one piece a step
        assert all(len(p.prefill) <= 1 for p in steps if p.decode)


def test_a_prompt_computed_beside_a_decoding_stream_is_bit_exact(tiny_model, make_engine) -> None:
    """On the CPU with exact reuse, a prompt whose pieces share steps with another stream's
    decoding gives the same logits, bit for bit, as the prompt computed alone (its pieces
    never share a llama_decode with the decode rows)."""
    path = tiny_model("qwen35")
    engine = make_engine(path, prefill_chunk=16, prefix_cache=False)
    prompt = engine.text_prompt("A prompt computed in many pieces. " * 12)
    alone = engine.generate(prompt, SamplingParams(max_tokens=1), return_logits=True)
    other = engine.text_prompt("Another conversation, already decoding. " * 2)
    stream = engine.submit(
        GenerationRequest(prompt=other, sampling=SamplingParams(max_tokens=400, ignore_eos=True))
    )
    next(iter(stream))  # decoding now
    decode_steps = engine.stats.decode_steps
    beside = engine.generate(prompt, SamplingParams(max_tokens=1), return_logits=True)
    assert engine.stats.decode_steps - decode_steps >= 3  # the stream's steps beside it
    assert len(stream.result(120).tokens) == 400
    assert alone.logits is not None and beside.logits is not None
    assert np.array_equal(alone.logits, beside.logits)


def test_a_request_waits_for_a_prefix_in_flight_by_one_rule() -> None:
    """A queued request waits for another prefill's prefix only where it shares a block at
    least, more than it holds; the engine's cache and the simulator ask the same function."""
    from baton_serve.loadtests import sim_replica
    from baton_serve.replicas.engine import prefix_cache

    assert step_plan.worth_waiting(held=0, in_flight=64, min_tokens=64)
    assert not step_plan.worth_waiting(held=0, in_flight=63, min_tokens=64)
    assert not step_plan.worth_waiting(held=200, in_flight=200, min_tokens=64)
    assert prefix_cache.worth_waiting is sim_replica.steps.worth_waiting is step_plan.worth_waiting
