"""What the engine's next step does, decided over plain data: no llama.cpp, no threads.

The engine (`Engine._step`) and the routing simulator (`loadtests/sim_replica.py`) each
describe their queue and slots as a `StepView` and execute the `StepPlan` that
`plan_step` returns, so both schedule by this one policy:

- **Admission**, in queue order: the first request that fits the free slots and need not
  wait is admitted. One that needs more slots than are free stops the queue (nothing
  overtakes it); one that must wait (another slot is computing its prefix) lets the
  others pass. A plan admits at most one: admitting it can make a later request wait for
  it, so the executor starts it and plans again.
- **The step**: a prefill step — the next piece of the prompt (or replay) with the least
  left to compute, less what could have been computed in the time it has waited (aged: none
  starves) — unless that piece would make decoding requests wait through more than
  `prefill_budget` prompt tokens since their last token (one piece always fits), then a
  decode step (one token for every decoding request).
  Prompts that arrive together are thus computed together before the next decode step, and
  their streams decode in step, as llama-server's one batch of every slot's prompt does;
  a stream that is decoding pauses for at most one budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

Q = TypeVar("Q")  # the executor's queued request
R = TypeVar("R")  # the executor's running request


@dataclass(frozen=True)
class Queued(Generic[Q]):
    """A request in the queue."""

    key: Q
    slots: int = 1  # slots it needs: one per choice (n)


@dataclass(frozen=True)
class RunView(Generic[R]):
    """A request in a slot, as scheduling sees it: prefilling while `done` < `end`,
    decoding, or neither (a choice waiting to fork from its prompt's state)."""

    key: R
    order: int  # its place in a decode batch (the engine's sequence id)
    decoding: bool = False
    done: int = 0  # prefill: tokens its slot holds
    end: int = 0  # prefill: tokens its slot holds when the prefill is done
    boundaries: tuple[int, ...] = ()  # piece ends planned ahead (checkpoints, even pieces)
    since: float = 0.0  # when it began waiting for its prefill


@dataclass(frozen=True)
class StepView(Generic[Q, R]):
    """The executor's state between two steps."""

    queue: tuple[Queued[Q], ...]
    free_slots: int
    runs: tuple[RunView[R], ...]
    paused_tokens: int  # prompt tokens computed since decoding requests' last token
    prefill_budget: int  # most prompt tokens decoding requests wait through
    prefill_speed: float  # prompt tokens per second: what a prompt's wait is worth
    max_piece: int  # most prompt tokens of one prefill step
    now: float  # on the clock of the runs' `since`


@dataclass(frozen=True)
class Piece(Generic[R]):
    """Prefill tokens [start, end) of `key`'s prompt (or replay), in one step."""

    key: R
    start: int
    end: int


@dataclass(frozen=True)
class StepPlan(Generic[Q, R]):
    """What to do now: admit one request (then plan again), or run one step — a decode
    step for `decode`, in that order, or a prefill step for `prefill` — or nothing."""

    admit: Q | None = None
    waiting: tuple[Q, ...] = ()  # queued requests passed over: they must wait
    decode: tuple[R, ...] = ()
    prefill: Piece[R] | None = None
    paused_tokens: int = 0  # the next view's `paused_tokens`, once this step is done


def _never(_key: object) -> bool:
    return False


def _order(run: RunView[R]) -> int:
    return run.order


def plan_step(view: StepView[Q, R], must_wait: Callable[[Q], bool] = _never) -> StepPlan[Q, R]:
    """The next thing to do. `must_wait` is asked in queue order, only about requests that
    fit the free slots and only until one is admitted (answering may reserve a checkpoint
    for the request that waits)."""
    waiting: list[Q] = []
    for queued in view.queue:
        if view.free_slots < queued.slots:
            break
        if not must_wait(queued.key):
            return StepPlan(admit=queued.key, waiting=tuple(waiting))
        waiting.append(queued.key)
    passed = tuple(waiting)
    decoding = tuple(r.key for r in sorted((r for r in view.runs if r.decoding), key=_order))
    prefilling = [r for r in view.runs if r.done < r.end]
    if not prefilling:
        return StepPlan(waiting=passed, decode=decoding)
    run = min(prefilling, key=lambda r: prefill_priority(r, view.prefill_speed, view.now))
    piece = Piece(run.key, run.done, next_piece_end(run, view.max_piece))
    if not decoding:
        return StepPlan(waiting=passed, prefill=piece)
    paused = view.paused_tokens + piece.end - piece.start
    if view.paused_tokens and paused > view.prefill_budget:  # one piece fits any budget
        return StepPlan(waiting=passed, decode=decoding)
    return StepPlan(waiting=passed, prefill=piece, paused_tokens=paused)


def prefill_priority(run: RunView[R], tokens_per_s: float, now: float) -> tuple[float, float]:
    """Lowest first: the tokens left to compute, less those computable in the time it has
    waited (so a long prompt is not starved by short ones), then age."""
    return run.end - run.done - tokens_per_s * (now - run.since), run.since


def next_piece_end(run: RunView[R], max_piece: int) -> int:
    """Where `run`'s next prefill piece ends: its next planned boundary, at most
    `max_piece` tokens on."""
    boundary = min((b for b in run.boundaries if b > run.done), default=run.end)
    return min(boundary, run.done + max_piece)
