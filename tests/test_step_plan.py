"""`plan_step`, the engine's scheduling over plain data: admission, waiting for a prefix in
flight, the decode batch, prefill pieces at checkpoint cuts — and the engine and the
routing simulator both executing its plans."""

from __future__ import annotations

from dataclasses import replace

import pytest

from baton_serve.loadtests.sim_bench import PROFILES
from baton_serve.loadtests.sim_cluster import Cluster
from baton_serve.loadtests.sim_policies import ROUND_ROBIN
from baton_serve.loadtests.sim_workload import BURST, Phase, Session, Turn
from baton_serve.replicas.engine import engine as engine_module
from baton_serve.replicas.engine import step_plan
from baton_serve.replicas.engine.checkpoint_policy import prefill_checkpoints, prefill_pieces
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.step_plan import (
    Piece,
    Queued,
    RunView,
    StepPlan,
    StepView,
    plan_step,
)
from baton_serve.replicas.wire.protocol import GenerationRequest
from baton_serve.replicas.wire.sampling_params import SamplingParams


def view(
    queue: tuple[Queued[str], ...] = (),
    runs: tuple[RunView[str], ...] = (),
    *,
    free: int = 4,
    paused: int = 0,
    budget: int = 512,
    now: float = 10.0,
    max_piece: int = 256,
) -> StepView[str, str]:
    return StepView(queue, free, runs, paused, budget, 100.0, max_piece, now)


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


def test_decoding_streams_wait_through_at_most_the_prefill_budget() -> None:
    runs = (RunView("d", 0, decoding=True), prefill("p", 0, 1000))
    first = plan_step(view(runs=runs, paused=0, budget=512))
    assert first.prefill == Piece("p", 0, 256) and first.paused_tokens == 256
    at_budget = (RunView("d", 0, decoding=True), prefill("p", 256, 1000))
    second = plan_step(view(runs=at_budget, paused=256, budget=512))
    assert second.prefill == Piece("p", 256, 512) and second.paused_tokens == 512
    over = (RunView("d", 0, decoding=True), prefill("p", 512, 1000))
    assert plan_step(view(runs=over, paused=512, budget=512)) == StepPlan(decode=("d",))
    # the decode step's plan starts the next pause from nothing
    assert plan_step(view(runs=over, paused=512, budget=512)).paused_tokens == 0


def test_a_small_prompt_fits_the_rest_of_the_budget() -> None:
    runs = (RunView("d", 0, decoding=True), prefill("p", 0, 100))
    plan = plan_step(view(runs=runs, paused=400, budget=512))
    assert plan.prefill == Piece("p", 0, 100) and plan.paused_tokens == 500
    assert plan_step(view(runs=runs, paused=450, budget=512)).decode == ("d",)


def test_one_piece_fits_any_budget_so_budget_zero_alternates() -> None:
    runs = (RunView("d", 0, decoding=True), prefill("p", 0, 1000))
    first = plan_step(view(runs=runs, paused=0, budget=0))
    assert first.prefill == Piece("p", 0, 256)  # never starved by a small budget
    assert plan_step(view(runs=runs, paused=256, budget=0)) == StepPlan(decode=("d",))


def test_prefill_without_decoding_streams_pauses_nobody() -> None:
    plan = plan_step(view(runs=(prefill("a", 0, 1000),), paused=300, budget=512))
    assert plan.prefill == Piece("a", 0, 256) and plan.paused_tokens == 0


def test_the_prompt_with_least_left_goes_first_aged_so_none_starves() -> None:
    short, long = prefill("short", 0, 100, since=9.0), prefill("long", 0, 1000, since=9.0)
    assert plan_step(view(runs=(long, short))).prefill.key == "short"  # type: ignore[union-attr]
    # at 100 tokens/s, 10 s of waiting is worth 1000 tokens: the old long prompt goes first
    old_long = prefill("long", 0, 1000, since=0.0)
    assert plan_step(view(runs=(short, old_long))).prefill.key == "long"  # type: ignore[union-attr]
    # equal priorities: the older one
    a, b = prefill("a", 0, 100, since=5.0), prefill("b", 100, 200, since=5.0)
    assert step_plan.prefill_priority(a, 100.0, 10.0) == step_plan.prefill_priority(b, 100.0, 10.0)
    assert plan_step(view(runs=(b, a))).prefill.key == "b"  # type: ignore[union-attr]


def _pieces(run: RunView[str], max_piece: int) -> list[tuple[int, int]]:
    """The pieces successive plans give `run` when each is executed."""
    got = []
    while run.done < run.end:
        piece = plan_step(view(runs=(run,), max_piece=max_piece)).prefill
        assert piece is not None and piece.start == run.done
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

    pieces = [(p.prefill.key.n_prompt, p.prefill.start, p.prefill.end) for p in plans if p.prefill]
    assert pieces[:5] == [
        (1000, 0, 256),
        (100, 0, 100),  # less left than the long prompt: it goes first
        (1000, 256, 512),
        (1000, 512, 768),
        (1000, 768, 1000),
    ]
    admitted = [p.admit.n_prompt for p in plans if p.admit is not None]
    assert admitted == [1000, 100]
    # the short one decodes once the long one's last 744 tokens (within the budget) are done
    kinds = ["d" if p.decode else "p" for p in plans if p.decode or p.prefill]
    assert "".join(kinds).startswith("pppppdd")


def test_the_simulator_follows_the_profiles_prefill_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    plans = _recording(monkeypatch, step_plan)
    cpu = replace(PROFILES["cpu"], step_noise=0.0, prefill_budget=0)
    long = Session(BURST, 0, 0.0, (), [Turn(((1, 1000),), 8)])
    short = Session(BURST, 1, 0.5, (), [Turn(((2, 100),), 8)])
    Cluster(cpu, 1, ROUND_ROBIN).run([Phase([long, short])])
    # budget 0: once the short one decodes (its prefill gave its first token), a decode
    # step follows each prefill step
    kinds = ["d" if p.decode else "p" for p in plans if p.decode or p.prefill]
    assert "".join(kinds).startswith("pppdpdpd")


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
    prompt_pieces = [p.prefill for p in plans[:first_decode] if p.prefill is not None]
    ends = [piece.end for piece in prompt_pieces]
    assert ends == prefill_pieces(0, len(prompt), cuts, 32)
    assert set(cuts) <= set(ends) and prompt.system_end in ends
    assert result.usage.computed_tokens == len(prompt)
    assert sum(1 for p in plans if p.decode) == len(result.tokens) - 1  # the first: prefill's
    replay = [p.prefill for p in plans[first_decode:] if p.prefill is not None]
    assert replay and replay[-1].end == len(prompt) + len(result.tokens)


@pytest.mark.parametrize("budget", [EngineConfig.model_fields["prefill_budget"].default, 0])
def test_prompts_that_arrive_together_decode_in_step(
    monkeypatch: pytest.MonkeyPatch, tiny_model, make_engine, budget: int
) -> None:
    """Two prompts submitted at once, within the prefill budget: both are computed before the
    first decode step, so every decode step carries both streams and they end together.
    Budget 0 (one prefill step between decode steps) lets the first stream run ahead. (The
    second is submitted long before the first's dozen pieces are done.)"""
    plans = _recording(monkeypatch, engine_module)
    engine = make_engine(tiny_model("llama"), prefill_chunk=16, prefill_budget=budget)
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [
        engine.text_prompt(f"Request {i}: " + "tell me a story. " * (40 + 4 * i)) for i in (0, 1)
    ]
    handles = [engine.submit(GenerationRequest(prompt=p, sampling=sampling)) for p in prompts]
    results = [h.result(60) for h in handles]
    assert engine.wait_idle(60)

    assert all(len(r.tokens) == 8 for r in results)
    total = sum(len(p) for p in prompts)
    decodes = [len(p.decode) for p in plans if p.decode]
    first_decode = next(i for i, p in enumerate(plans) if p.decode)
    prefilled_before = sum(
        p.prefill.end - p.prefill.start for p in plans[:first_decode] if p.prefill
    )
    if budget:
        assert total <= budget  # (the case's premise)
        assert prefilled_before == total
        assert decodes == [2] * 7  # the first token of each comes from its prefill
    else:
        assert prefilled_before < total
        assert 1 in decodes  # a decode step of one stream while the other was prefilled
