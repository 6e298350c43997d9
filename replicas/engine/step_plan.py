"""What the engine's next step does, decided over plain data: no llama.cpp, no threads.

The engine (`Engine._step`) and the routing simulator (`loadtests/sim_replica.py`) each
describe their queue and slots as a `StepView` and execute the `StepPlan` that
`plan_step` returns, so both schedule by this one policy:

- **Admission**, in queue order: the first request that fits the free slots and need not
  wait is admitted. One that needs more slots than are free stops the queue (nothing
  overtakes it); one that must wait (another slot is computing its prefix) lets the
  others pass. A plan admits at most one: admitting it can make a later request wait for
  it, so the executor starts it and plans again.
- **The step** carries every decoding stream's next token and, within `step_tokens` in
  all, pieces of prompts (and replays): the prompt with the least left to compute goes
  first, less what could have been computed in the time it has waited (aged: none
  starves). So a prompt never stops the running streams for more than one step, and a
  stream never holds a prompt back: vLLM's chunked prefill and llama-server's one batch
  of every slot's work do the same. One piece always goes in, however many streams decode.
- **Pieces** end at the run's planned boundaries (checkpoints, even pieces) or where the
  budget runs out, never leaving a one-token remainder (`checkpoint_policy`: one row
  rounds differently), and an image's piece is never cut (`whole`); a run has one piece
  a step. Where the executor computes a step in
  one call (`one_call`) several runs' pieces share it. Where each piece is a call of its
  own, a step beside decoding streams has one piece (each more would lengthen their gap,
  and the least-left prompt finishes first); a step with no stream decoding has a piece
  of every prompt, so prompts that arrive together start decoding together and stay in
  step (each one's next prompt then lands beside the other's, not between its tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from baton_serve.replicas.engine.checkpoint_policy import MIN_PIECE

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
    whole: tuple[int, ...] = ()  # boundaries whose piece is never cut short (an image's)


@dataclass(frozen=True)
class StepView(Generic[Q, R]):
    """The executor's state between two steps."""

    queue: tuple[Queued[Q], ...]
    free_slots: int
    runs: tuple[RunView[R], ...]
    step_tokens: int  # most tokens of one step: a row per decoding stream plus prompt pieces
    max_piece: int  # most tokens of one piece
    one_call: bool  # the step is one llama_decode; else a call a piece (one beside streams)
    prefill_speed: float  # prompt tokens per second: what a prompt's wait is worth
    now: float  # on the clock of the runs' `since`


@dataclass(frozen=True)
class Piece(Generic[R]):
    """Prefill tokens [start, end) of `key`'s prompt (or replay), in one step."""

    key: R
    start: int
    end: int


@dataclass(frozen=True)
class StepPlan(Generic[Q, R]):
    """What to do now: admit one request (then plan again), or run one step — a token for
    each of `decode`, in that order, and the `prefill` pieces, in that order — or nothing."""

    admit: Q | None = None
    waiting: tuple[Q, ...] = ()  # queued requests passed over: they must wait
    decode: tuple[R, ...] = ()
    prefill: tuple[Piece[R], ...] = ()

    @property
    def empty(self) -> bool:
        """Nothing to compute."""
        return not self.decode and not self.prefill


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
    prefilling = sorted(
        (r for r in view.runs if r.done < r.end),
        key=lambda r: prefill_priority(r, view.prefill_speed, view.now),
    )
    left = view.step_tokens - len(decoding)
    pieces: list[Piece[R]] = []
    for run in prefilling:  # one piece a run: its anchors and checkpoints come between pieces
        end = _piece_end(run, view.max_piece, left, first=not pieces)
        if end is None:
            continue
        pieces.append(Piece(run.key, run.done, end))
        left -= end - run.done
        if (decoding and not view.one_call) or left < MIN_PIECE:
            break
    return StepPlan(waiting=passed, decode=decoding, prefill=tuple(pieces))


def _piece_end(run: RunView[R], max_piece: int, left: int, *, first: bool) -> int | None:
    """Where `run`'s next piece ends within `left` tokens (and `max_piece`, but for an
    image's): at its next planned boundary, or earlier where the room ends, never leaving
    one token before the boundary; None if no piece fits (the step's first piece always
    does: prompts never starve)."""
    done = run.done
    boundary = min((b for b in run.boundaries if b > done), default=run.end)
    if boundary in run.whole:
        return boundary if first or boundary - done <= left else None
    room = min(max_piece, left)
    end = min(boundary, done + max(room, MIN_PIECE if first else 0))
    if boundary - end == 1:  # the rest would be a lone row
        end = end - 1 if end - 1 - done >= MIN_PIECE else boundary
    if end - done < min(MIN_PIECE, boundary - done):
        return None
    if not first and end - done > room:
        return None
    return end


def worth_waiting(held: int, in_flight: int, min_tokens: int) -> bool:
    """Whether a queued request waits for the prefix another prefill here is computing: it
    shares `in_flight` tokens with that prompt, more than the `held` ones it could reuse now,
    and at least `min_tokens` (a block; the engine and the simulator both ask this)."""
    return in_flight >= min_tokens and in_flight > held


def prefill_priority(run: RunView[R], tokens_per_s: float, now: float) -> tuple[float, float]:
    """Lowest first: the tokens left to compute, less those computable in the time it has
    waited (so a long prompt is not starved by short ones), then age."""
    return run.end - run.done - tokens_per_s * (now - run.since), run.since
