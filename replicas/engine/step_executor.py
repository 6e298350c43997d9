"""One engine step carried out on the context: the plan's decode rows and prompt pieces,
then what follows each — a stream's next token sampled, a piece's anchor and checkpoint
kept, a prompt's first token sampled (and its other choices forked), a replay's end.

Where a step is one llama_decode (`EngineConfig.one_call_steps`) every part shares one
call; otherwise the decode rows go first, then each piece in a call of its own (a piece's
first token would share a sub-batch with the decode rows, and that lone row of its sequence
rounds differently), so a stream's token is out before the prompt work of its step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from baton_serve.cache_store.media_tokens import is_media
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.llama_context import BatchEntry
from baton_serve.replicas.engine.prefix_cache import PrefixCache
from baton_serve.replicas.engine.slots import Phase, Running
from baton_serve.replicas.engine.stats import EngineStats
from baton_serve.replicas.engine.step_guard import StepGuard
from baton_serve.replicas.engine.step_plan import Piece, StepPlan


class StepExecutor:
    """Executes `plan_step`'s steps for the engine loop (the one thread owning the context)."""

    def __init__(
        self,
        config: EngineConfig,
        guard: StepGuard,
        cache: PrefixCache,
        stats: EngineStats,
        sample: Callable[[Running, np.ndarray], None],
    ) -> None:
        """`sample` takes a stream's next token from its logits row (and may finish it)."""
        self._config = config
        self._context = cache.states.context
        self._stats = stats
        self._sample = sample
        self._guard = guard
        self._states = cache.states

    def run(self, plan: StepPlan[object, Running]) -> None:
        """Compute `plan`'s step (nothing if it has none). An image's piece is a call of its
        own (its rows are embeddings, not token ids)."""
        images = [piece for piece in plan.prefill if _is_image(piece)]
        texts = [piece for piece in plan.prefill if not _is_image(piece)]
        if self._config.one_call_steps:
            self._one_call_step(list(plan.decode), texts)
        else:
            if plan.decode:
                self._decode_step(list(plan.decode))
            for piece in texts:
                if piece.key.slot.running is piece.key:  # not failed by an earlier part
                    self._prefill_step(piece)
        for piece in images:
            if piece.key.slot.running is piece.key:
                self._image_step(piece)

    def _one_call_step(self, decoding: list[Running], pieces: Sequence[Piece[Running]]) -> None:
        """The decode rows and every piece in one llama_decode."""
        if not decoding and not pieces:
            return
        entries = self._decode_entries(decoding)
        parts = [self._piece_entries(piece) for piece in pieces]
        for part in parts:
            entries += part
        started = time.perf_counter()
        logits = self._guard.decode(entries, decoding + [piece.key for piece in pieces])
        if logits is None:
            return
        seconds = time.perf_counter() - started
        if not pieces:
            self._decode_call_took(seconds)
        if decoding:
            self._decoded(decoding, logits)
        offset = len(decoding)
        for piece, part in zip(pieces, parts, strict=True):
            # the call's time shared by token: a piece's share of it is its prefill time
            self._computed(piece, logits, offset, seconds * len(part) / len(entries))
            offset += len(part)

    def _decode_step(self, runs: list[Running]) -> None:
        started = time.perf_counter()
        logits = self._guard.decode(self._decode_entries(runs), runs)
        if logits is not None:
            self._decode_call_took(time.perf_counter() - started)
            self._decoded(runs, logits)

    def _decode_call_took(self, seconds: float) -> None:
        self._stats.decode_only_steps += 1
        self._stats.decode_call_seconds += seconds

    def _prefill_step(self, piece: Piece[Running]) -> None:
        entries = self._piece_entries(piece)
        started = time.perf_counter()
        logits = self._guard.decode(entries, [piece.key])
        if logits is not None:
            self._computed(piece, logits, 0, time.perf_counter() - started)

    def _image_step(self, piece: Piece[Running]) -> None:
        started = time.perf_counter()
        if self._guard.run("feeding an image", piece.key, self._feed_image, piece):
            self._computed(piece, {}, 0, time.perf_counter() - started)

    def _feed_image(self, piece: Piece[Running]) -> None:
        run = piece.key
        if run.handle.media is None:
            raise RuntimeError("an image's piece without its image")
        slot = run.slot
        run.handle.media.feed(
            self._context,
            piece.start,
            seq_id=slot.seq_id,
            position=slot.position,
            stats=self._stats,
        )

    def _decode_entries(self, runs: list[Running]) -> list[BatchEntry]:
        return [BatchEntry(r.slot.seq_id, r.pending_token, r.slot.position, True) for r in runs]

    def _piece_entries(self, piece: Piece[Running]) -> list[BatchEntry]:
        run, end = piece.key, piece.end
        wants_logits = run.phase is Phase.PREFILL and end == len(run.feed)
        position = run.slot.position - piece.start  # a text piece: one position a token
        return [
            BatchEntry(run.slot.seq_id, run.feed[p], position + p, wants_logits and p == end - 1)
            for p in range(piece.start, end)
        ]

    def _decoded(self, runs: list[Running], logits: dict[int, np.ndarray]) -> None:
        """Each stream's token is in its slot: sample its next."""
        self._stats.decode_steps += 1
        started = time.perf_counter()
        for i, run in enumerate(runs):
            run.slot.computed((run.pending_token,))
            self._guard.run("sampling a token", run, self._sample, run, logits[i])
        self._stats.sample_seconds += time.perf_counter() - started

    def _computed(
        self, piece: Piece[Running], logits: dict[int, np.ndarray], offset: int, seconds: float
    ) -> None:
        """A piece is in its slot: keep its anchor and checkpoint, sample the prompt's first
        token (and fork its other choices) or end the replay."""
        run, start, end = piece.key, piece.start, piece.end
        slot = run.slot
        run.pieces = [p for p in run.pieces if p > end]
        self._stats.prefill_seconds += seconds
        self._stats.prefill_steps += 1
        slot.computed(run.feed[start:end])
        if run.phase is Phase.PREFILL:
            self._stats.prompt_tokens_computed += end - start
        else:
            self._stats.replayed_tokens += end - start
        states = self._states
        if end in run.anchors:
            if not self._guard.run("keeping an anchor", run, states.anchor, slot):
                return
        if end in run.checkpoints:
            if not self._guard.run("saving a checkpoint", run, states.save, slot):
                return
        if run.phase is Phase.PREFILL and end == len(run.feed):
            row = logits[offset + end - start - 1]
            for fork in run.forks:  # n > 1: each choice starts from this prompt's state
                copy = states.copy
                if self._guard.run("copying its prompt's state", fork, copy, run.slot, fork.slot):
                    self._guard.run("sampling a token", fork, self._sample, fork, row)
                if run.handle.cancelled:
                    return  # failed: its other choices stop at the next step
            self._guard.run("sampling a token", run, self._sample, run, row)
        elif run.phase is Phase.REPLAY and not run.pieces and end == len(run.feed):
            slot.finished()  # its full state is stored when the engine is idle: `write_back`
            slot.release()


def _is_image(piece: Piece[Running]) -> bool:
    return is_media(piece.key.feed[piece.start])
