"""The replica engine: one llama.cpp context, several sequence slots, continuous batching.

One thread (the engine loop) owns the llama context. Requests join between steps. A step
is one `llama_decode`: either a *decode step* — one token for every generating sequence —
or a *prefill step* — the next piece of one sequence's prompt. When both kinds of work
wait, steps alternate, so a long prompt never stalls running streams for more than one
piece. (Mixing both in one call buys nothing here: with one KV stream per sequence and
with recurrent memory, llama.cpp splits a batch into equal-length sub-batches anyway.)

Prefix reuse, exact to the bit:
- attention-only models keep each idle slot's KV and truncate it to the matched prefix;
  a slot's state is saved to the checkpoint store when the slot is given to another prompt;
- hybrid and recurrent models cannot truncate their recurrent state, so the engine saves
  full sequence states at exact positions (`checkpoint_policy`) and restores the longest
  one that prefixes a new prompt.
- every cached state is what a from-scratch prefill computes: prompts are computed in
  pieces of two or more tokens, and after a reply is sent it is recomputed as a prefill
  (a *replay*) instead of keeping the state built one token at a time, whose kernels round
  differently. A resumed conversation thus gives the same logits as a cold one.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cache_store.checkpoint_store import Checkpoint, CheckpointStore
from cache_store.prefix_hash import PrefixHasher, common_prefix_length
from cache_store.state_blob import BlobError, decode_blob, encode_blob
from replicas import metrics
from replicas.checkpoint_policy import MIN_PIECE, prefill_checkpoints, prefill_pieces
from replicas.engine_config import EngineConfig, context_size
from replicas.llama_context import (
    BatchEntry,
    ContextParams,
    DecodeError,
    LlamaContext,
    StateRestoreError,
)
from replicas.llama_model import LlamaModel
from replicas.logs import request_fields
from replicas.prompt import (
    ChatMessage,
    Prompt,
    PromptError,
    chat_prompt,
    model_chat_template,
    no_chat_template_message,
    text_prompt,
)
from replicas.protocol import (
    Completion,
    EngineClosed,
    EngineError,
    GenerationRequest,
    PromptTooLong,
    Timings,
    TokenEvent,
    Usage,
)
from replicas.request_handle import RequestHandle
from replicas.sampling import SamplingParams, TokenSampler
from replicas.slots import Phase, Running, Slot
from replicas.text_stream import TextStream

logger = logging.getLogger("baton.engine")


class CheckpointListener(Protocol):
    """Told about the local store's contents; called on the engine thread, must be quick."""

    def checkpoint_added(self, checkpoint: Checkpoint) -> None: ...

    def checkpoint_used(self, checkpoint: Checkpoint) -> None: ...

    def checkpoint_removed(self, checkpoint: Checkpoint) -> None: ...


@dataclass(frozen=True)
class EngineLoad:
    """What the engine is doing right now (for routing)."""

    queued: int  # submitted, waiting for a slot
    running: int  # in a slot (prefill, decode or replay)
    free_slots: int


@dataclass
class EngineStats:
    """Counters since start (written by the engine loop, readable from any thread)."""

    requests: int = 0
    decode_steps: int = 0
    prefill_steps: int = 0
    prompt_tokens_computed: int = 0
    replayed_tokens: int = 0
    checkpoints_saved: int = 0
    checkpoints_restored: int = 0
    checkpoints_imported: int = 0
    prefill_seconds: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Measured prefill speed (prompt and replay tokens per second), once known."""
        tokens = self.prompt_tokens_computed + self.replayed_tokens
        return tokens / self.prefill_seconds if self.prefill_seconds > 0 and tokens >= 64 else None


class Engine:
    """Serves generation requests for one model from one llama.cpp context."""

    def __init__(
        self,
        model_path: str,
        config: EngineConfig | None = None,
        *,
        hmac_key: bytes,
        listener: CheckpointListener | None = None,
    ) -> None:
        if not hmac_key:
            raise ValueError("an HMAC key is required to sign and check state blobs")
        self.config = config or EngineConfig()
        self._hmac_key = hmac_key
        self.model = LlamaModel(
            model_path, n_gpu_layers=self.config.n_gpu_layers, cpu_repack=self.config.cpu_repack
        )
        self.kind = self.model.kind
        self.fingerprint = self.model.fingerprint
        self.hasher = PrefixHasher(self.fingerprint, self.config.block_tokens)
        self.listener = listener  # may be set later, before requests arrive
        self.store = CheckpointStore(self.config.store_budget_bytes, on_evict=self._evicted)
        self.stats = EngineStats()
        self._context = LlamaContext(
            self.model,
            ContextParams(
                n_ctx_per_seq=context_size(self.config.n_ctx, self.model.n_ctx_train),
                n_seqs=self.config.n_slots,
                n_batch=self.config.n_batch,
                n_threads=self.config.n_threads,
                flash_attn=self.config.flash_attn,
            ),
        )
        self.n_ctx = self._context.n_ctx_per_seq
        self._state_size = self._measure_state_size()
        self._chat_template = model_chat_template(self.model, self.config.chat_template)
        self._slots = [Slot(seq_id=i) for i in range(self.config.n_slots)]
        self._waiting: list[RequestHandle] = []
        self._wakeup = threading.Condition()
        self._closed = False
        self._idle = threading.Event()
        self._last_step_was_prefill = False
        self._thread = threading.Thread(target=self._run, name="baton-engine", daemon=True)
        self._thread.start()

    # ---- prompts -------------------------------------------------------------------------

    def text_prompt(self, text: str) -> Prompt:
        self._check_open()
        return text_prompt(self.model, text, add_bos=self.model.add_bos)

    def chat_prompt(self, messages: list[ChatMessage] | list[dict[str, str]]) -> Prompt:
        self._check_open()
        if self._chat_template is None:
            raise PromptError(no_chat_template_message(self.model.name))
        parsed = [m if isinstance(m, ChatMessage) else ChatMessage(**m) for m in messages]
        return chat_prompt(self.model, self._chat_template, parsed)

    # ---- requests ------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises `PromptError`, `PromptTooLong` or `EngineClosed` at once."""
        n_prompt = len(request.prompt)
        if n_prompt == 0:
            raise PromptError("the prompt is empty")
        if n_prompt >= self.n_ctx:
            raise PromptTooLong(n_prompt, self.n_ctx)
        if not all(0 <= t < self.model.n_vocab for t in request.prompt.tokens):
            raise PromptError(f"token ids must be in [0, {self.model.n_vocab})")
        handle = RequestHandle(request)
        with self._wakeup:
            if self._closed:
                raise EngineClosed("the engine is shut down")
            self._waiting.append(handle)
            self._idle.clear()
            self._wakeup.notify()
        return handle

    def generate(
        self, prompt: Prompt, sampling: SamplingParams | None = None, *, return_logits: bool = False
    ) -> Completion:
        """Submit and wait for the completion."""
        request = GenerationRequest(
            prompt=prompt, sampling=sampling or SamplingParams(), return_logits=return_logits
        )
        return self.submit(request).result()

    # ---- checkpoints as bytes ------------------------------------------------------------

    def export_checkpoint(self, prefix_hash: bytes) -> bytes | None:
        """A signed state blob of a stored checkpoint, or None if it is not here."""
        checkpoint = self.store.get(prefix_hash)
        if checkpoint is None:
            return None
        return encode_blob(
            fingerprint=self.fingerprint,
            prefix_hash=checkpoint.prefix_hash,
            tokens=checkpoint.tokens,
            state=checkpoint.state,
            key=self._hmac_key,
        )

    def import_checkpoint(self, blob: bytes | memoryview | np.ndarray) -> Checkpoint:
        """Validate a state blob fully and keep it in the local store.

        Raises `BlobError` for anything that is not an authentic, intact blob of this
        model: llama.cpp only ever sees a blob that passed every check.
        """
        try:
            checkpoint = self._checked_checkpoint(blob)
        except BlobError as exc:
            metrics.BLOBS_REJECTED.inc(reason=exc.reason)
            raise
        if not self.store.put(checkpoint):
            metrics.BLOBS_REJECTED.inc(reason="over_budget")
            raise EngineError(
                f"a {checkpoint.nbytes}-byte checkpoint exceeds the store budget "
                f"({self.store.budget_bytes} bytes)"
            )
        self.stats.checkpoints_imported += 1
        self._added(checkpoint)
        return checkpoint

    def _checked_checkpoint(self, blob: bytes | memoryview | np.ndarray) -> Checkpoint:
        state = decode_blob(
            blob, key=self._hmac_key, fingerprint=self.fingerprint, hasher=self.hasher
        )
        if self._state_size is not None:
            fixed, per_token = self._state_size
            expected = fixed + per_token * state.n_tokens
            if len(state.state) != expected:
                raise BlobError(
                    "bad_state_size",
                    f"a {state.n_tokens}-token state of this model is {expected} bytes, "
                    f"the blob carries {len(state.state)}",
                )
        return Checkpoint(
            prefix_hash=state.prefix_hash, tokens=state.tokens, state=bytes(state.state)
        )

    def export_best(self, tokens: tuple[int, ...] | list[int], min_tokens: int = 0) -> bytes | None:
        """A signed blob of the longest stored checkpoint that prefixes `tokens`, if it is
        longer than `min_tokens` (what a peer asks for before pulling)."""
        checkpoint = self.store.longest_match(self.hasher, tokens, len(tokens))
        if checkpoint is None or checkpoint.n_tokens <= min_tokens:
            return None
        return self.export_checkpoint(checkpoint.prefix_hash)

    def reusable_tokens(self, tokens: tuple[int, ...]) -> int:
        """About how many tokens of `tokens` this engine could reuse right now.

        An estimate (idle slots are read without stopping the engine loop) for deciding
        whether pulling a longer prefix from a peer is worth it.
        """
        limit = max(0, len(tokens) - MIN_PIECE)
        _, stored = self._stored_prefix(tokens, limit, touch=False)
        live = max(
            (self._live_reuse(s, tokens, limit) for s in self._slots if s.running is None),
            default=0,
        )
        return max(live, stored)

    def _measure_state_size(self) -> tuple[int, int] | None:
        """The exact size of a state, so a signed but malformed blob never reaches llama.cpp.

        Sliding-window caches keep at most a window of tokens, so their size is not linear:
        for those models only the blob's own checks apply.
        """
        if self.model.sliding_window:
            return None
        return self._context.state_size_line(0, self.model.any_token)

    # ---- lifecycle -----------------------------------------------------------------------

    def load(self) -> EngineLoad:
        with self._wakeup:
            queued = len(self._waiting)
        running = sum(slot.running is not None for slot in self._slots)
        return EngineLoad(queued=queued, running=running, free_slots=len(self._slots) - running)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("the engine is shut down")

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or running (replays included); False on timeout."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        with self._wakeup:
            if self._closed:
                return
            self._closed = True
            self._wakeup.notify()
        self._thread.join()
        self._context.close()
        self.model.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the engine loop (owns the llama context) ----------------------------------------

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not self._closed and not self._waiting and not self._running():
                    self._idle.set()
                    self._wakeup.wait()
                if self._closed:
                    break
            try:
                self._step()
            except Exception:  # one bad step must not kill the loop
                logger.exception("engine step failed")
                self._fail_all(EngineError("internal engine error; see the replica log"))
        self._fail_all(EngineClosed("the engine is shut down"))
        with self._wakeup:
            waiting, self._waiting = self._waiting, []
        for handle in waiting:
            handle.finish(None, EngineClosed("the engine is shut down"))

    def _running(self) -> list[Running]:
        return [s.running for s in self._slots if s.running is not None]

    def _step(self) -> None:
        self._drop_cancelled()
        self._admit()
        running = self._running()
        decoding = [r for r in running if r.phase is Phase.DECODE]
        prefilling = [r for r in running if r.phase is not Phase.DECODE]
        if decoding and not (prefilling and not self._last_step_was_prefill):
            self._decode_step(decoding)
            self._last_step_was_prefill = False
        elif prefilling:
            self._prefill_step(min(prefilling, key=lambda r: r.submitted_at))
            self._last_step_was_prefill = True

    def _drop_cancelled(self) -> None:
        for run in self._running():
            if run.handle.cancelled and run.phase is not Phase.REPLAY:
                self._complete(run, "cancelled")
                if run.phase is Phase.DECODE:
                    self._rewind_to_prompt(run)
                self._release(run.slot)
        with self._wakeup:
            cancelled = [h for h in self._waiting if h.cancelled]
            self._waiting = [h for h in self._waiting if not h.cancelled]
        for handle in cancelled:
            handle.finish(_empty_completion(handle, "cancelled"))

    # ---- admission and prefix reuse ------------------------------------------------------

    def _admit(self) -> None:
        while True:
            free = [s for s in self._slots if s.running is None]
            with self._wakeup:
                if not free or not self._waiting or self._replay_pending_for(self._waiting[0]):
                    return
                handle = self._waiting.pop(0)
            self._start(handle, free)

    def _replay_pending_for(self, handle: RequestHandle) -> bool:
        """True while a slot is replaying the conversation this request continues.

        The next turn of a chat often arrives while the previous reply is still being
        replayed into the cache; waiting those few steps beats recomputing the reply.
        """
        if not self.config.prefix_cache:
            return False
        prompt = handle.request.prompt.tokens
        limit = len(prompt) - MIN_PIECE
        for run in self._running():
            if run.phase is Phase.REPLAY:
                common = common_prefix_length(run.feed, prompt, limit)
                if common > 0 and common >= min(limit, len(run.prompt) - MIN_PIECE):
                    return True
        return False

    def _start(self, handle: RequestHandle, free: list[Slot]) -> None:
        prompt = handle.request.prompt
        admitted_at = time.perf_counter()
        slot, cached = self._place(prompt.tokens, free)
        cuts = []
        if self.config.prefix_cache and self.kind.needs_checkpoints:
            cuts = prefill_checkpoints(
                prompt,
                cached=cached,
                interval=self.config.checkpoint_interval,
                max_interval=self.config.max_interval_checkpoints,
            )
        pieces = prefill_pieces(cached, len(prompt), cuts, self.config.prefill_chunk)
        params = handle.request.sampling
        slot.running = Running(
            handle=handle,
            slot=slot,
            cached=cached,
            feed=prompt.tokens,
            pieces=pieces,
            checkpoints=set(cuts) & set(pieces),
            sampler=TokenSampler(params),
            text=TextStream(self.model.token_bytes, params.stop),
            submitted_at=time.perf_counter(),
            admitted_at=admitted_at,
        )
        slot.last_used = time.monotonic()

    def _place(self, prompt: tuple[int, ...], free: list[Slot]) -> tuple[Slot, int]:
        """Pick a slot for `prompt` and load the longest reusable prefix into it."""
        if not self.config.prefix_cache:
            slot = self._victim(free)
            self._evict(slot)
            return slot, 0
        limit = max(0, len(prompt) - MIN_PIECE)  # the rest is computed as one exact piece
        live_slot, live = max(
            ((s, self._live_reuse(s, prompt, limit)) for s in free), key=lambda p: p[1]
        )
        checkpoint, stored = self._stored_prefix(prompt, limit)
        if checkpoint is not None and stored > live:
            slot = self._victim(free)
            self._evict(slot)
            if self._restore(slot, checkpoint):
                self.stats.checkpoints_restored += 1
                metrics.CHECKPOINTS_RESTORED.inc()
                if self.listener is not None:
                    self.listener.checkpoint_used(checkpoint)
                if stored < len(slot.tokens) and not self._cut(slot, stored):
                    return slot, 0  # attention KV: keep only the shared prefix, if it can
                return slot, stored
            return slot, 0
        if live:
            if len(live_slot.tokens) > live and not self._cut(live_slot, live):
                return live_slot, 0
            return live_slot, live
        slot = self._victim(free)
        self._evict(slot)
        return slot, 0

    def _stored_prefix(
        self, prompt: tuple[int, ...], limit: int, *, touch: bool = True
    ) -> tuple[Checkpoint | None, int]:
        """The stored checkpoint to restore for `prompt`, and how many tokens it gives.

        Hybrid and recurrent states only serve prompts they prefix exactly; an attention
        state also serves any prompt sharing its beginning (its KV is cut back after).
        """
        if self.kind.needs_checkpoints:
            checkpoint = self.store.longest_match(self.hasher, prompt, limit, touch=touch)
            return checkpoint, checkpoint.n_tokens if checkpoint is not None else 0
        return self.store.longest_shared_prefix(prompt, limit, touch=touch)

    def _live_reuse(self, slot: Slot, prompt: tuple[int, ...], limit: int) -> int:
        """Tokens of `prompt` this idle slot already holds and can keep."""
        common = common_prefix_length(slot.tokens, prompt, limit)
        if self.kind.needs_checkpoints and common < len(slot.tokens):
            return 0  # a recurrent state cannot be cut back
        return common

    def _cut(self, slot: Slot, n_tokens: int) -> bool:
        """Keep the first `n_tokens` of an attention slot. Where the memory cannot give
        them back (a sliding window has dropped some), empty the slot and return False."""
        if self._context.truncate(slot.seq_id, n_tokens):
            del slot.tokens[n_tokens:]
            return True
        self._context.clear(slot.seq_id)
        slot.tokens = []
        return False

    def _victim(self, free: list[Slot]) -> Slot:
        """The free slot whose contents are least worth keeping: empty first, then LRU."""
        return min(free, key=lambda s: (bool(s.tokens), s.last_used))

    def _evict(self, slot: Slot) -> None:
        """Empty a slot; an attention model's KV is saved to the store first."""
        if slot.tokens and self.config.prefix_cache and not self.kind.needs_checkpoints:
            self._save_checkpoint(slot)
        self._context.clear(slot.seq_id)
        slot.tokens = []

    def _restore(self, slot: Slot, checkpoint: Checkpoint) -> bool:
        try:
            self._context.restore_state(slot.seq_id, checkpoint.state)
        except StateRestoreError:
            logger.warning("dropping a checkpoint that llama.cpp refused to restore")
            self.store.remove(checkpoint.prefix_hash)
            slot.tokens = []
            return False
        slot.tokens = checkpoint.tokens.tolist()
        return True

    def _save_checkpoint(self, slot: Slot) -> None:
        prefix_hash = self.hasher.prefix_hash(slot.tokens)
        if prefix_hash in self.store:
            return
        state = self._context.save_state(slot.seq_id)
        checkpoint = Checkpoint(prefix_hash=prefix_hash, tokens=slot.tokens, state=state)
        if self.store.put(checkpoint):
            self.stats.checkpoints_saved += 1
            metrics.CHECKPOINTS_TAKEN.inc()
            self._added(checkpoint)

    def _added(self, checkpoint: Checkpoint) -> None:
        if self.listener is not None:
            self.listener.checkpoint_added(checkpoint)

    def _evicted(self, checkpoint: Checkpoint) -> None:
        metrics.CHECKPOINTS_EVICTED.inc()
        if self.listener is not None:
            self.listener.checkpoint_removed(checkpoint)

    def _rewind_to_prompt(self, run: Running) -> None:
        """Bring the slot back to an exact state within its prompt, dropping decode-time state."""
        slot, n_prompt = run.slot, len(run.prompt)
        if len(slot.tokens) <= n_prompt:
            return
        if not self.kind.needs_checkpoints:
            self._cut(slot, n_prompt)
            return
        checkpoint = self.store.longest_match(self.hasher, run.prompt, n_prompt)
        if checkpoint is None or not self._restore(slot, checkpoint):
            self._context.clear(slot.seq_id)
            slot.tokens = []

    # ---- steps ---------------------------------------------------------------------------

    def _decode_step(self, runs: list[Running]) -> None:
        runs = sorted(runs, key=lambda r: r.slot.seq_id)
        entries = [
            BatchEntry(r.slot.seq_id, r.pending_token, len(r.slot.tokens), True) for r in runs
        ]
        logits = self._decode(entries, runs)
        if logits is None:
            return
        self.stats.decode_steps += 1
        for i, run in enumerate(runs):
            run.slot.tokens.append(entries[i].token)
            self._sampled(run, logits[i])

    def _prefill_step(self, run: Running) -> None:
        slot = run.slot
        start, end = len(slot.tokens), run.pieces.pop(0)
        wants_logits = run.phase is Phase.PREFILL and end == len(run.feed)
        entries = [
            BatchEntry(slot.seq_id, run.feed[p], p, wants_logits and p == end - 1)
            for p in range(start, end)
        ]
        started = time.perf_counter()
        logits = self._decode(entries, [run])
        if logits is None:
            return
        self.stats.prefill_seconds += time.perf_counter() - started
        self.stats.prefill_steps += 1
        slot.tokens.extend(run.feed[start:end])
        if run.phase is Phase.PREFILL:
            self.stats.prompt_tokens_computed += end - start
        else:
            self.stats.replayed_tokens += end - start
        if end in run.checkpoints:
            self._save_checkpoint(slot)
        if wants_logits:
            self._sampled(run, logits[len(entries) - 1])
        elif run.phase is Phase.REPLAY and not run.pieces:
            self._release(slot)

    def _decode(
        self, entries: list[BatchEntry], runs: list[Running]
    ) -> dict[int, np.ndarray] | None:
        """Decode `entries`; return logits by batch index. On failure, fail `runs`."""
        try:
            return self._decode_split(entries, 0)
        except DecodeError as exc:
            ids = ",".join(run.handle.request.request_id for run in runs)
            logger.error("%s; failing %d request(s)", exc, len(runs), extra=request_fields(ids))
            for run in runs:
                self._fail(run, EngineError(str(exc)))
            return None

    def _decode_split(self, entries: list[BatchEntry], offset: int) -> dict[int, np.ndarray]:
        """One llama_decode; when the KV cache has no room, retry as two smaller batches."""
        try:
            self._context.decode(entries)
        except DecodeError as exc:
            if exc.code != 1 or len(entries) < 2:
                raise
            half = len(entries) // 2
            return self._decode_split(entries[:half], offset) | self._decode_split(
                entries[half:], offset + half
            )
        return {offset + i: self._context.logits(i) for i, e in enumerate(entries) if e.want_logits}

    def _sampled(self, run: Running, logits: np.ndarray) -> None:
        """Pick the next token from `logits`; stream it; finish when a stop rule fires."""
        params = run.params
        now = time.perf_counter()
        if run.last_token_at is not None:
            metrics.INTER_TOKEN.observe(now - run.last_token_at)
        run.last_token_at = now
        if run.first_token_at is None:
            run.first_token_at = now
            run.phase = Phase.DECODE
            if params.max_tokens == 0:
                self._finish(run, "length")
                return
        if run.handle.request.return_logits:
            run.last_logits = logits
        token = run.sampler(logits)
        if self.model.is_end_of_generation(token) and not params.ignore_eos:
            self._finish(run, "stop", end_token=token)
            return
        run.generated.append(token)
        run.pending_token = token
        delta = run.text.push(token)
        if delta or not run.text.stopped:
            run.handle.emit(TokenEvent(token=token, text=delta))
        if run.text.stopped:
            self._finish(run, "stop")
        elif len(run.generated) >= params.max_tokens or len(run.slot.tokens) + 1 >= self.n_ctx:
            self._finish(run, "length")

    # ---- finishing -----------------------------------------------------------------------

    def _finish(self, run: Running, reason: str, *, end_token: int | None = None) -> None:
        """Answer the client now; then replay the reply so the cache holds exact states."""
        rest = run.text.flush()
        if rest:
            run.handle.emit(TokenEvent(token=run.generated[-1], text=rest))
        self._complete(run, reason)
        if not self.config.prefix_cache:
            self._release(run.slot)
            return
        history = (
            run.prompt + tuple(run.generated) + ((end_token,) if end_token is not None else ())
        )
        history = history[: self.n_ctx]
        self._rewind_to_prompt(run)
        start = len(run.slot.tokens)
        if not start or len(history) - start < MIN_PIECE:
            self._release(run.slot)
            return
        run.phase = Phase.REPLAY
        run.feed = history
        run.pieces = prefill_pieces(start, len(history), [], self.config.prefill_chunk)
        run.checkpoints = {len(history)}  # every kind: the state peers may pull

    def _complete(self, run: Running, reason: str) -> None:
        n_prompt = len(run.prompt)
        now = time.perf_counter()
        first = run.first_token_at
        self.stats.requests += 1
        run.handle.finish(
            Completion(
                request_id=run.handle.request.request_id,
                tokens=list(run.generated),
                text=run.text.text,
                finish_reason=reason,
                usage=Usage(
                    prompt_tokens=n_prompt,
                    cached_tokens=run.cached,
                    computed_tokens=n_prompt - run.cached,
                    completion_tokens=len(run.generated),
                ),
                ttft_s=None if first is None else first - run.submitted_at,
                total_s=now - run.submitted_at,
                timings=Timings(
                    queued_s=run.admitted_at - run.handle.submitted_at,
                    restore_s=run.submitted_at - run.admitted_at,
                    prefill_s=(now if first is None else first) - run.submitted_at,
                    decode_s=0.0 if first is None else now - first,
                ),
                logits=run.last_logits,
            )
        )

    def _release(self, slot: Slot) -> None:
        slot.running = None
        slot.last_used = time.monotonic()

    def _fail(self, run: Running, error: EngineError) -> None:
        """Fail one request; its slot's state is unknown, so it is emptied."""
        if not run.handle.done:
            run.handle.finish(None, error)
        self._context.clear(run.slot.seq_id)
        run.slot.tokens = []
        self._release(run.slot)

    def _fail_all(self, error: EngineError) -> None:
        for run in self._running():
            self._fail(run, error)


def _empty_completion(handle: RequestHandle, reason: str) -> Completion:
    n = len(handle.request.prompt)
    return Completion(
        request_id=handle.request.request_id,
        tokens=[],
        text="",
        finish_reason=reason,
        usage=Usage(prompt_tokens=n, cached_tokens=0, computed_tokens=0, completion_tokens=0),
        ttft_s=None,
        total_s=0.0,
        timings=Timings(queued_s=time.perf_counter() - handle.submitted_at),
    )
