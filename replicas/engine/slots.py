"""Sequence slots and the requests running in them (engine-loop state)."""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from baton_serve.cache_store.media_tokens import positions_after
from baton_serve.cache_store.telemetry import metrics
from baton_serve.cache_store.wire.protocol import Completion, Timings, TokenEvent, Usage
from baton_serve.cache_store.wire.sampling_params import SamplingParams, TokenLogprob
from baton_serve.replicas.engine.checkpoint_policy import MIN_PIECE, prefill_pieces
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.request_handle import RequestHandle
from baton_serve.replicas.engine.sampling import TokenSampler, token_logprob
from baton_serve.replicas.engine.step_plan import RunView
from baton_serve.replicas.engine.text_stream import TextStream


class Phase(enum.Enum):
    PREFILL = "prefill"  # computing the prompt, piece by piece
    DECODE = "decode"  # generating one token per step
    REPLAY = "replay"  # answered; recomputing the reply as a prefill for the cache
    WAIT = "wait"  # another choice of an n > 1 request, waiting for the prompt's state


@dataclass
class Slot:
    """One llama.cpp sequence and the tokens whose state it holds.

    Only its own methods change `tokens` (`prefix_states` calls them with the llama.cpp
    operation that changes the state, the engine loop as it computes tokens), so what it
    holds and `chain`, the block hashes known for those tokens, always agree.

    `anchors` are partial states (recurrent and sliding-window memory, no attention KV) at
    positions of `tokens`: the slot can be rewound to any of them by loading it and cutting
    the attention cells, which stay valid while the tokens before it are unchanged; so the
    same methods drop an anchor the moment the tokens under it change.
    """

    seq_id: int
    running: Running | None = None
    last_used: float = 0.0
    _tokens: list[int] = field(default_factory=list, repr=False)
    # The block hash chain of a token sequence that `tokens` begins (a prompt's, from the
    # gateway), so its checkpoints are not hashed again; may be shorter or empty.
    _chain: tuple[bytes, ...] = field(default=(), repr=False)
    _anchors: dict[int, memoryview] = field(default_factory=dict, repr=False)
    # It holds a finished conversation whose full state is not stored yet (`write_back`).
    _unsaved: bool = field(default=False, repr=False)
    _position: int = field(default=0, repr=False)  # llama.cpp's next position: `position`

    @property
    def tokens(self) -> Sequence[int]:
        """The tokens whose state the slot holds (read-only: change it by the methods)."""
        return self._tokens

    @property
    def chain(self) -> tuple[bytes, ...]:
        return self._chain

    @property
    def position(self) -> int:
        """The llama.cpp position its next token takes: one per token it holds, less the
        positions images leave out under M-RoPE (`media_tokens.positions_after`)."""
        return self._position

    def position_at(self, n_tokens: int) -> int:
        """The llama.cpp position of its `n_tokens`-th token."""
        if n_tokens >= len(self._tokens):
            return self._position + n_tokens - len(self._tokens)
        return positions_after(self._tokens[:n_tokens])

    @property
    def anchors(self) -> Mapping[int, memoryview]:
        """Partial states by the number of tokens they follow (read-only)."""
        return MappingProxyType(self._anchors)

    @property
    def unsaved(self) -> bool:
        """It holds a finished conversation whose full state is not stored yet."""
        return self._unsaved

    def holds(
        self,
        tokens: Iterable[int],
        chain: Sequence[bytes] = (),
        anchors: Mapping[int, memoryview] | None = None,
    ) -> None:
        """Its state is now that of `tokens` (restored, copied) whose chain begins `chain`;
        `anchors`: those of the slot it was copied from."""
        self._tokens, self._chain = list(tokens), tuple(chain)
        self._anchors, self._unsaved = dict(anchors or {}), False
        self._position = positions_after(self._tokens)

    def computed(self, tokens: Iterable[int]) -> None:
        """Its state now also holds `tokens`, which continue the sequence `chain` hashes."""
        added = list(tokens)
        self._tokens.extend(added)
        self._position += positions_after(added)
        self._unsaved = False

    def anchored(self, partial: memoryview, most: int) -> None:
        """`partial` is the partial state after its tokens so far; of more than `most`
        anchors, the lowest go (the later turns of a conversation are the ones resumed)."""
        self._anchors[len(self._tokens)] = partial
        for position in sorted(self._anchors)[: max(0, len(self._anchors) - most)]:
            del self._anchors[position]

    def finished(self) -> None:
        """It holds a finished conversation, worth storing when the engine is idle."""
        self._unsaved = True

    def stored(self) -> None:
        """What it holds is in the checkpoint store now."""
        self._unsaved = False

    def follows(self, chain: Sequence[bytes]) -> None:
        """`tokens` begin the token sequence that `chain` hashes (a request's prompt)."""
        self._chain = tuple(chain)

    def cut(self, n_tokens: int) -> None:
        """Its state now holds only the first `n_tokens`."""
        if n_tokens < len(self._tokens):
            del self._tokens[n_tokens:]
            self._anchors = {n: a for n, a in self._anchors.items() if n <= n_tokens}
            self._unsaved = False
            self._position = positions_after(self._tokens)

    def empty(self) -> None:
        """Its state now holds nothing."""
        self._tokens, self._chain, self._anchors, self._unsaved = [], (), {}, False
        self._position = 0

    def release(self) -> None:
        """No request runs here any more (what the slot holds stays, for reuse)."""
        self.running = None
        self.last_used = time.monotonic()


@dataclass
class Running:
    """A request being served in a slot."""

    handle: RequestHandle
    slot: Slot
    cached: int
    feed: tuple[int, ...]  # tokens the slot must hold when the current prefill is done
    pieces: list[int]  # end positions of the prefill pieces still to compute
    checkpoints: set[int]  # positions after which the full state is stored
    anchors: set[int]  # positions after which a partial state is kept (`Slot.anchors`)
    sampler: TokenSampler
    text: TextStream
    ready_at: float  # when the slot was ready (after `admitted_at` and any restore)
    admitted_at: float  # when it left the queue for this slot
    phase: Phase = Phase.PREFILL
    generated: list[int] = field(default_factory=list)
    pending_token: int | None = None  # sampled, not yet decoded
    first_token_at: float | None = None
    last_token_at: float | None = None
    last_logits: np.ndarray | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    index: int = 0  # which choice of the request
    forks: list[Running] = field(default_factory=list)  # choices that start from this prompt
    saved_bytes: int = 0  # `Timings.saved_bytes`, so far
    restored_bytes: int = 0  # `Timings.restored_bytes`, so far
    anchor_bytes: int = 0  # `Timings.anchor_bytes`, so far
    rewound_bytes: int = 0  # `Timings.rewound_bytes`, so far
    spans: tuple[tuple[int, int], ...] = ()  # the media spans of `feed` (`media_tokens`)

    def view(self) -> RunView[Running]:
        """What `plan_step` reads of it: a prompt or replay being computed (in the pieces
        `prefill_pieces` cut), a reply decoding, or a choice waiting to fork."""
        seq_id = self.slot.seq_id
        if self.phase in (Phase.PREFILL, Phase.REPLAY):
            done, end, pieces = len(self.slot.tokens), len(self.feed), tuple(self.pieces)
            whole = tuple(e for _, e in self.spans if e > done)
            return RunView(self, seq_id, False, done, end, pieces, self.ready_at, whole)
        return RunView(self, seq_id, decoding=self.phase is Phase.DECODE)

    def checkpoint_at(self, position: int, max_piece: int) -> bool:
        """Also save the state after `position` of a prefill still short of it, if a piece
        can end there; False if it cannot."""
        pieces = self._pieces_ending_at(position, max_piece)
        if pieces is None:
            return False
        self.pieces = pieces
        self.checkpoints.add(position)
        return True

    def can_checkpoint_at(self, position: int, max_piece: int) -> bool:
        """Whether `checkpoint_at(position, max_piece)` would succeed (it changes nothing)."""
        return self._pieces_ending_at(position, max_piece) is not None

    def _pieces_ending_at(self, position: int, max_piece: int) -> list[int] | None:
        """The prefill's pieces with one ending at `position`, if a piece can end there."""
        start = len(self.slot.tokens)
        if self.phase is not Phase.PREFILL or position - start < MIN_PIECE:
            return None
        cuts = [p for p in self.checkpoints | self.anchors if p > start] + [position]
        pieces = prefill_pieces(start, len(self.feed), cuts, max_piece, self.spans)
        return pieces if position in pieces else None

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.handle.request.prompt.tokens

    @property
    def params(self) -> SamplingParams:
        return self.handle.request.sampling

    def pick(
        self, logits: np.ndarray, is_end_of_generation: Callable[[int], bool]
    ) -> tuple[int | None, bool]:
        """The next token and whether it ends the reply (an end-of-generation or stop token
        id; None: a complete grammar left nothing to pick). A reply token's log-probability
        is recorded when asked for."""
        params = self.params
        token = self.sampler(logits)
        if token is None:
            return None, True
        end_of_generation = is_end_of_generation(token) and not params.ignore_eos
        self.sampler.accept(token, end_of_generation=end_of_generation)
        if end_of_generation or token in params.stop_token_ids:
            return token, True
        if params.logprobs is not None:
            self.logprobs.append(token_logprob(logits, token, params.logprobs))
        return token, False

    def sampled(
        self, logits: np.ndarray, is_end_of_generation: Callable[[int], bool], n_ctx: int
    ) -> tuple[str, int | None] | None:
        """Take the next token from `logits` and stream it; `(finish reason, end token)` when
        a stop rule fires (the end token, if one ended it, is not part of the reply)."""
        params, now = self.params, time.perf_counter()
        if self.last_token_at is not None:
            metrics.INTER_TOKEN.observe(now - self.last_token_at)
        self.last_token_at = now
        if self.first_token_at is None:
            self.first_token_at = now
            self.phase = Phase.DECODE
            if params.max_tokens == 0:
                return "length", None
        if self.handle.request.return_logits:
            self.last_logits = logits
        token, ends = self.pick(logits, is_end_of_generation)
        if token is None or ends:
            return "stop", token
        self.generated.append(token)
        self.pending_token = token
        delta = self.text.push(token)
        if delta or not self.text.stopped:
            logprob = self.logprobs[-1] if self.logprobs else None
            self.handle.emit(self.event(token, delta, logprob))
        if self.text.stopped:
            return "stop", None
        if len(self.generated) >= params.max_tokens or len(self.slot.tokens) + 1 >= n_ctx:
            return "length", None
        return None

    def event(self, token: int, text: str, logprob: TokenLogprob | None = None) -> TokenEvent:
        """The stream event for `token` (the last generated) making `text` visible."""
        return TokenEvent(
            token=token,
            text=text,
            logprob=logprob,
            index=self.index,
            completion_tokens=len(self.generated),
            cached_tokens=self.cached,
        )

    def completion(self, reason: str, now: float) -> Completion:
        """What the client gets when this request ends now, for `reason`."""
        n_prompt, first = len(self.prompt), self.first_token_at
        return Completion(
            index=self.index,
            request_id=self.handle.request.request_id,
            tokens=list(self.generated),
            text=self.text.text,
            finish_reason=reason,
            usage=Usage(
                prompt_tokens=n_prompt,
                cached_tokens=self.cached,
                computed_tokens=n_prompt - self.cached,
                completion_tokens=len(self.generated),
            ),
            ttft_s=None if first is None else first - self.admitted_at,
            total_s=now - self.admitted_at,
            timings=Timings(
                queued_s=self.admitted_at - self.handle.submitted_at,
                restore_s=self.ready_at - self.admitted_at,
                prefill_s=(now if first is None else first) - self.ready_at,
                decode_s=0.0 if first is None else now - first,
                restored_bytes=self.restored_bytes,
                saved_bytes=self.saved_bytes,
                anchor_bytes=self.anchor_bytes,
                rewound_bytes=self.rewound_bytes,
            ),
            logits=self.last_logits,
            logprobs=None if self.params.logprobs is None else list(self.logprobs),
        )


def start_request(
    handle: RequestHandle,
    model: LlamaModel,
    slot: Slot,
    free: Sequence[Slot],
    cached: int,
    pieces: list[int],
    checkpoints: set[int],
    anchors: set[int],
    admitted_at: float,
    n_ctx: int,
    *,
    max_grammar_nesting: int,
    spans: tuple[tuple[int, int], ...] = (),
) -> Running:
    """Put `handle`'s request in `slot` (which holds `cached` tokens of its prompt) and, for
    n > 1, its other choices in the least recently used other `free` slots, waiting to fork
    from the prompt's state. Each choice samples on its own; with a seed, choice i draws
    from seed + i. `n_ctx`, a slot's context, bounds the samplers' penalty windows."""
    request, started = handle.request, time.perf_counter()
    others = sorted((s for s in free if s is not slot), key=lambda s: s.last_used)
    runs = []
    for index, target in enumerate([slot, *others][: request.n]):
        params = request.sampling
        if index and params.seed is not None:
            params = params.model_copy(update={"seed": params.seed + index})
        sampler = TokenSampler(
            params,
            model.n_vocab,
            vocab=model.vocab,
            prompt=request.prompt.tokens,
            end_tokens=model.end_tokens if params.min_tokens else (),
            n_ctx=n_ctx,
            max_grammar_nesting=max_grammar_nesting,
        )
        target.running = Running(
            handle=handle,
            slot=target,
            cached=cached,
            feed=request.prompt.tokens,
            spans=spans,
            pieces=pieces if not index else [],
            checkpoints=checkpoints if not index else set(),
            anchors=anchors if not index else set(),
            sampler=sampler,
            text=TextStream(
                functools.partial(model.token_bytes, special=not params.skip_special_tokens),
                params.stop,
                keep_stop=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            ),
            ready_at=started,
            admitted_at=admitted_at,
            phase=Phase.PREFILL if not index else Phase.WAIT,
            index=index,
        )
        target.last_used = time.monotonic()
        runs.append(target.running)
    runs[0].forks = runs[1:]
    return runs[0]
